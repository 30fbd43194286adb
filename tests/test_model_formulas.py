"""Independent formula checks for the parts of Ling-3.0 that transformers 5.23 lacks (architecture.md 9.4).

Each reference is written out here in plain torch from architecture.md (sections 2, 3, 5, 6, 7), and
reads the weights straight from the checkpoint files under their original HF names, so neither
lingc.ops nor lingc's loader (expert stacking, gate/up fusion) is used to compute the expected value:
  (a) the q-LoRA MLA query path (q_a -> RMSNorm -> q_b) and the rest of one gated-MLA layer;
  (b) the MoE layer with a binding SwiGLU clamp, including the grouped sigmoid router;
  (c) the final incomplete layer group (all MLA) and the per-layer state it implies;
  (d) the MTP / NextN layer.
All in fp32, tolerance 1e-5.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from safetensors.torch import load_file

from lingc import checkpoint
from lingc.init import write_random_checkpoint
from lingc.model import step_meta
from lingc.modules import KDA, MLA
from lingc.presets import preset

ATOL = 1e-5
B, T = 2, 9


# ---- fixtures -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, fp32 lingc model, {checkpoint key: fp32 tensor}) for preset test-tiny (q-LoRA, clamps, MTP)."""
    cfg = preset("test-tiny")
    ckpt = write_random_checkpoint(cfg, tmp_path_factory.mktemp("formulas_ckpt"), seed=99)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        weights.update({k: v.float() for k, v in load_file(f).items()})
    model = checkpoint.load(ckpt, dtype=torch.float32)
    return cfg, model, weights


def hidden_input(seed: int, scale: float = 1.0) -> torch.Tensor:
    """A random layer input [B, T, h] (the output of an RMSNorm is O(1) per channel)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, preset("test-tiny").hidden_size, generator=g) * scale


def sharpened_mla(model, W, layer, factor=4.0):
    """A copy of layer's MLA module and of the weights with q_b, kv_a and kv_b scaled by `factor`.

    With the checkpoint's std-0.02 weights the attention scores are tiny and softmax is nearly uniform,
    so a wrong rope layout or softmax scale would move the output by only ~1e-4; scaled, by ~1e-2."""
    prefix = f"model.layers.{layer}.attention."
    mla, W = copy.deepcopy(model.model.layers[layer].attention), dict(W)
    with torch.no_grad():
        for name in ("q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight"):
            mla.get_parameter(name).mul_(factor)
            W[prefix + name] = W[prefix + name] * factor
    return mla, W


def limit_at(limits, i: int) -> float:
    """architecture.md 1.2 / 6.4: entry i of a clamp list, 0 (no clamp) past its end or when null."""
    return float(limits[i]) if limits is not None and i < len(limits) else 0.0


# ---- the formulas ---------------------------------------------------------------------------------------

def rmsnorm(x, w, eps):
    """x * rsqrt(mean(x^2) + eps) * w (section 3)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def silu(x):
    return x * torch.sigmoid(x)


def rope_interleaved(x, positions, theta):
    """Section 5.3: the pair (x_2i, x_2i+1) turns by pos * theta^(-2i/d), written in place (GPT-J layout).

    lingc (like transformers) outputs the de-interleaved layout instead; q and k get the same
    permutation, so attention scores are equal. x [..., T, d], positions [T] (broadcast over batch)."""
    d = x.shape[-1]
    inv_freq = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    ang = (positions.double()[:, None] * inv_freq).float()                         # [T, d/2]
    cos, sin = ang.cos(), ang.sin()
    xe, xo = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = xe * cos - xo * sin
    out[..., 1::2] = xo * cos + xe * sin
    return out


