"""Named configs: the two published Ling-3.0 models and small test models that exercise every code path."""

from __future__ import annotations

from lingc.config import LingConfig

FLASH_EXPERT_LIMITS = tuple([0.0] * 35 + [4.0] * 7)                 # layers 35-41 (architecture.md 1.1)
FLASH_SHARED_LIMITS = tuple([0.0] * 34 + [5.0] * 6 + [7.0] * 2)      # 34-39: 5.0, 40-41: 7.0

_FLASH = dict(
    hidden_size=2560, num_hidden_layers=42, layer_group_size=6, first_k_dense_replace=2, intermediate_size=6144,
    num_attention_heads=32, num_key_value_heads=32, q_lora_rank=None, num_experts=512,
    moe_intermediate_size=768, moe_shared_expert_intermediate_size=768, max_position_embeddings=262144,
    num_nextn_predict_layers=1, expert_swiglu_limit_list=FLASH_EXPERT_LIMITS,
    share_expert_swiglu_limit_list=FLASH_SHARED_LIMITS)

_TINY: dict = {}   # LingConfig's defaults are Ling-3.0-tiny

# Small enough for CPU tests, yet: KDA + MLA (q-LoRA) layers, a final incomplete group (layers 4-5 are
# MLA), a dense layer then MoE layers, grouped routing (4 groups, 2 kept), clamps that bind with random
# weights (also on the MTP layer, index 6), and one MTP layer.
_TEST_TINY = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=6, layer_group_size=4, first_k_dense_replace=1,
    intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=32, q_lora_rank=48,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=16,
    num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=64,
    moe_shared_expert_intermediate_size=64, max_position_embeddings=4096, num_nextn_predict_layers=1,
    expert_swiglu_limit_list=(0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1),
    share_expert_swiglu_limit_list=(0.0, 0.0, 0.0, 0.15, 0.15, 0.2, 0.0),
    eos_token_id=511, pad_token_id=510, rope_theta=10000.0)

# The Flash query layout (one q_proj) at test-tiny size.
_TEST_TINY_QPROJ = dict(_TEST_TINY, q_lora_rank=None)

PRESETS: dict[str, dict] = {
    "ling-3.0-flash": _FLASH,
    "ling-3.0-tiny": _TINY,
    "test-tiny": _TEST_TINY,
    "test-tiny-qproj": _TEST_TINY_QPROJ,
}


LAYER_LISTS = ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list")   # one entry per layer, MTP last


def _resize(values: tuple[float, ...] | None, layers: int, mtp: int, new_layers: int,
            new_mtp: int) -> tuple[float, ...] | None:
    """A per-layer list for new_layers target + new_mtp MTP layers: layer i keeps its entry, MTP layers theirs."""
    if values is None:
        return None
    target, mtp_part = tuple(values[:layers])[:new_layers], tuple(values[layers:layers + mtp])[:new_mtp]
    return target + (0.0,) * (new_layers - len(target)) + mtp_part if mtp_part else target


def preset(name: str, **overrides) -> LingConfig:
    """The config of a named preset, with field overrides (e.g. num_hidden_layers=4).

    Overriding the layer counts resizes the preset's per-layer lists to match, unless they are overridden too.
    """
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    base = LingConfig(**PRESETS[name]) if {"num_hidden_layers", "num_nextn_predict_layers"} & overrides.keys() else None
    for key in LAYER_LISTS:
        if base is not None and key not in overrides:
            fields[key] = _resize(getattr(base, key), base.num_hidden_layers, base.num_nextn_predict_layers,
                                  fields.get("num_hidden_layers", base.num_hidden_layers),
                                  fields.get("num_nextn_predict_layers", base.num_nextn_predict_layers))
    return LingConfig(**fields)
