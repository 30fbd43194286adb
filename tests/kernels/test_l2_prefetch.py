"""kernels/l2_prefetch.py: the hint kernel's sm_90 code compiled offline (a hint has no CPU result to compare).

Under PDL the trigger comes first, then the prefetches, then the wait (so the kernel's completion still implies its
predecessor's); without PDL there is no GDC instruction. The bulk path issues one cp.async.bulk.prefetch.L2 a thread,
the line path one prefetch.global.L2 a 128 B line. The launcher does nothing off CUDA. Whether the prefetch pays is
measured on the H200 (bench/kernel_l2_prefetch.py, bench/device_step.py's A/B)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton

from lingc.kernels import l2_prefetch as P

_PROBE = r"""
import sys, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from lingc.kernels.l2_prefetch import _l2_prefetch_kernel
chunk, bulk, pdl, last = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4] == "1"
src = ASTSource(_l2_prefetch_kernel, {"ptr": "*u8", "nbytes": "i64", "CHUNK": "constexpr", "THREADS": "constexpr",
                                      "BULK": "constexpr", "PDL": "constexpr", "EVICT_LAST": "constexpr"},
                {"CHUNK": chunk, "THREADS": 128, "BULK": bulk, "PDL": pdl, "EVICT_LAST": last})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]
lines = [l.strip() for l in ptx.splitlines() if not l.strip().startswith("//")]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s) or (" " + s) in l]
print(find("griddepcontrol.launch_dependents"), find("cp.async.bulk.prefetch.L2.global"),
      find("prefetch.global.L2"), find("griddepcontrol.wait"), find("createpolicy.fractional.L2::evict_last"),
      find("cp.async.bulk.prefetch.L2.global.L2::cache_hint"), find("prefetch.global.L2::evict_last"), sep="|")
"""


def _compile(chunk: int, bulk: bool, pdl: bool, evict_last: bool = False) -> tuple[list[int], ...]:
    """PTX line numbers of: trigger, bulk prefetch, line prefetch, wait, createpolicy, bulk with a policy, line
    prefetch with evict_last (triton.compile runs ptxas too, so the inline PTX is checked for sm_90)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    flags = ["1" if flag else "0" for flag in (bulk, pdl, evict_last)]
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(chunk), *flags],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tuple(eval(p) for p in proc.stdout.strip().splitlines()[-1].split("|"))


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "stream-ordered"])
def test_bulk_prefetch_between_the_trigger_and_the_wait(pdl: bool) -> None:
    trigger, bulk, line, wait, policy, hinted, _ = _compile(944, True, pdl)
    assert len(bulk) == 1 and not line and not policy and not hinted
    if pdl:
        assert len(trigger) == 1 and len(wait) == 1 and trigger[0] < bulk[0] < wait[0]
    else:
        assert not trigger and not wait


def test_line_prefetch_one_a_line() -> None:
    trigger, bulk, line, wait, _, _, last = _compile(1024, False, True)
    assert not bulk and len(line) == 1024 // P.LINE and trigger[0] < min(line) and max(line) < wait[0] and not last


def test_evict_last_puts_the_policy_on_every_prefetch() -> None:
    """EVICT_LAST: the bulk prefetch carries an evict_last createpolicy (.L2::cache_hint), the line path
    prefetch.global.L2::evict_last on every line; ptxas accepts both for sm_90."""
    _, bulk, line, _, policy, hinted, last = _compile(944, True, False, True)
    assert len(bulk) == len(hinted) == len(policy) == 1 and not line      # one inline-asm block, one PTX line
    _, bulk, line, _, policy, hinted, last = _compile(1024, False, False, True)
    assert not bulk and len(last) == len(line) == 1024 // P.LINE and not policy


@pytest.mark.parametrize("nbytes", [1, 16, 31_506_432, 482_869_248])
def test_chunks_cover_the_range_in_aligned_pieces(nbytes: int) -> None:
    chunk = P.chunk_bytes(nbytes)
    assert chunk % P.ALIGN == 0 and chunk * P.PROGRAMS * P.THREADS >= nbytes


def test_launcher_is_a_no_op_off_cuda() -> None:
    w = torch.randn(64, 64)
    assert P.l2_prefetch(w) is None and P.LOWERINGS["l2_prefetch"](w, 0, -1) is None


_PROBE_EXPERTS = r"""
import sys, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from lingc.kernels.l2_prefetch import _l2_prefetch_experts_kernel, expert_pieces
pairs, nbytes, iters, last = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
dedupe = sys.argv[5] == "1"
chunk, pieces = expert_pieces(pairs, nbytes)
sig = {"w_ptr": "*u8", "ids_ptr": "*i32", "NP": "i32", "E": "i32", "expert_bytes": "i64", "nbytes": "i64",
       "CHUNK": "constexpr", "PIECES": "constexpr", "THREADS": "constexpr", "ITERS": "constexpr",
       "EVICT_LAST": "constexpr", "DEDUPE": "constexpr", "NP_POW2": "constexpr"}
src = ASTSource(_l2_prefetch_experts_kernel, sig, {"CHUNK": chunk, "PIECES": pieces, "THREADS": 128, "ITERS": iters,
                                                    "EVICT_LAST": last, "DEDUPE": dedupe,
                                                    "NP_POW2": triton.next_power_of_2(pairs) if dedupe else 1})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]
lines = [l.strip() for l in ptx.splitlines() if not l.strip().startswith("//")]
count = lambda s: sum(s in l for l in lines)
print(count("cp.async.bulk.prefetch.L2.global"), count("L2::cache_hint"), count("createpolicy"), count("st.global"),
      count("griddepcontrol"), sep="|")
"""