def mla_by_hand(cfg, W, prefix, x):
    """Gated MLA (section 5) over x [B, T, h] at positions 0..T-1; prefix e.g. 'model.layers.3.attention.'."""
    Bx, Tx, _ = x.shape
    H, nope, rope, vd, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
    eps = cfg.rms_norm_eps
    pos = torch.arange(Tx)
    # 1. query: q-LoRA (Tiny) or a single q_proj (Flash)
    if cfg.q_lora_rank is None:
        q = x @ W[prefix + "q_proj.weight"].T
    else:
        q_lat = rmsnorm(x @ W[prefix + "q_a_proj.weight"].T, W[prefix + "q_a_layernorm.weight"], eps)
        q = q_lat @ W[prefix + "q_b_proj.weight"].T
    q = q.view(Bx, Tx, H, nope + rope).transpose(1, 2)                           # [B, H, T, nope+rope]
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    # 2. key/value latent, normed, expanded per head as [k_nope | v]
    c = x @ W[prefix + "kv_a_proj_with_mqa.weight"].T
    c_kv, k_rope = c[..., :R], c[..., R:]                                        # [B, T, R], [B, T, rope]
    kv = rmsnorm(c_kv, W[prefix + "kv_a_layernorm.weight"], eps) @ W[prefix + "kv_b_proj.weight"].T
    kv = kv.view(Bx, Tx, H, nope + vd).transpose(1, 2)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    # 3. rope on q_rope and the one shared k_rope
    q_rope = rope_interleaved(q_rope, pos, cfg.rope_theta)
    k_rope = rope_interleaved(k_rope, pos, cfg.rope_theta)[:, None].expand(Bx, H, Tx, rope)
    # 4. causal softmax attention, scale 1/sqrt(nope + rope)
    Q = torch.cat([q_nope, q_rope], -1)
    K = torch.cat([k_nope, k_rope], -1)
    scores = (Q @ K.transpose(-1, -2)) / math.sqrt(nope + rope)
    scores = scores.masked_fill(torch.ones(Tx, Tx, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2)                                  # [B, T, H, v]
    # 5. head-wise sigmoid gate, 6. dense
    o = o * torch.sigmoid(x @ W[prefix + "g_proj.weight"].T)[..., None]
    return o.reshape(Bx, Tx, H * vd) @ W[prefix + "dense.weight"].T


def swiglu_by_hand(x, w_gate, w_up, w_down, limit, stats=None):
    """down(min(silu(g), L) * clamp(u, -L, L)); L = 0 means no clamp (section 6.4)."""
    gate, up = x @ w_gate.T, x @ w_up.T
    act = silu(gate)
    if limit > 0:
        if stats is not None:
            stats["act_over"] += int((act > limit).sum())
            stats["up_over"] += int((up.abs() > limit).sum())
        act, up = act.clamp(max=limit), up.clamp(-limit, limit)
    return (act * up) @ w_down.T


def route_by_hand(cfg, W, prefix, x_tok):
    """Section 6.2 for one token x_tok [h]: (expert ids [k], weights [k])."""
    E, ng = cfg.num_experts, cfg.n_group
    score = torch.sigmoid(W[prefix + "gate.weight"] @ x_tok)                      # [E], unbiased
    biased = score + W[prefix + "gate.expert_bias"]                                # selection only
    group_score = biased.view(ng, E // ng).topk(2).values.sum(-1)                 # top-2 sum per group
    keep = group_score.topk(cfg.topk_group).indices
    allowed = torch.zeros(ng, dtype=torch.bool)
    allowed[keep] = True
    biased = biased.masked_fill(~allowed.repeat_interleave(E // ng), float("-inf"))
    ids = biased.topk(cfg.num_experts_per_tok).indices
    w = score[ids]
    w = w / (w.sum() + 1e-20) * cfg.routed_scaling_factor
    return ids, w


def routing_coverage(cfg, W, layer, x):
    """How many tokens' expert sets the group limit and the selection bias change (vs plain top-k)."""
    p = f"model.layers.{layer}.mlp."
    by_group = by_bias = 0
    for xt in x.reshape(-1, x.shape[-1]):
        ids, _ = route_by_hand(cfg, W, p, xt)
        score = torch.sigmoid(W[p + "gate.weight"] @ xt)
        biased = score + W[p + "gate.expert_bias"]
        plain = set(biased.topk(cfg.num_experts_per_tok).indices.tolist())
        by_group += plain != set(ids.tolist())
        by_bias += plain != set(score.topk(cfg.num_experts_per_tok).indices.tolist())
    return by_group, by_bias


def moe_by_hand(cfg, W, layer, x, stats=None):
    """MoE layer `layer` (section 6): sum_k w_k Expert_k(x) + unscaled Shared(x), token by token."""
    p = f"model.layers.{layer}.mlp."
    L_exp = limit_at(cfg.expert_swiglu_limit_list, layer)
    L_sh = limit_at(cfg.share_expert_swiglu_limit_list, layer)
    xs = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(xs)
    for n, xt in enumerate(xs):
        ids, w = route_by_hand(cfg, W, p, xt)
        for e, we in zip(ids.tolist(), w):
            e_p = f"{p}experts.{e}."
            out[n] += we * swiglu_by_hand(xt, W[e_p + "gate_proj.weight"], W[e_p + "up_proj.weight"],
                                          W[e_p + "down_proj.weight"], L_exp, stats)
    shared = swiglu_by_hand(xs, W[p + "shared_experts.gate_proj.weight"], W[p + "shared_experts.up_proj.weight"],
                            W[p + "shared_experts.down_proj.weight"], L_sh,
                            None if stats is None else stats.setdefault("shared", {"act_over": 0, "up_over": 0}))
    return (out + shared).view_as(x)


def assert_close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"{what}: max abs error {err:.3g} > {ATOL} (|want| max {want.abs().max().item():.3g})"


# ---- (a) q-LoRA MLA -------------------------------------------------------------------------------------

@torch.no_grad()
def test_mla_qlora_layer_matches_formula(tiny):
    """(a) One gated-MLA layer with the q-LoRA query (q_b(RMSNorm(q_a(x)))): the model's MLA module on a
    fresh state vs the formula of section 5 (interleaved rope, normed c_kv, kv_b expand, causal softmax
    with scale 1/sqrt(qk_head_dim), sigmoid head gate, dense). q_b/kv_a/kv_b are scaled x4 in both so the
    attention is far from uniform."""
    cfg, model, W = tiny
    assert cfg.q_lora_rank == 48
    layer = 3
    assert isinstance(model.model.layers[layer].attention, MLA)
    mla, W = sharpened_mla(model, W, layer)
    assert hasattr(mla, "q_a_proj") and not hasattr(mla, "q_proj")
    x = hidden_input(seed=1)
    state = model.new_state(B, T)
    got = mla(x, step_meta(torch.arange(T).expand(B, T), state), state.layer(layer))
    want = mla_by_hand(cfg, W, f"model.layers.{layer}.attention.", x)
    assert_close(got, want, "MLA (q-LoRA) layer 3")


@torch.no_grad()
def test_mla_qlora_cached_continuation_matches_formula(tiny):
    """(a') The same layer called twice on one state (positions 0..4, then 5..8, reading the latent cache
    written by the first call) gives the full-sequence formula's outputs."""
    cfg, model, W = tiny
    layer, split = 3, 5
    mla, W = sharpened_mla(model, W, layer)
    x = hidden_input(seed=2)
    state = model.new_state(B, T)
    first = mla(x[:, :split], step_meta(torch.arange(split).expand(B, split), state), state.layer(layer))
    second = mla(x[:, split:], step_meta(torch.arange(split, T).expand(B, T - split), state), state.layer(layer))
    want = mla_by_hand(cfg, W, f"model.layers.{layer}.attention.", x)
    assert_close(torch.cat([first, second], dim=1), want, "MLA (q-LoRA) layer 3, cached in two calls")


# ---- (b) MoE with a binding SwiGLU clamp ----------------------------------------------------------------

@pytest.mark.parametrize("layer", [4, 5])
@torch.no_grad()
def test_moe_swiglu_clamp_matches_formula(tiny, layer):
    """(b) An MoE layer whose clamp binds (test-tiny layers 4 and 5: expert limit 0.1, shared limits
    0.15 / 0.2) vs a hand-written grouped sigmoid router (bias for selection only, top-2 group sums,
    topk_group groups, top-k, renorm + 1e-20, x routed_scaling_factor) and per-expert
    min(silu(g), L) * clamp(u, -L, L), plus the unscaled shared expert. Also checks the clamp binds."""
    cfg, model, W = tiny
    L_exp = limit_at(cfg.expert_swiglu_limit_list, layer)
    L_sh = limit_at(cfg.share_expert_swiglu_limit_list, layer)
    assert L_exp == 0.1 and L_sh == {4: 0.15, 5: 0.2}[layer]
    x = hidden_input(seed=10 + layer, scale=2.0)
    stats = {"act_over": 0, "up_over": 0}
    want = moe_by_hand(cfg, W, layer, x, stats)
    got = model.model.layers[layer].mlp(x)
    assert_close(got, want, f"MoE layer {layer} with clamp")
    # the clamp binds on both sides of both kinds of expert with these inputs ...
    assert stats["act_over"] > 0 and stats["up_over"] > 0, f"routed-expert clamp never binds: {stats}"
    assert stats["shared"]["act_over"] > 0 and stats["shared"]["up_over"] > 0, f"shared clamp never binds: {stats}"
    # ... and matters: without it the layer's output is clearly different
    unclamped = moe_by_hand(cfg.replace(expert_swiglu_limit_list=None, share_expert_swiglu_limit_list=None),
                            W, layer, x)
    assert (unclamped - want).abs().max().item() > 100 * ATOL
    # the inputs exercise the router too: group limiting and the selection bias change some expert sets
    by_group, by_bias = routing_coverage(cfg, W, layer, x)
    assert by_group > 0 and by_bias > 0, f"routing not exercised: group {by_group}, bias {by_bias} tokens"


@torch.no_grad()
def test_moe_without_clamp_matches_formula(tiny):
    """(b') An MoE layer with no clamp (test-tiny layer 1, limits 0) vs the same hand-written formula."""
    cfg, model, W = tiny
    layer = 1
    assert limit_at(cfg.expert_swiglu_limit_list, layer) == 0 and limit_at(cfg.share_expert_swiglu_limit_list, layer) == 0
    x = hidden_input(seed=21, scale=2.0)
    assert_close(model.model.layers[layer].mlp(x), moe_by_hand(cfg, W, layer, x), "MoE layer 1 (no clamp)")


# ---- (c) incomplete last group --------------------------------------------------------------------------

def test_incomplete_last_group_is_mla(tiny):
    """(c) test-tiny has 6 layers in groups of 4: layer 3 ends the only full group and layers 4, 5 form an
    incomplete group, so 3, 4, 5 are MLA and 0, 1, 2 KDA (section 2; the MTP layer 6 is MLA too).
    Checked on the module types, the checkpoint's tensors and the per-layer state (kv_pages exactly for MLA)."""
    cfg, model, W = tiny
    assert (cfg.num_hidden_layers, cfg.layer_group_size, cfg.num_nextn_predict_layers) == (6, 4, 1)
    mla_layers = {3, 4, 5, 6}
    n = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert len(model.model.layers) == n
    state = model.new_state(B, 16)
    for i in range(n):
        mixer = model.model.layers[i].attention
        names = set(state.layer(i))
        has_ckpt = lambda suffix: f"model.layers.{i}.attention.{suffix}" in W  # noqa: E731
        if i in mla_layers:
            assert isinstance(mixer, MLA), f"layer {i} should be MLA, is {type(mixer).__name__}"
            assert names == {"kv_pages"}, f"layer {i} state {sorted(names)}"
            # ModelState.new: one page of max_len rows per request, [NP = B, PS = 16, L]
            assert state.layer(i)["kv_pages"].shape == (B, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            assert has_ckpt("kv_a_proj_with_mqa.weight") and has_ckpt("dense.weight") and not has_ckpt("A_log")
        else:
            assert isinstance(mixer, KDA), f"layer {i} should be KDA, is {type(mixer).__name__}"
            assert names == {"conv_q", "conv_k", "conv_v", "recurrent"}, f"layer {i} state {sorted(names)}"
            assert state.layer(i)["recurrent"].shape == (B, cfg.num_attention_heads, cfg.head_dim, cfg.head_dim)
            assert has_ckpt("A_log") and has_ckpt("o_proj.weight") and not has_ckpt("kv_a_proj_with_mqa.weight")


# ---- (d) MTP ----------------------------------------------------------------------------------------------

@torch.no_grad()
def test_mtp_layer_matches_formula(tiny):
    """(d) model.mtp_step vs section 7 by hand: z = eh_proj([enorm(embed(next_ids)); hnorm(hidden)]),
    z += MLA(input_layernorm(z)), z += MoE(post_attention_layernorm(z)) (layer 6: expert clamp 0.1,
    no shared clamp), logits = lm_head(final_layernorm(z)); hidden is the target's normed hidden."""
    cfg, model, W = tiny
    i = cfg.num_hidden_layers                                                      # MTP layer index 6
    p, eps = f"model.layers.{i}.", cfg.rms_norm_eps
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    state = model.new_state(B, T + 1)
    _, hidden = model.step(ids, torch.arange(T + 1).expand(B, T + 1), state)      # normed, [B, T+1, h]
    hidden, next_ids = hidden[:, :T], ids[:, 1:]                                  # position t with token t+1
    got_logits, got_z = model.mtp_step(next_ids, hidden, torch.arange(T).expand(B, T), state)

    e = W["model.word_embeddings.weight"][next_ids]
    z = torch.cat([rmsnorm(e, W[p + "enorm.weight"], eps), rmsnorm(hidden, W[p + "hnorm.weight"], eps)], -1)
    z = z @ W[p + "eh_proj.weight"].T                                              # embedding first
    z = z + mla_by_hand(cfg, W, p + "attention.", rmsnorm(z, W[p + "input_layernorm.weight"], eps))
    stats = {"act_over": 0, "up_over": 0}
    z = z + moe_by_hand(cfg, W, i, rmsnorm(z, W[p + "post_attention_layernorm.weight"], eps), stats)
    z = rmsnorm(z, W[p + "final_layernorm.weight"], eps)
    logits = z @ W["lm_head.weight"].T

    assert_close(got_z, z, "MTP hidden (after final_layernorm)")
    assert_close(got_logits, logits, "MTP logits")
    assert limit_at(cfg.expert_swiglu_limit_list, i) == 0.1 and limit_at(cfg.share_expert_swiglu_limit_list, i) == 0
    assert stats["up_over"] > 0, "the MTP layer's expert clamp never binds"


def test_fixture_is_the_qlora_mtp_variant(tiny):
    """The fixture's checkpoint really has q-LoRA MLA and an MTP layer (guards the tests above against a
    preset change that would make them vacuous)."""
    cfg, _, W = tiny
    assert cfg.q_lora_rank is not None and cfg.num_nextn_predict_layers == 1
    assert "model.layers.3.attention.q_a_proj.weight" in W and "model.layers.3.attention.q_proj.weight" not in W
    assert "model.layers.6.eh_proj.weight" in W
