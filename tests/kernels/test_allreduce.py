"""lingc.kernels.allreduce's one-shot kernel in the Triton interpreter, its W ranks' workspaces simulated in one
process: every "peer" buffer and flag vector is a local tensor whose address stands in for the peer mapping, the
peers' partials and signals are written beforehand, and rank `me`'s kernel then runs for real (copy, signal, wait,
sum; its partial pushed into every rank's slot as (call number, data) words). Outputs are poisoned (NaN) first and compared bit for bit with the reference sum (lingc.ops.dist.fold_sum:
fp32 in rank order, one rounding). The protocol's own state is checked too: the words it left in every rank's slot,
the call counter, and that a missing peer makes the kernel give up (counted), never hang. Cross-process peer
memory itself is checked on the two H200s (bench/device_tp.py's one_shot_checks, bit for bit, eagerly)."""

from __future__ import annotations

import pytest
import torch

from lingc.kernels import allreduce as ar
from lingc.ops.dist import fold_sum

REGION = 4 * 2 * 32 * 1024   # bytes per region: 4 slots of 8-byte words, each room for 3 x 2100 fp32 below


class FakePeers:
    """W ranks' workspaces in this process; `ws(me)` is rank me's view (the addresses the kernel dereferences)."""

    def __init__(self, world: int):
        self.world = world
        self.data = [torch.zeros(2 * REGION, dtype=torch.uint8) for _ in range(world)]
        self.calls = torch.zeros(1, dtype=torch.int64)
        self.timeouts = torch.zeros(1, dtype=torch.int32)
        self.done = torch.zeros(1, dtype=torch.int32)

    def ws(self, me: int) -> ar.Workspace:
        return ar.Workspace(me, self.world, torch.device("cpu"),
                            torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64),
                            self.calls, self.timeouts, self.done, REGION)

    def words(self, owner: int, source: int, call: int, n: int) -> torch.Tensor:
        """The n int64 words of slot `source` in `owner`'s region for call `call`."""
        slot = REGION // 8 // self.world // 2 * 2
        start = (call % 2) * (REGION // 8) + source * slot
        return self.data[owner].view(torch.int64)[start:start + n]

    def post(self, rank: int, me: int, call: int, partial: torch.Tensor) -> None:
        """Peer `rank` has done its part of call `call`: its partial pushed into me's region as (call, data) words."""
        data = partial.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        self.words(me, rank, call, data.numel()).copy_((call << 32) | data)

    def pushed(self, owner: int, source: int, call: int, partial: torch.Tensor) -> bool:
        data = partial.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return torch.equal(self.words(owner, source, call, data.numel()), (call << 32) | data)


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ar, "_new", lambda x: torch.full_like(x, float("nan")))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("world,me,shape", [(2, 0, (1, 1536)), (2, 1, (6, 40)), (4, 2, (3, 2100))])
def test_one_shot_sum_matches_reference_bits(dtype: torch.dtype, world: int, me: int, shape: tuple) -> None:
    g = torch.Generator().manual_seed(world * 10 + me)
    peers = FakePeers(world)
    ws = peers.ws(me)
    for call in (1, 2, 3):                               # both regions, and the counter carried between calls
        parts = [(torch.randn(shape, generator=g) * 3).to(dtype) for _ in range(world)]
        parts[0][0, :3] = torch.tensor([-0.0, 0.0, -0.0]).to(dtype)          # signed zeros keep their sign
        if world > 1:
            parts[1][0, :3] = torch.tensor([-0.0, -0.0, 0.0]).to(dtype)
        for r in range(world):
            if r != me:
                peers.post(r, me, call, parts[r])
        out = ar.launch(parts[me], ws, max_spins=10)
        want = fold_sum(parts, dtype)
        assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        assert int(peers.calls) == call
        assert all(peers.pushed(r, me, call, parts[me]) for r in range(world))   # my words in every rank's slot
        assert int(peers.timeouts) == 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("world,me,rows,n", [(2, 0, 1, 1536), (2, 1, 6, 96), (4, 3, 3, 200)])
def test_fused_add_rmsnorm_matches_the_kernel_pair_bits(dtype: torch.dtype, world: int, me: int, rows: int,
                                                        n: int) -> None:
    """all_reduce_add_rmsnorm's one launch == the one-shot sum (fold_sum, shown above) then kernels/rmsnorm.py's
    add_rmsnorm kernel, bit for bit (the same row code), over several calls; and the reference op within
    conftest's tolerance."""
    from lingc.kernels.rmsnorm import add_rmsnorm as add_rmsnorm_kernel
    from lingc.ops import OPS
    g = torch.Generator().manual_seed(rows * 100 + n)
    peers = FakePeers(world)
    ws = peers.ws(me)
    weight = (torch.rand(n, generator=g) + 0.5).to(dtype)
    for call in (1, 2, 3):
        parts = [(torch.randn(rows, n, generator=g) * 2).to(dtype) for _ in range(world)]
        residual = (torch.randn(rows, n, generator=g) * 4).to(dtype)
        for r in range(world):
            if r != me:
                peers.post(r, me, call, parts[r])
        normed, new_res = ar.launch_add_rmsnorm(residual, parts[me], weight, 1e-6, ws, max_spins=10)
        want_normed, want_res = add_rmsnorm_kernel(residual, fold_sum(parts, dtype), weight, 1e-6)
        assert torch.equal(_bits(new_res), _bits(want_res)) and torch.equal(_bits(normed), _bits(want_normed))
        ref_normed, ref_res = OPS.add_rmsnorm(residual, fold_sum(parts, dtype), weight, 1e-6)
        assert torch.equal(new_res, ref_res)
        torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=1e-2, atol=1e-2)
        assert int(peers.calls) == call and int(peers.timeouts) == 0 and int(peers.done) == 0
        assert all(peers.pushed(r, me, call, parts[me]) for r in range(world))