@pytest.mark.parametrize("pairs, iters, last, dedupe", [(9, 1, False, True), (9, 2, False, False),
                                                        (9, 1, True, False), (54, 1, False, True)])
def test_expert_prefetch_one_bulk_prefetch_a_step(pairs: int, iters: int, last: bool, dedupe: bool) -> None:
    """l2_prefetch_experts' kernel: ITERS bulk prefetches a thread (evict_last: each with its policy), no store, no
    GDC instruction (a side-stream hint, never PDL-launched); ptxas accepts it for sm_90, with and without the
    repeated-id check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [str(pairs), str(3 << 20), str(iters), "1" if last else "0", "1" if dedupe else "0"]
    proc = subprocess.run([sys.executable, "-c", _PROBE_EXPERTS, *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bulk, hinted, policy, stores, gdc = (int(x) for x in proc.stdout.strip().splitlines()[-1].split("|"))
    assert bulk == iters and stores == 0 and gdc == 0
    assert (hinted, policy) == ((iters, iters) if last else (0, 0))


@pytest.mark.parametrize("pairs, nbytes", [(9, 3 << 20), (54, 3 << 20), (9, 1_572_864), (1, 16), (64, 160)])
def test_expert_pieces_cover_each_expert_in_aligned_pieces(pairs: int, nbytes: int) -> None:
    chunk, pieces = P.expert_pieces(pairs, nbytes)
    assert chunk % P.ALIGN == 0 and pieces * chunk >= nbytes > (pieces - 1) * chunk
    assert pairs * pieces <= 2 * P.PROGRAMS * P.THREADS or pieces == 1


def test_expert_launcher_is_a_no_op_off_cuda() -> None:
    w = torch.randn(4, 8, 16)
    ids = torch.tensor([[0, 3]], dtype=torch.int32)
    assert P.l2_prefetch_experts(w, ids) is None and P.LOWERINGS["l2_prefetch_experts"](w, ids, -1) is None


@pytest.mark.parametrize("ids, nbytes, experts", [
    ([[3, 7, 1, 0, 5, 6, 2, 4, 8]], 3 << 20, 9),                     # decode: 8 picks + the shared expert, distinct
    ([[3, 7, 8], [7, 1, 8], [3, 1, 8]], 1 << 20, 9),                 # a chain: shared picks and the shared expert
    ([[0, 2], [9, -1]], 4096, 9),                                    # ids outside [0, E): nothing
    ([[5] * 70], 48 << 10, 9),                                       # > DEDUPE_MAX_PAIRS: repeats fetched again
])
def test_expert_pieces_tile_each_picked_expert_once(ids, nbytes: int, experts: int) -> None:
    """The experts kernel's address math in the interpreter (RECORD: each thread's (offset, size) stored instead of a
    prefetch): the pieces of every distinct valid id tile bytes [0, nbytes) of its expert exactly once (16 B aligned,
    no overlap, nothing past the expert), repeated ids add nothing where DEDUPE applies, invalid ids nothing."""
    ids_t = torch.tensor(ids, dtype=torch.int32).reshape(-1)
    pairs = ids_t.numel()
    expert_bytes = 4 << 20
    chunk, pieces = P.expert_pieces(pairs, nbytes, programs=4, threads=P.THREADS)
    grid = min(4, -(-pairs * pieces // P.THREADS))
    iters = -(-pairs * pieces // (grid * P.THREADS))
    dedupe = pairs <= P.DEDUPE_MAX_PAIRS
    rec = torch.full((iters * grid * P.THREADS * 2,), -7, dtype=torch.int64)
    w = torch.empty(16, dtype=torch.uint8)                       # never read: RECORD stores offsets only
    P._l2_prefetch_experts_kernel[(grid,)](
        w, ids_t, pairs, experts, expert_bytes, nbytes, CHUNK=chunk, PIECES=pieces, THREADS=P.THREADS, ITERS=iters,
        DEDUPE=dedupe, NP_POW2=triton.next_power_of_2(pairs) if dedupe else 1, rec_ptr=rec, RECORD=True)
    got = rec.reshape(-1, 2)
    assert (got[:, 0] != -7).all()
    spans = sorted((int(o), int(o + s)) for o, s in got.tolist() if s > 0)
    assert all(a % P.ALIGN == 0 and b - a <= chunk for a, b in spans)
    valid = [e for e in ids_t.tolist() if 0 <= e < experts]
    want_experts = sorted(set(valid)) if dedupe else sorted(valid)
    covered: dict[int, list[tuple[int, int]]] = {}
    for a, b in spans:
        e = a // expert_bytes
        assert (b - 1) // expert_bytes == e                      # a piece never spans two experts
        covered.setdefault(e, []).append((a - e * expert_bytes, b - e * expert_bytes))
    if dedupe:
        assert sorted(covered) == want_experts
        for e, parts in covered.items():
            parts.sort()
            assert parts[0][0] == 0 and parts[-1][1] == nbytes
            assert all(x[1] == y[0] for x, y in zip(parts, parts[1:]))   # contiguous, no overlap
    else:
        total = sum(b - a for part in covered.values() for a, b in part)
        assert total == len(want_experts) * nbytes
