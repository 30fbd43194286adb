"""The triton backend end to end in the interpreter: the lowering table, and test-tiny run through the kernels.

Every op on the decode byte path must lower to a Triton launcher, and a whole test-tiny program lowered to the
kernels must give the reference's logits (within bf16 tolerance) and tokens. Greedy NEXTN == plain decode on the
kernels (row invariance) is test_lowering_nextn.py, a file of its own so that the suite's workers run it beside
these tests.
"""

from __future__ import annotations

import pytest
import torch

from lingc.kernels.lowering import kernel_table
from lingc.ops import OPS
from lingc.runtime.executor import Executor

pytestmark = pytest.mark.usefixtures("few_linear_programs")


HOT_OPS = {"rmsnorm", "add_rmsnorm", "linear", "router_topk", "router_align", "moe_align", "moe_up", "moe_up_act",
           "silu_and_mul", "moe_down", "moe_combine", "kda_conv", "kda_conv_staged", "kda_recurrent",
           "kda_recurrent_staged", "kda_commit", "gated_rmsnorm", "mla_attention", "mla_cache_write", "rope",
           "sigmoid_gate", "greedy_sample", "chain_accept", "filtered_probs", "kda_conv_qkv", "kda_fused_verify",
           "kda_fused_decode", "kda_commit_multi", "rmsnorm_linear", "add_rmsnorm_linear", "ep_align", "ep_combine",
           "all_reduce", "mla_prep", "rmsnorm_cat", "embedding", "emit_tokens", "simulate_accept"}


def test_every_hot_op_has_a_kernel() -> None:
    table = kernel_table()
    assert HOT_OPS <= table.keys(), f"no Triton kernel for {sorted(HOT_OPS - table.keys())}"
    assert table.keys() <= OPS.keys(), f"launchers for unknown ops {sorted(table.keys() - OPS.keys())}"


def test_unknown_backend_is_refused(tiny_program_bf16) -> None:
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        Executor(tiny_program_bf16, "cpu", backend="cuda")


def _decode(exe: Executor, ids: list[int]) -> torch.Tensor:
    """Feed ids one by one through the `decode` graph (slot 0); logits of every step, fp32 [len, V]."""
    exe.buffers.tensors["slots"].zero_()
    pt = exe.buffers.tensors["page_table"]
    pt.copy_(torch.arange(pt.numel(), dtype=pt.dtype).view(pt.shape))
    out = []
    for pos, t in enumerate(ids):
        exe.input("decode", "input_ids").fill_(t)
        exe.input("decode", "positions").fill_(pos)
        logits, _ = exe.run("decode")
        out.append(logits.float().reshape(-1).clone())
    return torch.stack(out)


