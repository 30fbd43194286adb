"""LingConfig: presets match architecture.md sections 1-2, JSON round trips, and bad configs are refused by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lingc.config import ConfigError, LingConfig
from lingc.model import LingForCausalLM
from lingc.presets import PRESETS, preset

B = 1e9


def test_dict_round_trip_every_preset() -> None:
    for name in PRESETS:
        cfg = preset(name)
        d = cfg.to_dict()
        assert d["architectures"] == ["BailingMoeV3ForCausalLM"] and d["model_type"] == "bailing_hybrid"
        back = LingConfig.from_dict(json.loads(json.dumps(d)))          # through real JSON types
        assert back == cfg and back.to_dict() == d, name


@pytest.mark.parametrize("name", list(PRESETS))
def test_json_file_round_trip(name: str, tmp_path: Path) -> None:
    cfg = preset(name)
    cfg.to_json(tmp_path / "config.json")
    assert LingConfig.from_json(tmp_path) == cfg                          # a directory means its config.json


def test_unknown_keys_survive_round_trip() -> None:
    d = preset("test-tiny").to_dict() | {"mtp_loss_scaling_factor": 0.1, "auto_map": {"x": "y"}}
    cfg = LingConfig.from_dict(d)
    assert cfg.extra == {"mtp_loss_scaling_factor": 0.1}                 # auto_map is a loader detail, dropped
    assert cfg.to_dict()["mtp_loss_scaling_factor"] == 0.1


def test_transformers5_spellings_accepted() -> None:
    """HF v5 writes `dtype` and `scoring_func`; eos may be a list."""
    d = preset("test-tiny").to_dict()
    d.pop("torch_dtype"), d.pop("score_function")
    d |= {"dtype": "float32", "scoring_func": "sigmoid", "eos_token_id": [511, 509],
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = LingConfig.from_dict(d)
    assert cfg.torch_dtype == "float32" and cfg.score_function == "sigmoid" and cfg.eos_token_ids == (511, 509)


# ---- presets against architecture.md ------------------------------------------------------

TABLE = {   # architecture.md 1.1: (Flash, Tiny)
    "vocab_size": (157184, 157184), "hidden_size": (2560, 1536), "num_hidden_layers": (42, 24),
    "layer_group_size": (6, 4), "first_k_dense_replace": (2, 1), "intermediate_size": (6144, 4608),
    "num_attention_heads": (32, 16), "head_dim": (128, 128), "q_lora_rank": (None, 256), "kv_lora_rank": (512, 512),
    "qk_nope_head_dim": (128, 128), "qk_rope_head_dim": (64, 64), "v_head_dim": (128, 128),
    "num_experts": (512, 128), "num_experts_per_tok": (8, 8), "num_shared_experts": (1, 1),
    "moe_intermediate_size": (768, 512), "moe_shared_expert_intermediate_size": (768, 512),
    "n_group": (8, 8), "topk_group": (4, 4), "routed_scaling_factor": (2.5, 2.5), "rope_theta": (6e6, 6e6),
    "max_position_embeddings": (262144, 131072), "num_nextn_predict_layers": (1, 0),
    "kda_lower_bound": (-5.0, -5.0), "rms_norm_eps": (1e-6, 1e-6), "eos_token_id": (156895, 156895),
    "pad_token_id": (156892, 156892), "short_conv_kernel_size": (4, 4), "tie_word_embeddings": (False, False),
}


@pytest.mark.parametrize("key", list(TABLE))
def test_preset_values_match_table(key: str) -> None:
    flash, tiny = TABLE[key]
    assert getattr(preset("ling-3.0-flash"), key) == flash
    assert getattr(preset("ling-3.0-tiny"), key) == tiny


def test_layer_pattern_and_dense_layers() -> None:
    flash, tiny = preset("ling-3.0-flash"), preset("ling-3.0-tiny")
    assert [i for i in range(42) if flash.is_mla_layer(i)] == [5, 11, 17, 23, 29, 35, 41]
    assert [i for i in range(24) if tiny.is_mla_layer(i)] == [3, 7, 11, 15, 19, 23]
    assert [i for i in range(42) if not flash.is_moe_layer(i)] == [0, 1]
    assert [i for i in range(24) if not tiny.is_moe_layer(i)] == [0]
    assert flash.is_mla_layer(42) and flash.is_moe_layer(42)             # the MTP layer: MLA + MoE
    assert flash.mla_latent_dim == 576 and flash.kda_dim == 4096 and tiny.kda_dim == 2048


def test_flash_clamp_layers() -> None:
    flash = preset("ling-3.0-flash")
    assert {i: flash.expert_limit(i) for i in range(43) if flash.expert_limit(i)} == {i: 4.0 for i in range(35, 42)}
    assert {i: flash.shared_limit(i) for i in range(43) if flash.shared_limit(i)} == \
        {**{i: 5.0 for i in range(34, 40)}, 40: 7.0, 41: 7.0}
    tiny = preset("ling-3.0-tiny")
    assert tiny.expert_swiglu_limit_list is None and not any(tiny.shared_limit(i) for i in range(24))


def _param_counts(cfg: LingConfig) -> tuple[float, float, float]:
    """(total without MTP, MTP, active per token counting both embedding matrices), in billions."""
    with torch.device("meta"):
        model = LingForCausalLM(cfg)
    L, main, mtp, routed = cfg.num_hidden_layers, 0, 0, 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= L:
            mtp += p.numel()
            continue
        main += p.numel()
        routed += p.numel() if ".experts." in name else 0
    active = main - routed * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    return main / B, mtp / B, active / B


def test_parameter_counts() -> None:
    """architecture.md 1.2: Flash 124.41 B + 3.07 B MTP, 5.51 B active; Tiny 7.89 B, 1.38 B active."""
    total, mtp, active = _param_counts(preset("ling-3.0-flash"))
    assert (round(total, 2), round(mtp, 2), round(active, 2)) == (124.41, 3.07, 5.51)
    total, mtp, active = _param_counts(preset("ling-3.0-tiny"))
    assert (round(total, 2), mtp, round(active, 2)) == (7.89, 0.0, 1.38)


@pytest.mark.parametrize("name", ["test-tiny", "test-tiny-qproj"])
def test_test_tiny_covers_every_path(name: str) -> None:
    c = preset(name)
    L, G = c.num_hidden_layers, c.layer_group_size
    kinds = [c.is_mla_layer(i) for i in range(L)]
    assert any(kinds) and not all(kinds)                                  # KDA and MLA layers
    assert L % G != 0 and all(kinds[(L // G) * G:])                       # incomplete last group, all MLA
    assert not c.is_moe_layer(0) and c.is_moe_layer(L - 1)                # dense then MoE
    assert 1 < c.topk_group < c.n_group                                   # grouped routing drops groups
    limits = [c.expert_limit(i) for i in range(L)] + [c.shared_limit(i) for i in range(L)]
    assert any(limits) and not all(limits)                                # clamps on some layers only
    assert c.num_nextn_predict_layers == 1
    assert (c.q_lora_rank is None) == (name == "test-tiny-qproj")


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(KeyError, match="test-tiny"):
        preset("ling-3.0-huge")


def test_lists_become_tuples() -> None:
    c = preset("test-tiny", expert_swiglu_limit_list=[0.0, 0.5])
    assert c.expert_swiglu_limit_list == (0.0, 0.5) and c.expert_limit(1) == 0.5 and c.expert_limit(5) == 0.0


# ---- refusals ---------------------------------------------------------------------------

def _drop(key: str):
    return lambda d: d.pop(key)


BAD = {   # id: (edit of test-tiny's config dict, field the message must name)
    "model_type": (lambda d: d.update(model_type="bailing_moe"), "model_type"),
    "ling2-arch": (lambda d: d.update(architectures=["BailingMoeV2ForCausalLM"]), "architectures"),
    "ling2-linear-arch": (lambda d: d.update(architectures=["BailingMoeLinearV2ForCausalLM"]), "architectures"),
    "arch-missing": (_drop("architectures"), "architectures"),
    "marker-no_kda_lora": (_drop("no_kda_lora"), "no_kda_lora"),
    "marker-kda_safe_gate": (_drop("kda_safe_gate"), "kda_safe_gate"),
    "kda-lora": (lambda d: d.update(no_kda_lora=False), "no_kda_lora"),
    "unsafe-gate": (lambda d: d.update(kda_safe_gate=False), "kda_safe_gate"),
    "lower-bound": (lambda d: d.update(kda_lower_bound=1.0), "kda_lower_bound"),
    "neg-hidden": (lambda d: d.update(hidden_size=-128), "hidden_size"),
    "zero-experts": (lambda d: d.update(num_experts=0), "num_experts"),
    "neg-layers": (lambda d: d.update(num_hidden_layers=-2), "num_hidden_layers"),
    "neg-moe-inter": (lambda d: d.update(moe_intermediate_size=-64), "moe_intermediate_size"),
    "neg-dense": (lambda d: d.update(first_k_dense_replace=-1), "first_k_dense_replace"),
    "neg-mtp": (lambda d: d.update(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
    "float-size": (lambda d: d.update(head_dim=32.0), "head_dim"),
    "str-size": (lambda d: d.update(vocab_size="512"), "vocab_size"),
    "bool-size": (lambda d: d.update(kv_lora_rank=True), "kv_lora_rank"),
    "q_lora-zero": (lambda d: d.update(q_lora_rank=0), "q_lora_rank"),
    "n_group-divides": (lambda d: d.update(n_group=3), "n_group"),
    "topk_group>n_group": (lambda d: d.update(topk_group=5), "topk_group"),
    "too-many-experts-per-tok": (lambda d: d.update(num_experts_per_tok=9), "num_experts_per_tok"),
    "softmax": (lambda d: d.update(score_function="softmax"), "score_function"),
    "softmax-hf-key": (lambda d: (d.pop("score_function"), d.update(scoring_func="softmax")), "score_function"),
    "scoring-disagree": (lambda d: d.update(scoring_func="softmax"), "scoring_func"),
    "topk_method": (lambda d: d.update(topk_method="greedy"), "topk_method"),
    "no-bias-routing": (lambda d: d.update(moe_router_enable_expert_bias=False), "moe_router_enable_expert_bias"),
    "no-renorm": (lambda d: d.update(norm_topk_prob=False), "norm_topk_prob"),
    "router-dtype": (lambda d: d.update(router_dtype="bf16"), "router_dtype"),
    "rope_scaling": (lambda d: d.update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
    "rope_parameters": (lambda d: d.update(rope_parameters={"rope_type": "yarn"}), "rope_parameters"),
    "rope-odd": (lambda d: d.update(qk_rope_head_dim=15), "qk_rope_head_dim"),
    "rope-not-interleaved": (lambda d: d.update(rope_interleave=False), "rope_interleave"),
    "tied": (lambda d: d.update(tie_word_embeddings=True), "tie_word_embeddings"),
    "qkv-bias": (lambda d: d.update(use_qkv_bias=True), "use_qkv_bias"),
    "bias": (lambda d: d.update(use_bias=True), "use_bias"),
    "gate-granularity": (lambda d: d.update(gated_attention_proj_granularity_type="element_wise"),
                         "gated_attention_proj_granularity_type"),
    "mtp-kda": (lambda d: d.update(mtp_use_kda=True), "mtp_use_kda"),
    "qk_head_dim": (lambda d: d.update(qk_head_dim=200), "qk_head_dim"),
    "use_kda_lora": (lambda d: d.update(use_kda_lora=True), "use_kda_lora"),
    "hidden_act": (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
    "dense>layers": (lambda d: d.update(first_k_dense_replace=7), "first_k_dense_replace"),
    "clamp-too-long": (lambda d: d.update(expert_swiglu_limit_list=[0.0] * 8), "expert_swiglu_limit_list"),
    "clamp-negative": (lambda d: d.update(share_expert_swiglu_limit_list=[-1.0]), "share_expert_swiglu_limit_list"),
    "clamp-scalar": (lambda d: d.update(expert_swiglu_limit_list=4.0), "expert_swiglu_limit_list"),
    "eos": (lambda d: d.update(eos_token_id="</s>"), "eos_token_id"),
    "dtype": (lambda d: d.update(torch_dtype="int8"), "torch_dtype"),
    "eps": (lambda d: d.update(rms_norm_eps=0), "rms_norm_eps"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_refused_naming_field(case: str, tmp_path: Path) -> None:
    edit, field = BAD[case]
    d = preset("test-tiny").to_dict()
    edit(d)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        LingConfig.from_json(path)
    assert f"'{field}'" in str(e.value) and str(path) in str(e.value), str(e.value)


def test_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "bailing_hybrid",')
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        LingConfig.from_json(path)
    assert str(path) in str(e.value)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        LingConfig.from_json(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        LingConfig.from_json(tmp_path)


def test_direct_construction_validates() -> None:
    with pytest.raises(ConfigError, match="'topk_group'"):
        preset("test-tiny", topk_group=8)
