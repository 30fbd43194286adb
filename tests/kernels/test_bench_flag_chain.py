"""bench/kernel_flag_chain.py's flag handoff, in the interpreter: every link sees its producer's values, the chain's
output is its length, no poll gives up, and every link counter is back at 0 after a chain (so a graph replay starts
clean), run after run. The GPU timing of the same kernel is the benchmark's job."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernel_flag_chain as K  # noqa: E402


def test_flag_chain_passes_values_and_resets_its_counters():
    calls, out, timeouts, flags = K.chain("flag", links=5, grid=3, weight_kb=1, max_spins=8,
                                          dev=torch.device("cpu"), pdl=False)
    for _ in range(2):                       # twice: the second chain runs on the counters the first left
        out.fill_(-1.0)
        for call in calls:
            call()
        assert (out == 5.0).all()
        assert int(timeouts.item()) == 0
        assert (flags == 0).all()


def test_a_poll_without_its_producer_counts_a_timeout():
    calls, out, timeouts, flags = K.chain("flag", links=3, grid=2, weight_kb=0, max_spins=4,
                                          dev=torch.device("cpu"), pdl=False)
    calls[1]()                               # link 1 before link 0: nothing ever signals its counter
    assert int(timeouts.item()) == 2         # each of its 2 programs gave up once