def test_fused_launcher_falls_back_to_all_reduce_then_the_norm_kernel() -> None:
    """Without a workspace: the reference all_reduce (world 1: identity), then the add_rmsnorm kernel."""
    from lingc.ops import OPS
    ar.disable()
    g = torch.Generator().manual_seed(5)
    res, x, w = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g), torch.rand(64, generator=g)
    got = ar.all_reduce_add_rmsnorm(res, x, w, 1e-6, 1)
    want = OPS.add_rmsnorm(res, x, w, 1e-6)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])


def test_missing_peer_times_out_instead_of_hanging() -> None:
    peers = FakePeers(2)
    x = torch.ones(1, 64)
    out = ar.launch(x, peers.ws(0), max_spins=5)         # rank 1 never signals
    assert int(peers.timeouts) == 1
    assert out.shape == x.shape                          # the kernel finished (values are not meaningful)


def test_launcher_falls_back_to_the_reference_op_without_a_workspace() -> None:
    ar.disable()
    x = torch.randn(2, 8)
    assert torch.equal(ar.all_reduce(x, 1), x)                                # world 1: identity
    with pytest.raises(RuntimeError, match="no torch.distributed process group"):
        ar.all_reduce(x, 2)                                                   # the reference op's error


def test_oversized_operand_is_refused_by_launch_and_routed_away_by_the_lowering() -> None:
    peers = FakePeers(2)
    big = torch.zeros(REGION // 8 // 2 + 1)                   # one word more than a slot of 2 ranks holds
    with pytest.raises(ValueError, match="do not fit"):
        ar.launch(big, peers.ws(0))
    with pytest.raises(ValueError, match="whole 4-byte words"):
        ar.launch(torch.zeros(3, dtype=torch.bfloat16), peers.ws(0))


_COMPILE_PROBE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.allreduce as A
d = [["tt.divisibility", 16]]
for bf16 in (True, False):
    sig = {"xw_ptr": "*i32", "outw_ptr": "*i32", "bufs_ptr": "*i64", "calls_ptr": "*i64", "timeouts_ptr": "*i32",
           "words": "i32", "region_words": "i32", "slot_words": "i32", "rank": "i32", "max_spins": "i32",
           "WORLD": "constexpr", "BLOCK": "constexpr", "BF16": "constexpr", "PDL": "constexpr"}
    src = ASTSource(fn=A._one_shot_kernel, signature=sig, attrs={(0,): d, (1,): d, (5,): d, (6,): d, (7,): d},
                    constexprs={"WORLD": 2, "BLOCK": A.BLOCK, "BF16": bf16, "PDL": True})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": A.NUM_WARPS}).asm["ptx"]
    print(bf16, ptx.count("ld.volatile.global"), ptx.count("st.global.v2.b64"), ptx.count("griddepcontrol.wait"))
    t = "bf16" if bf16 else "fp32"
    sig = {"xw_ptr": "*i32", "res_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "outw_ptr": "*i32",
           "res_out_ptr": f"*{t}", "bufs_ptr": "*i64", "calls_ptr": "*i64", "done_ptr": "*i32", "timeouts_ptr": "*i32", "rows": "i32",
           "N": "i32", "eps": "fp32", "region_words": "i32", "slot_words": "i32", "rank": "i32", "max_spins": "i32",
           "WORLD": "constexpr", "BLOCK": "constexpr", "BLOCK_N": "constexpr", "BF16": "constexpr", "PDL": "constexpr"}
    src = ASTSource(fn=A._one_shot_add_rmsnorm_kernel, signature=sig, attrs={(i,): d for i in (0, 1, 2, 3, 4, 5, 11)},
                    constexprs={"WORLD": 2, "BLOCK": A.BLOCK, "BLOCK_N": 2048, "BF16": bf16, "PDL": True})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    print(bf16, ptx.count("ld.volatile.global"), ptx.count("st.global.v2.b64"), ptx.count("griddepcontrol.wait"))
"""


def test_kernels_compile_for_sm90_with_volatile_polls_and_8_byte_word_stores() -> None:
    """The interpreter accepts things the compiler refuses (it let a non-constexpr global through once): compile
    for sm_90 without a GPU (a fresh process without TRITON_INTERPRET, a few seconds) and check the protocol's
    instructions: polls are volatile loads, words go out as whole 8-byte stores, PDL waits first."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], capture_output=True, text=True, timeout=300,
                          env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for line in proc.stdout.splitlines():
        _, volatile, stores, waits = line.split()
        assert int(volatile) > 0 and int(stores) > 0 and int(waits) == 1, line


def test_enable_keeps_the_reference_op_off_nccl_and_when_told() -> None:
    """enable() maps a workspace only on NCCL (CUDA); under gloo, or with LINGC_ALL_REDUCE=nccl, it returns None and
    the lowered all_reduce stays the reference op."""
    import torch.distributed as dist
    ar.disable()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert ar.enable() is None and ar.active() is None
    finally:
        dist.destroy_process_group()
    import os
    os.environ[ar.ENV] = "nccl"
    try:
        assert ar.enable() is None
    finally:
        del os.environ[ar.ENV]
