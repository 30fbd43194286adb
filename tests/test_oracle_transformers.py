"""transformers 5.23 `BailingHybridForCausalLM` as a numerical oracle for lingc's reference model.

Both models load the same random checkpoint, written by lingc in the original HF key naming
(architecture.md section 10); transformers renames the keys itself (conversion_mapping). The config
is one transformers supports (architecture.md section 9.4-9.5): num_hidden_layers a multiple of
layer_group_size, a single q_proj (q_lora_rank null), no SwiGLU clamp lists and no MTP layer.
q-LoRA, the clamp, the incomplete last group and MTP are checked in test_model_formulas.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lingc import checkpoint  # noqa: E402
from lingc.init import write_random_checkpoint  # noqa: E402
from lingc.presets import preset  # noqa: E402

ATOL = 1e-4          # fp32 logits, max abs difference
PROMPT_LEN = 70      # > 16: lingc prefills KDA with kda_chunk (transformers with its chunked form); > 64: two chunks
DECODE_STEPS = 16
BATCH = 2


def oracle_config():
    """test-tiny at the Flash query layout, 8 layers = two full groups of 4 (MLA at layers 3 and 7)."""
    return preset("test-tiny-qproj", num_hidden_layers=8, num_nextn_predict_layers=0,
                  expert_swiglu_limit_list=None, share_expert_swiglu_limit_list=None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(config, lingc model, transformers model, transformers loading info), both fp32, from one checkpoint."""
    cfg = oracle_config()
    ckpt = write_random_checkpoint(cfg, tmp_path_factory.mktemp("oracle_ckpt"), seed=1234)
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    ref.eval()
    ours = checkpoint.load(ckpt, dtype=torch.float32)
    return cfg, ours, ref, info


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, oracle_config().vocab_size, (BATCH, PROMPT_LEN), generator=g)


def test_oracle_config_is_supported_by_transformers():
    """The oracle config avoids every known gap of transformers (q-LoRA, clamp, MTP, incomplete group)."""
    cfg = oracle_config()
    assert cfg.num_hidden_layers % cfg.layer_group_size == 0
    assert cfg.q_lora_rank is None
    assert cfg.expert_limit(i := cfg.num_hidden_layers - 1) == 0 and cfg.shared_limit(i) == 0
    assert cfg.num_nextn_predict_layers == 0
    # transformers sizes the shared expert as moe_intermediate_size * n_shared_experts
    assert cfg.moe_shared_expert_intermediate_size == cfg.moe_intermediate_size


def test_transformers_loads_every_tensor(models):
    """transformers maps every tensor of lingc's checkpoint: nothing missing, unexpected or mis-shaped."""
    _, _, ref, info = models
    assert type(ref).__name__ == "BailingHybridForCausalLM"
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert not info["error_msgs"], info["error_msgs"]


def test_transformers_reads_our_config_json(models):
    """The config.json lingc writes is read by transformers as the same model (KDA head dim included)."""
    cfg, _, ref, _ = models
    c = ref.config
    # transformers overwrites head_dim with the rope dim; the KDA head dim lives in linear_head_dim
    assert c.linear_head_dim == cfg.head_dim
    assert c.head_dim == cfg.qk_rope_head_dim
    assert c.linear_num_heads == cfg.kda_heads
    assert c.linear_conv_kernel_dim == cfg.short_conv_kernel_size
    assert c.qk_head_dim == cfg.qk_head_dim
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert c.rope_parameters["rope_type"] == "default"
    assert c.rope_parameters["rope_theta"] == cfg.rope_theta
    assert c.kda_safe_gate is True and c.kda_lower_bound == cfg.kda_lower_bound
    assert c.rms_norm_eps == cfg.rms_norm_eps
    assert (c.num_local_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (
        cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group)
    assert c.n_shared_experts == cfg.num_shared_experts
    assert c.moe_intermediate_size == cfg.moe_intermediate_size
    assert c.routed_scaling_factor == cfg.routed_scaling_factor and c.norm_topk_prob is True
    assert c.layer_types == ["full_attention" if cfg.is_mla_layer(i) else "linear_attention"
                             for i in range(cfg.num_hidden_layers)]
    assert c.mlp_layer_types == ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)]
    # the rotary table covers exactly the rope dim, theta^(-2i/rope)
    inv_freq = ref.model.rotary_emb.inv_freq
    want = cfg.rope_theta ** (-torch.arange(0, cfg.qk_rope_head_dim, 2, dtype=torch.float64) / cfg.qk_rope_head_dim)
    torch.testing.assert_close(inv_freq.double(), want, rtol=1e-6, atol=0)


@torch.no_grad()
def test_full_forward_logits_match(models, prompt):
    """A full (uncached) forward of a 70-token prompt, B=2: fp32 logits within 1e-4 of transformers."""
    _, ours, ref, _ = models
    want = ref(prompt, use_cache=False).logits.float()
    got = ours(prompt)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"max |lingc - transformers| logits = {err:.3g}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@torch.no_grad()
def test_prefill_then_cached_decode_matches(models, prompt):
    """Prefill 70 tokens then 16 single-token cached steps (transformers' cache vs lingc's state):
    every step's logits within 1e-4, and the greedy token agrees at every step."""
    _, ours, ref, _ = models
    B, T0 = prompt.shape
    state = ours.new_state(B, T0 + DECODE_STEPS)

    out = ref(prompt, use_cache=True)
    cache = out.past_key_values
    want = out.logits.float()
    got, _ = ours.step(prompt, torch.arange(T0).expand(B, T0), state)
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"prefill: max |lingc - transformers| logits = {err:.3g}"

    for t in range(DECODE_STEPS):
        want_tok = want[:, -1].argmax(-1)
        got_tok = got[:, -1].argmax(-1)
        assert torch.equal(got_tok, want_tok), f"step {t}: greedy token {got_tok.tolist()} vs oracle {want_tok.tolist()}"
        token = want_tok.unsqueeze(1)                                            # [B, 1], fed to both
        out = ref(token, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        want = out.logits.float()
        got, _ = ours.step(token, torch.full((B, 1), T0 + t), state)
        err = (got - want).abs().max().item()
        assert err <= ATOL, f"decode step {t} (position {T0 + t}): max |lingc - transformers| logits = {err:.3g}"
    assert torch.equal(got[:, -1].argmax(-1), want[:, -1].argmax(-1))
