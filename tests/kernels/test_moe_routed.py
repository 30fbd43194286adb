"""kernels/moe_routed.py in the Triton interpreter: the one-token up/down GEMMs that route for themselves against
router_align + moe_up_act / moe_down's kernels, bit for bit (fp32 and bf16, with and without the fused shared
expert, a clamp that binds, the down-GEMM's register preload on and off), against the ops' references, errors on
bad input, and fuse_router_moe's mtp_decode graph on the kernels against the unfused one."""

from __future__ import annotations

import pytest
import torch

from lingc.kernels.moe import interleave_w13, moe_down, moe_up_act
from lingc.kernels.moe_routed import moe_down_routed, moe_up_act_routed
from lingc.kernels.router import router_align
from kernel_support import poisoned_empty  # noqa: E402  (tests/kernels is on sys.path)

E, H, I, K, GROUPS, TOPK_GROUP = 16, 128, 64, 4, 4, 2


def _case(shared: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, generator=g).to(dtype)
    w13 = (torch.randn(E + shared, 2 * I, H, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E + shared, H, I, generator=g) * I ** -0.5).to(dtype)
    logits = torch.randn(1, E, generator=g)
    bias = 0.1 * torch.randn(E, generator=g)
    return x, interleave_w13(w13), w2, logits, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [0, 1])
def test_matches_router_align_and_the_grouped_gemms(shared: int, dtype: torch.dtype) -> None:
    x, w13i, w2, logits, bias = _case(shared, dtype, seed=3 + shared)
    route = (logits, bias, GROUPS, TOPK_GROUP, K, 2.5, E + shared, 16, shared)
    w, ids, sp, be, tot = router_align(*route)
    act_want = moe_up_act(x, w13i, sp, be, tot, K + shared, 16, 0.05)      # a clamp that binds on these scales
    down_want = moe_down(act_want, w2, sp, be, tot, 16)
    with poisoned_empty():
        act, w_got, ids_got = moe_up_act_routed(x, w13i, *route, 0.05)
    assert torch.equal(w_got, w) and torch.equal(ids_got, ids)
    assert torch.equal(act, act_want)
    for preload in (False, True):
        with poisoned_empty():
            down = moe_down_routed(act, w2, *route, preload=preload)
        assert torch.equal(down, down_want)
    # the references (lingc/ops/moe.py) route in an unspecified order: compare pair rows matched by expert id
    ref_act, ref_w, ref_ids = torch.ops.lingc.moe_up_act_routed(x, w13i, *route, 0.05)
    ref_down = torch.ops.lingc.moe_down_routed(ref_act, w2, *route)
    mine, theirs = ids[0].argsort(), ref_ids[0].argsort()
    assert torch.equal(ids[0][mine], ref_ids[0][theirs]) and torch.allclose(w[0][mine], ref_w[0][theirs])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, ref in ((act, ref_act), (down, ref_down)):
        got, ref = got[mine].float(), ref[theirs].float()
        assert (got - ref).abs().max() <= tol * (1 + ref.abs().max())

def test_bad_inputs_name_the_problem() -> None:
    x, w13i, w2, logits, bias = _case(1, torch.float32, seed=1)
    route = (logits, bias, GROUPS, TOPK_GROUP, K, 2.5, E + 1, 16, 1)
    with pytest.raises(ValueError, match="one token"):
        moe_up_act_routed(x, w13i, logits.expand(2, E), *route[1:], 0.0)
    with pytest.raises(ValueError, match="num_experts"):
        moe_up_act_routed(x, w13i, logits, bias, GROUPS, TOPK_GROUP, K, 2.5, E, 16, 1, 0.0)
    with pytest.raises(ValueError, match="expert weights"):
        moe_up_act_routed(x, w13i[:-1], *route, 0.0)
    with pytest.raises(ValueError, match="act is"):
        moe_down_routed(torch.zeros(3, I), w2, *route)


def test_fuse_router_moe_program_on_the_kernels(tiny_program_bf16) -> None:
    """The bf16 mtp_decode graph after fuse_router_moe on the Triton backend vs before (router_align + moe_up_act +
    moe_down's kernels): every output bit for bit over a few steps."""
    from lingc.passes.fuse_router_moe import FuseRouterMoe
    from lingc.passes.manager import PassManager
    from lingc.runtime.executor import Executor
    from test_lowering import _mtp_decode  # noqa: E402
    program = tiny_program_bf16.copy()
    program.graphs = {"mtp_decode": program.graphs["mtp_decode"]}
    before = PassManager(["partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"]).run(program).program
    after, record = FuseRouterMoe().run(before)
    assert record.matches == 1
    fused = Executor(after, "cpu", backend="triton")
    counts = fused.kernel_counts("mtp_decode")
    assert "triton:moe_up_act_routed" in counts and "triton:router_align" not in counts
    got, want = _mtp_decode(fused), _mtp_decode(Executor(before, "cpu", backend="triton"))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
