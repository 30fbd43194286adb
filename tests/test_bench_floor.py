"""bench/floor.py, the byte floor behind every floor_ratio the benchmark reports, counted on test-tiny.

The counts are checked against figures derived independently from the config and the program's weights:
every weight the step graph reads once, only the experts the router chose, one embedding row, the KDA state
read and written, the MLA rows up to the position.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lingc.runtime.executor import Executor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from floor import step_bytes  # noqa: E402

SEQ_LEN = 10


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _weight_bytes(program) -> dict[str, int]:
    """Weight bytes the step and the NEXTN graphs must read, counted on one run each (reference backend)."""
    exe = Executor(program, "cpu")
    exe.buffers.tensors["relay_seq_len"][0] = SEQ_LEN
    return {g: step_bytes(exe, g)["weights"] for g in ("step", "draft", "verify", "extend")}


def test_step_bytes_on_test_tiny(tiny_program_bf16) -> None:
    program, c = tiny_program_bf16, tiny_program_bf16.config
    exe = Executor(program, "cpu")
    exe.buffers.tensors["relay_seq_len"][0] = SEQ_LEN
    pt = exe.buffers.tensors["page_table"]
    pt.copy_(torch.arange(pt.numel(), dtype=pt.dtype).view(pt.shape))
    got = step_bytes(exe, "step")

    used = {n.target for n in program.graphs["step"].nodes if n.op == "get_attr"}
    stacks = {k for k in used if k.endswith(("experts.w13", "experts.w2"))}
    table = next(k for k in used if k.endswith("word_embeddings.weight"))
    dense = sum(_size(program.weights[k]) for k in used - stacks - {table})
    assert got["weights"] == dense + c.hidden_size * program.weights[table].element_size()

    moe_layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
    per_expert = sum(_size(program.weights[k][0]) for k in stacks) // len(moe_layers)
    assert got["experts"] == len(moe_layers) * c.num_experts_per_tok * per_expert   # top-k distinct, one token

    kda = [i for i in range(c.num_hidden_layers) if not c.is_mla_layer(i)]
    state = c.kda_heads * c.head_dim * c.head_dim * 4
    conv = c.kda_dim * (c.short_conv_kernel_size - 1) * 2
    assert got["kda_state"] == len(kda) * (2 * state + 3 * 2 * conv)

    mla = c.num_hidden_layers - len(kda)
    assert got["mla_cache"] == mla * (SEQ_LEN + 1) * c.mla_latent_dim * 2


def test_fused_kda_ops_count_the_same_state_bytes(tiny_program_bf16) -> None:
    """fuse_kda's kda_conv_qkv / kda_fused_decode / kda_fused_verify / kda_commit_multi move the bytes the ops they
    replace move."""
    from lingc.ops import OPS
    from lingc.passes.manager import PassManager

    def kda_bytes(program) -> dict[str, int]:
        exe = Executor(program, "cpu")
        exe.buffers.tensors["relay_seq_len"][0] = SEQ_LEN
        return {g: step_bytes(exe, g).get("kda_state", 0) for g in ("step", "draft", "verify", "extend")}

    parted = PassManager(["partition"]).run(tiny_program_bf16).program
    fused = PassManager(["partition", "fuse_kda"]).run(tiny_program_bf16).program
    targets = {n.target for g in fused.graphs.values() for n in g.nodes}
    assert {OPS.kda_conv_qkv, OPS.kda_fused_decode, OPS.kda_fused_verify, OPS.kda_commit_multi} <= targets
    want, got = kda_bytes(parted), kda_bytes(fused)
    assert want["step"] > 0 and want["verify"] > 0
    assert got == want


def test_fused_norm_linear_ops_count_the_same_weight_bytes(tiny_program_bf16) -> None:
    """fuse_norm_linear's rmsnorm_linear / add_rmsnorm_linear read the norm weight and the linear weight that the two
    ops they replace read: the same weight bytes per graph (the step and the NEXTN graphs)."""
    from lingc.ops import OPS
    from lingc.passes.fuse_norm_linear import FuseNormLinear
    from lingc.passes.manager import PassManager

    parted = PassManager(["partition", "fuse_add_norm"]).run(tiny_program_bf16).program
    fused, record = FuseNormLinear().run(parted)
    targets = {n.target for g in fused.graphs.values() for n in g.nodes}
    assert {OPS.rmsnorm_linear, OPS.add_rmsnorm_linear} <= targets and record.matches > 0
    want, got = _weight_bytes(parted), _weight_bytes(fused)
    assert want["step"] > 0 and got == want


def test_fused_embedding_norms_count_the_same_weight_bytes(tiny_program_bf16) -> None:
    """fuse_embed_norm's embedding_rmsnorm[_cat] read the rows the embedding looked up (not the table) and the norms'
    weights: the same weight bytes per graph as the embedding and the norm they replace."""
    from lingc.ops import OPS
    from lingc.passes.fuse_embed_norm import FuseEmbedNorm
    from lingc.passes.manager import PassManager

    parted = PassManager(["partition", "fuse_cat_norm"]).run(tiny_program_bf16).program
    fused, record = FuseEmbedNorm().run(parted)
    targets = {n.target for g in fused.graphs.values() for n in g.nodes}
    assert {OPS.embedding_rmsnorm, OPS.embedding_rmsnorm_cat} <= targets and record.matches > 0
    want, got = _weight_bytes(parted), _weight_bytes(fused)
    assert want["step"] > 0 and got == want


def test_pair_grid_moe_ops_count_the_same_expert_bytes(tiny_program_bf16) -> None:
    """fuse_align_into_moe's moe_up_act_pairs / moe_down_pairs read the experts the router chose, as the aligned
    GEMMs do: the same expert bytes per graph (verify and extend are paired; the step and draft are not)."""
    from lingc.ops import OPS
    from lingc.passes.fuse_align_into_moe import FuseAlignIntoMoe
    from lingc.passes.manager import PassManager

    def expert_bytes(program) -> dict[str, int]:
        exe = Executor(program, "cpu")
        exe.buffers.tensors["relay_seq_len"][0] = SEQ_LEN
        return {g: step_bytes(exe, g)["experts"] for g in ("step", "draft", "verify", "extend")}

    aligned = PassManager(["partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"]).run(
        tiny_program_bf16).program
    paired, record = FuseAlignIntoMoe().run(aligned)
    assert record.matches == 6 and OPS.moe_down_pairs in {n.target for n in paired.graphs["verify"].nodes}
    want, got = expert_bytes(aligned), expert_bytes(paired)
    assert want["verify"] > 0 and got == want
