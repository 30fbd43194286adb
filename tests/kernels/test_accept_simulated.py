"""greedy_accept_simulated / chain_accept_simulated (kernels/sample.py, fuse_simulate_accept) in the Triton interpreter:
the same integers as the three kernels they replace (uniform, greedy_accept / chain_accept, simulate_accept) and as
the reference ops, with the knob off (mean 0), whole and fractional means, and seeds over the int64 range."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import lingc.kernels.sample as sample
from kernel_support import poisoned_empty  # noqa: E402  (tests/kernels is on sys.path)
from test_sample import _chain_inputs  # noqa: E402

MEANS = [0.0, 3.2, 1.5, 6.0, 2.999]


def test_greedy_accept_simulated_is_the_three_kernels() -> None:
    K = 5
    draft_ids, _, _, logits, _, _ = _chain_inputs(5, K, [0.0] * 5, [0, 2, K, 1, 3], seed=3)
    mean = torch.tensor(MEANS)
    g = torch.Generator().manual_seed(1)
    seed = torch.randint(-2**63, 2**63 - 1, (5,), generator=g, dtype=torch.int64)
    counter = torch.tensor([0, 7, 2**40, 123, 9], dtype=torch.int64)
    offset = 2 * K + 2
    with poisoned_empty():
        got = sample.greedy_accept_simulated(draft_ids, logits, mean, seed, counter, offset, K + 1)
        accept_len, tokens = sample.greedy_accept(draft_ids, logits)
        u = sample.uniform(seed, counter, K + 3, K)[:, offset - K]
        want_len = sample.simulate_accept(accept_len, mean, u, K + 1)
    assert got[0].dtype == torch.int32 and torch.equal(got[0], want_len) and torch.equal(got[1], tokens)
    ref = torch.ops.lingc.greedy_accept_simulated(draft_ids, logits, mean, seed, counter, offset, K + 1)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[0][0] == accept_len[0] and not torch.equal(got[0], accept_len)     # off on row 0, on elsewhere


def test_chain_accept_simulated_is_the_two_kernels() -> None:
    K = 3
    inputs = _chain_inputs(5, K, [0.0, 0.8, 0.0, 1.0, 0.6], [0, 1, K, 2, K], seed=4)
    mean = torch.tensor(MEANS)
    u_wide = torch.rand(5, 8, generator=torch.Generator().manual_seed(2))
    u_sim = u_wide[:, 7]                                                           # a strided column, as verify's
    with poisoned_empty():
        got = sample.chain_accept_simulated(*inputs, mean, u_sim, K + 1)
        accept_len, tokens = sample.chain_accept(*inputs)
        want_len = sample.simulate_accept(accept_len, mean, u_sim, K + 1)
    assert torch.equal(got[0], want_len) and torch.equal(got[1], tokens)
    ref = torch.ops.lingc.chain_accept_simulated(*inputs, mean, u_sim, K + 1)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_shapes_the_kernel_does_not_take_run_the_reference() -> None:
    K = 2
    draft_ids, _, _, logits, _, _ = _chain_inputs(2, K, [0.0, 0.0], [0, K], seed=5)
    mean, seed, counter = torch.tensor([[2.0, 0.0]]), torch.tensor([1, 2]), torch.tensor([3, 4])
    got = sample.greedy_accept_simulated(draft_ids, logits, mean, seed, counter, 3, K + 1)   # mean [1, 2]
    want = torch.ops.lingc.greedy_accept_simulated(draft_ids, logits, mean, seed, counter, 3, K + 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


_SM90 = """
import json
import lingc.kernels.sample as S
from kernel_support import sm90_ptx
out = {}
for sim, greedy in ((0, True), (1, False), (2, True)):
    sig = dict(draft_ptr="*i64", tprobs_ptr="*fp32", dprobs_ptr="*fp32", temp_ptr="*fp32", u_ptr="*fp32",
               val_ptr="*fp32", id_ptr="*i32", sum_ptr="*fp32", len_ptr="*i32", tok_ptr="*i64", V="i32",
               n_chunks="i32", mean_ptr="*fp32", sim_u_ptr="*fp32", s_sim_u="i32", seed_ptr="*i64", counter_ptr="*i64",
               sim_offset="i32")
    const = dict(K=5, KP1_BLOCK=8, C_BLOCK=128, CHUNK=2048, NO_ID=1 << 30, PDL=True, ALL_GREEDY=greedy,
                 SIMULATE=sim, MAX_ACCEPT=6)
    out[sim] = sm90_ptx(S._chain_final_kernel, sig, const, [], 4)
print(json.dumps(out))
"""


def test_the_simulated_stage_two_builds_for_sm90_with_its_loads_after_the_wait() -> None:
    """Compiled offline as the GPU runs it (PDL on): every SIMULATE mode builds, and no global load (the relay's mean,
    seed and counter, the uniforms) comes before griddepcontrol.wait."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for mode, lines in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        loads = [i for i, line in enumerate(lines) if "ld.global" in line]
        assert len(wait) == 1 and loads and min(loads) > wait[0], mode
