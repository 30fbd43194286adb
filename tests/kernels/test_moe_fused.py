"""kernels/moe_fused.py in the Triton interpreter: the one-launch MoE against moe_up_act + moe_down + moe_combine's
kernels, bit for bit (fp32 and bf16; 1, 6 and 16 tokens; with and without the fused shared expert and shared_out;
a clamp that binds), poisoned workspaces, the counters left zero for the next launch, bad input errors, and the
fuse_moe program on the Triton backend against the unfused one (mtp_decode graph)."""

from __future__ import annotations

import pytest
import torch

from lingc.kernels.moe import interleave_w13, moe_combine, moe_down, moe_up_act
from lingc.kernels.moe_fused import device_counters, moe_fused, moe_fused_ref
from lingc.kernels.router import router_align
from kernel_support import poisoned_empty  # noqa: E402  (tests/kernels is on sys.path)

E, H, I, K = 16, 128, 64, 4
CASES = [(1, 1, False), (6, 1, False), (16, 1, False), (3, 0, True), (6, 0, False)]   # (tokens, fused shared, shared_out)


def _case(n: int, shared: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).to(dtype)
    w13 = (torch.randn(E + shared, 2 * I, H, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E + shared, H, I, generator=g) * I ** -0.5).to(dtype)
    align = router_align(torch.randn(n, E, generator=g), torch.zeros(E), 4, 2, K, 2.5, E + shared, 16, shared)
    return x, interleave_w13(w13), w2, align


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"N{n}-S{s}-out{o}" for n, s, o in CASES])
def test_matches_the_three_kernels(case: tuple, dtype: torch.dtype) -> None:
    n, shared, with_out = case
    x, w13i, w2, (w, ids, sp, be, tot) = _case(n, shared, dtype, seed=n * 7 + shared)
    shared_out = torch.randn(n, H).to(dtype) if with_out else None
    k = K + shared
    act = moe_up_act(x, w13i, sp, be, tot, k, 16, 0.05)                 # a clamp that binds on these scales
    want = moe_combine(moe_down(act, w2, sp, be, tot, 16), w, shared_out)
    for preload in (True, False):      # the down tiles' weight preload (DOWN_PRELOAD) and the loop: same bits
        with poisoned_empty():                                         # act / down workspaces start as garbage
            got = moe_fused(x, w13i, w2, w, sp, be, tot, k, 16, 0.05, shared_out, preload=preload)
        assert torch.equal(got, want)
    assert not device_counters("cpu").any(), "the last program leaves every counter zero"
    ref = moe_fused_ref(x, w13i, w2, w, sp, be, tot, k, 16, 0.05, shared_out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref.float()).abs().max() <= tol * (1 + ref.float().abs().max())


def test_bad_inputs_name_the_argument() -> None:
    x, w13i, w2, (w, ids, sp, be, tot) = _case(2, 1, torch.float32, seed=1)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_fused(x, w13i, w2, w[:, :2], sp, be, tot, K + 1, 16, 0.0)
    with pytest.raises(ValueError, match="w2"):
        moe_fused(x, w13i, w2[:, :, :8], w, sp, be, tot, K + 1, 16, 0.0)
    with pytest.raises(ValueError, match="shared_out"):
        moe_fused(x, w13i, w2, w, sp, be, tot, K + 1, 16, 0.0, torch.zeros(3, H))
    with pytest.raises(ValueError, match="block_expert"):
        moe_fused(x, w13i, w2, w, sp, be[:-1], tot, K + 1, 16, 0.0)


def test_fuse_moe_program_on_the_kernels(tiny_program_bf16) -> None:
    """The bf16 mtp_decode graph after fuse_moe on the Triton backend (moe_fused's kernel) vs before (the three
    kernels): every output bit for bit over a few steps."""
    from lingc.passes.fuse_moe import FuseMoe
    from lingc.passes.manager import PassManager
    from lingc.runtime.executor import Executor
    from test_lowering import _mtp_decode  # noqa: E402
    program = tiny_program_bf16.copy()
    program.graphs = {"mtp_decode": program.graphs["mtp_decode"]}
    before = PassManager(["partition", "fuse_swiglu", "fuse_moe_align", "fuse_shared_expert"]).run(program).program
    after, record = FuseMoe().run(before)
    assert record.matches == 1
    fused = Executor(after, "cpu", backend="triton")
    assert "triton:moe_fused" in fused.kernel_counts("mtp_decode")
    got, want = _mtp_decode(fused), _mtp_decode(Executor(before, "cpu", backend="triton"))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