def test_decode_on_kernels_matches_reference(tiny_program_bf16) -> None:
    ref, tri = Executor(tiny_program_bf16, "cpu"), Executor(tiny_program_bf16, "cpu", backend="triton")
    counts = tri.kernel_counts("decode")
    assert sum(n for k, n in counts.items() if k.startswith("triton:")) > 0
    assert not {k[len("lingc."):] for k in counts if k.startswith("lingc.")} & kernel_table().keys(), counts
    ids = [5, 17, 300, 42, 7]
    want, got = _decode(ref, ids), _decode(tri, ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _mtp_decode(exe: Executor, steps: int = 2) -> list[torch.Tensor]:
    """mtp_decode (one MTP layer, all four fuse_norm_linear forms) on seeded inputs: [logits, hidden] per step."""
    exe.buffers.tensors["slots"].zero_()
    pt = exe.buffers.tensors["page_table"]
    pt.copy_(torch.arange(pt.numel(), dtype=pt.dtype).view(pt.shape))
    g = torch.Generator().manual_seed(5)
    out = []
    for pos in range(steps):
        exe.input("mtp_decode", "next_ids").fill_(17 + pos)
        exe.input("mtp_decode", "positions").fill_(pos)
        hidden = exe.input("mtp_decode", "hidden")
        hidden.copy_(torch.randn(hidden.shape, generator=g).to(hidden.dtype))
        out += [t.float().clone() for t in exe.run("mtp_decode")]
    return out


def test_fuse_norm_linear_kernels_match_the_unfused_kernels(tiny_program_bf16) -> None:
    """rmsnorm_linear / add_rmsnorm_linear (want_normed on and off) in the interpreter vs the rmsnorm + linear kernels
    they replace: logits and the returned normed hidden state within fuse_norm_linear's tolerance (test-tiny
    measures 0: bit-exact), the same argmax."""
    from lingc.passes.fuse_norm_linear import FuseNormLinear
    from lingc.passes.manager import PassManager
    before = PassManager(["partition", "fuse_projections", "fuse_add_norm"]).run(tiny_program_bf16).program
    after, record = FuseNormLinear().run(before)
    assert record.details["norms_fused"]["want_normed"] > 0
    fused = Executor(after, "cpu", backend="triton")
    assert {"triton:rmsnorm_linear", "triton:add_rmsnorm_linear"} <= fused.kernel_counts("mtp_decode").keys()
    got, want = _mtp_decode(fused), _mtp_decode(Executor(before, "cpu", backend="triton"))
    for g, w in zip(got, want):
        assert ((g - w).abs() <= FuseNormLinear.tolerance * (1 + w.abs())).all()
    assert all(torch.equal(g.argmax(-1), w.argmax(-1)) for g, w in zip(got[::2], want[::2]))


def test_fuse_relay_kernels_in_the_nextn_and_decode_steps(tiny_partitioned_bf16, monkeypatch) -> None:
    """gather_rows_multi / scatter_rows_multi as the executor runs them in step, draft, verify and extend (their real
    tables, views, column slices, dtypes and folded adds, seeded greedy and sampled requests): every call launches the
    kernel (no fallback) and matches the op's reference bit for bit (the reference is the composition; that the fused
    graphs equal the unfused ones is tests/passes/test_fuse_relay.py). Running the unfused program on the kernels as
    well would double this test's ~17 s."""
    import lingc.kernels.meta as meta
    from lingc.passes.fuse_relay import FuseRelay
    from lingc.passes.verify import random_inputs
    graphs = ("step", "draft", "verify", "extend")
    fused, record = FuseRelay().run(tiny_partitioned_bf16)          # after pdl here: only scheduling differs
    calls = {"gather": 0, "scatter": 0, "kernels": 0}
    for name in ("_gather_rows_multi_kernel", "_scatter_rows_multi_kernel"):
        kernel = getattr(meta, name)

        class Counted:
            def __getitem__(self, grid, kernel=kernel):
                calls["kernels"] += 1
                return kernel[grid]
        monkeypatch.setattr(meta, name, Counted())

    def gather(tables, slots, *, pdl=False):
        got = meta.gather_rows_multi(tables, slots, pdl=pdl)
        want = OPS.gather_rows_multi(tables, slots)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        calls["gather"] += 1
        return got

    def scatter(tables, slots, values, adds, *, pdl=False):
        want = [t.clone() for t in tables]
        OPS.scatter_rows_multi(want, slots, values, adds)
        meta.scatter_rows_multi(tables, slots, values, adds, pdl=pdl)
        assert all(torch.equal(a, b) for a, b in zip(tables, want))
        calls["scatter"] += 1

    monkeypatch.setitem(kernel_table(), "gather_rows_multi", gather)
    monkeypatch.setitem(kernel_table(), "scatter_rows_multi", scatter)
    keep = fused.copy()
    keep.graphs = {g: keep.graphs[g] for g in graphs}
    exe = Executor(keep, "cpu", backend="triton")
    inputs = random_inputs(fused, list(graphs))
    for key, t in exe.buffers.tensors.items():
        t.copy_(inputs[key.split(":")[-1]])
    for g in graphs:
        exe.run(g)
    # the general draft's scatter writes 12 tables (fuse_relay_cat's column slices of the chain and the
    # distributions): two kernels of at most RELAY_MULTI_MAX
    assert calls == {"gather": 5, "scatter": 4, "kernels": 10}, record.details


def test_reference_ops_keep_their_torch_reference(monkeypatch) -> None:
    """LINGC_REFERENCE_OPS (lowering.REFERENCE_OPS, read at lowering time) sends the named ops to their reference."""
    import lingc.kernels.lowering as lowering
    from lingc.runtime.executor import kernel_for
    assert kernel_for(OPS.embedding, "triton")[1] == "triton:embedding"
    monkeypatch.setattr(lowering, "REFERENCE_OPS", ("embedding",))
    assert kernel_for(OPS.embedding, "triton") == (OPS.embedding, "lingc.embedding")
    assert kernel_for(OPS.emit_tokens, "triton")[1] == "triton:emit_tokens"


def test_reference_ops_with_an_unknown_name_is_an_error(monkeypatch) -> None:
    """A name in LINGC_REFERENCE_OPS that no kernel lowers (a typo, or the "lingc." prefix) would leave every kernel
    on and bisect nothing: lowering refuses it, naming it."""
    import lingc.kernels.lowering as lowering
    from lingc.runtime.executor import kernel_for
    monkeypatch.setattr(lowering, "REFERENCE_OPS", ("embedding", "lingc.emit_tokens"))
    with pytest.raises(ValueError, match=r"LINGC_REFERENCE_OPS names lingc.emit_tokens: no lingc kernel lowers"):
        kernel_for(OPS.embedding, "triton")


def test_launch_hints_reach_the_triton_launcher_and_bad_ones_are_refused(tiny_partitioned_bf16) -> None:
    """node.meta["lingc.launch"] (docs/ir.md): fuse_shared_expert's shared_last reaches moe_up_act's Triton launch as
    a keyword (never the reference op's), and a hint lingc does not know, from a hand-edited artifact say, is an
    error naming the node, the key and what is known."""
    from lingc.passes.manager import PassManager
    from lingc.runtime.executor import launch_hints, lower
    program = PassManager(["fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"]).run(tiny_partitioned_bf16).program
    lowered = lower(program, "decode", backend="triton")
    ups = [l for l in lowered.launches if l.label.endswith("moe_up_act")]
    assert ups and any(l.kwargs.get("shared_last") is True for l in ups), [l.kwargs for l in ups]
    assert not [l for l in lower(program, "decode").launches if "shared_last" in l.kwargs]
    node = next(n for n in program.graphs["decode"].nodes
                if n.meta.get("lingc.launch", {}).get("shared_last"))
    node.meta["lingc.launch"] = {"shared_last": True, "out": 3}
    with pytest.raises(ValueError, match=r"launch hint out=3 is not one lingc knows \(known for moe_up_act: shared_last \(bool\)\)"):
        launch_hints(node)
    node.meta["lingc.launch"] = {"shared_last": "yes"}
    with pytest.raises(ValueError, match=f"node '{node.name}'"):
        lower(program, "decode", backend="triton")
