"""lingc.kernels.allreduce's one-shot kernel in the Triton interpreter, its W ranks' workspaces simulated in one
process: every "peer" buffer and flag vector is a local tensor whose address stands in for the peer mapping, the
peers' partials and signals are written beforehand, and rank `me`'s kernel then runs for real (copy, signal, wait,
sum; its partial pushed into every rank's slot). Outputs are poisoned (NaN) first and compared bit for bit with the reference sum (lingc.ops.dist.fold_sum:
fp32 in rank order, one rounding). The protocol's own state is checked too: the region the call used, the signal
it left in every peer's flags, the call counter, and that a missing peer makes the kernel give up (counted),
never hang. Cross-process peer memory itself is checked on the two H200s (bench/kernel_allreduce.py)."""

from __future__ import annotations

import pytest
import torch

from lingc.kernels import allreduce as ar
from lingc.ops.dist import fold_sum

REGION = 4 * 32 * 1024   # bytes per region: 4 slots, each room for the largest case below (3 x 2100 fp32)


class FakePeers:
    """W ranks' workspaces in this process; `ws(me)` is rank me's view (the addresses the kernel dereferences)."""

    def __init__(self, world: int):
        self.world = world
        self.data = [torch.zeros(2 * REGION, dtype=torch.uint8) for _ in range(world)]
        self.flags = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
        self.calls = torch.zeros(1, dtype=torch.int64)
        self.timeouts = torch.zeros(1, dtype=torch.int32)

    def ws(self, me: int) -> ar.Workspace:
        return ar.Workspace(me, self.world, torch.device("cpu"),
                            torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64),
                            torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64),
                            self.calls, self.timeouts, REGION)

    def slot(self, owner: int, source: int, call: int, like: torch.Tensor) -> torch.Tensor:
        """Slot `source` of `owner`'s region for call `call`, viewed like `like`."""
        start = (call % 2) * REGION + source * (REGION // self.world // 16 * 16)
        return self.data[owner][start:start + like.nbytes].view(like.dtype).view(like.shape)

    def post(self, rank: int, me: int, call: int, partial: torch.Tensor) -> None:
        """Peer `rank` has done its part of call `call`: its partial pushed into me's region, its signal set."""
        self.slot(me, rank, call, partial).copy_(partial)
        self.flags[me][rank] = call


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ar.torch, "empty_like", lambda x: torch.full_like(x, float("nan")))


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
        assert all(torch.equal(peers.slot(r, me, call, parts[me]), parts[me]) for r in range(world))   # pushed
        assert all(int(peers.flags[r][me]) == call for r in range(world))         # signalled every rank
        assert int(peers.timeouts) == 0


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
    big = torch.zeros(REGION // 2 // 4 + 1)                  # one float more than a slot of 2 ranks
    with pytest.raises(ValueError, match="do not fit"):
        ar.launch(big, peers.ws(0))
