"""kernels/l2_prefetch.py: the hint kernels' sm_90 code compiled offline (a hint has no CPU result to compare), and
the experts kernel's address math in the interpreter.

Under PDL the trigger comes first, then the prefetches, then the wait (so the kernel's completion still implies its
predecessor's); without PDL there is no GDC instruction. The bulk path issues one cp.async.bulk.prefetch.L2 a thread,
the line path one prefetch.global.L2 a 128 B line; EVICT_LAST adds the evict_last policy to each. The experts kernel
(l2_prefetch_experts) issues one bulk prefetch a thread a step, stores nothing and is never PDL-launched; its RECORD
path (offsets and sizes stored instead of prefetched) runs in the interpreter, where the pieces must tile each picked
expert's bytes once; so does the pages kernel's (l2_prefetch_pages, MLA's latent cache: each visible page once,
nothing past the last query's page, no invalid page id). The launchers do nothing off CUDA. Whether a prefetch pays
is measured on the GPU (bench/kernel_l2_prefetch.py, bench/device_prefetch_ab.sh, bench/device_cache_prefetch_ab.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from lingc.kernels import l2_prefetch as P

# every variant the tests look at, compiled for sm_90 in one subprocess (TRITON_INTERPRET unset there; triton.compile
# runs ptxas too, so the inline PTX is checked): weights kernel (chunk, bulk, pdl, evict_last), experts kernel
# (pairs, nbytes, iters, evict_last, dedupe)
WEIGHT_VARIANTS = [(944, True, True, False), (944, True, False, False), (1024, False, True, False),
                   (944, True, False, True), (1024, False, False, True)]
EXPERT_VARIANTS = [(9, 3 << 20, 1, False, True), (9, 3 << 20, 2, False, False), (9, 3 << 20, 1, True, False),
                   (54, 3 << 20, 1, False, True)]
PAGE_VARIANTS = [(128, 64 * 576 * 2, 1, 8), (512, 64 * 576 * 2, 3, 1)]     # pages (MP), page bytes, iters, T_POW2

_PROBE = r"""
import json, sys, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from lingc.kernels.l2_prefetch import (_l2_prefetch_kernel, _l2_prefetch_experts_kernel, _l2_prefetch_pages_kernel,
                                       expert_pieces, page_pieces)
weights, experts, pages = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
KEYS = {"trigger": "griddepcontrol.launch_dependents", "wait": "griddepcontrol.wait", "gdc": "griddepcontrol",
        "bulk": "cp.async.bulk.prefetch.L2.global", "line": "prefetch.global.L2", "store": "st.global",
        "policy": "createpolicy.fractional.L2::evict_last", "hinted": "cp.async.bulk.prefetch.L2.global.L2::cache_hint",
        "line_last": "prefetch.global.L2::evict_last"}
def found(src):
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]
    lines = [l.strip() for l in ptx.splitlines() if not l.strip().startswith("//")]
    return {k: [i for i, l in enumerate(lines) if l.startswith(s) or (" " + s) in l] for k, s in KEYS.items()}
out = {"weights": [], "experts": [], "pages": []}
for chunk, bulk, pdl, last in weights:
    sig = {"ptr": "*u8", "nbytes": "i64", "CHUNK": "constexpr", "THREADS": "constexpr", "BULK": "constexpr",
           "PDL": "constexpr", "EVICT_LAST": "constexpr"}
    out["weights"].append(found(ASTSource(_l2_prefetch_kernel, sig, {"CHUNK": chunk, "THREADS": 128, "BULK": bulk,
                                                                    "PDL": pdl, "EVICT_LAST": last})))
for pairs, nbytes, iters, last, dedupe in experts:
    chunk, pieces = expert_pieces(pairs, nbytes)
    sig = {"w_ptr": "*u8", "ids_ptr": "*i32", "rec_ptr": "*i32", "NP": "i32", "E": "i32", "expert_bytes": "i64",
           "nbytes": "i64",
           "CHUNK": "constexpr", "PIECES": "constexpr", "THREADS": "constexpr", "ITERS": "constexpr",
           "EVICT_LAST": "constexpr", "DEDUPE": "constexpr", "NP_POW2": "constexpr"}
    out["experts"].append(found(ASTSource(_l2_prefetch_experts_kernel, sig, {
        "CHUNK": chunk, "PIECES": pieces, "THREADS": 128, "ITERS": iters, "EVICT_LAST": last, "DEDUPE": dedupe,
        "NP_POW2": triton.next_power_of_2(pairs) if dedupe else 1})))
for mp, page_bytes, iters, t_pow2 in pages:
    chunk, pieces = page_pieces(mp, page_bytes)
    sig = {"pages_ptr": "*u8", "rows_ptr": "*i32", "pos_ptr": "*i64", "rec_ptr": "*i32", "T": "i32", "MP": "i32",
           "PS": "i32", "NUM_PAGES": "i32", "page_bytes": "i64", "stride_page": "i64", "stride_rb": "i32",
           "stride_pb": "i32", "CHUNK": "constexpr", "PIECES": "constexpr", "THREADS": "constexpr",
           "ITERS": "constexpr", "T_POW2": "constexpr", "EVICT_LAST": "constexpr"}
    out["pages"].append(found(ASTSource(_l2_prefetch_pages_kernel, sig, {
        "CHUNK": chunk, "PIECES": pieces, "THREADS": 128, "ITERS": iters, "T_POW2": t_pow2, "EVICT_LAST": False})))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict[str, list[int]]]]:
    """PTX line numbers of each KEYS instruction per variant (WEIGHT_, EXPERT_, PAGE_VARIANTS order)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(WEIGHT_VARIANTS), json.dumps(EXPERT_VARIANTS),
                           json.dumps(PAGE_VARIANTS)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _weights(compiled, *variant) -> dict[str, list[int]]:
    return compiled["weights"][WEIGHT_VARIANTS.index(variant)]


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "stream-ordered"])
def test_bulk_prefetch_between_the_trigger_and_the_wait(compiled, pdl: bool) -> None:
    f = _weights(compiled, 944, True, pdl, False)
    assert len(f["bulk"]) == 1 and not f["line"] and not f["policy"] and not f["hinted"]
    if pdl:
        assert len(f["trigger"]) == 1 and len(f["wait"]) == 1 and f["trigger"][0] < f["bulk"][0] < f["wait"][0]
    else:
        assert not f["trigger"] and not f["wait"]


def test_line_prefetch_one_a_line(compiled) -> None:
    f = _weights(compiled, 1024, False, True, False)
    assert not f["bulk"] and len(f["line"]) == 1024 // P.LINE and not f["line_last"]
    assert f["trigger"][0] < min(f["line"]) and max(f["line"]) < f["wait"][0]


def test_evict_last_puts_the_policy_on_every_prefetch(compiled) -> None:
    """EVICT_LAST: the bulk prefetch carries an evict_last createpolicy (.L2::cache_hint), the line path
    prefetch.global.L2::evict_last on every line; ptxas accepts both for sm_90."""
    f = _weights(compiled, 944, True, False, True)
    assert len(f["bulk"]) == len(f["hinted"]) == len(f["policy"]) == 1 and not f["line"]   # one inline-asm block
    f = _weights(compiled, 1024, False, False, True)
    assert not f["bulk"] and len(f["line_last"]) == len(f["line"]) == 1024 // P.LINE and not f["policy"]


@pytest.mark.parametrize("nbytes", [1, 16, 31_506_432, 482_869_248])
def test_chunks_cover_the_range_in_aligned_pieces(nbytes: int) -> None:
    chunk = P.chunk_bytes(nbytes)
    assert chunk % P.ALIGN == 0 and chunk * P.PROGRAMS * P.THREADS >= nbytes


def test_launcher_is_a_no_op_off_cuda() -> None:
    w = torch.randn(64, 64)
    assert P.l2_prefetch(w) is None and P.LOWERINGS["l2_prefetch"](w, 0, -1) is None


@pytest.mark.parametrize("variant", EXPERT_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_expert_prefetch_one_bulk_prefetch_a_step(compiled, variant) -> None:
    """l2_prefetch_experts' kernel: ITERS bulk prefetches a thread (evict_last: each with its policy), no store, no
    GDC instruction (a side-stream hint, never PDL-launched); ptxas accepts it for sm_90, with and without the
    repeated-id check."""
    _, _, iters, last, _ = variant
    f = compiled["experts"][EXPERT_VARIANTS.index(variant)]
    assert len(f["bulk"]) == iters and not f["store"] and not f["gdc"]
    assert (len(f["hinted"]), len(f["policy"])) == ((iters, iters) if last else (0, 0))


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
        w, ids_t, rec, pairs, experts, expert_bytes, nbytes, CHUNK=chunk, PIECES=pieces, THREADS=P.THREADS,
        ITERS=iters, DEDUPE=dedupe, NP_POW2=triton.next_power_of_2(pairs) if dedupe else 1, RECORD=True)
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


# ---- l2_prefetch_pages (MLA's latent cache; prefetch_weights' MLA_CACHE) -------------------------------------------

@pytest.mark.parametrize("variant", PAGE_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_page_prefetch_one_bulk_prefetch_a_step(compiled, variant) -> None:
    """The pages kernel: ITERS bulk prefetches a thread, no store, no GDC instruction (a side-stream hint)."""
    f = compiled["pages"][PAGE_VARIANTS.index(variant)]
    assert len(f["bulk"]) == variant[2] and not f["store"] and not f["gdc"] and not f["policy"]


def test_page_launcher_is_a_no_op_off_cuda_and_names_bad_shapes() -> None:
    pages = torch.zeros(8, 4, 16, dtype=torch.bfloat16)
    rows = torch.arange(4, dtype=torch.int32).reshape(1, 4)
    pos = torch.tensor([[5]], dtype=torch.int64)
    assert P.l2_prefetch_pages(pages, rows, pos) is None and P.LOWERINGS["l2_prefetch_pages"](pages, rows, pos) is None
    with pytest.raises(ValueError, match=r"want kv_pages \[NP, PS, \.\.\.\], integer page_rows \[B, MP\] and "
                                         r"positions \[B, T\], got \[8, 4, 16\], \[1, 4\] torch.int32, \[2, 1\]"):
        P.l2_prefetch_pages(pages, rows, pos.expand(2, 1))
    with pytest.raises(ValueError, match=r"\[4\] torch.int32"):
        P.l2_prefetch_pages(pages, rows[0], pos)


@pytest.mark.parametrize("positions, page_table", [
    ([[5 * 64 + 3, 5 * 64 + 4], [-1, 2 * 64]], None),                 # a 2-query chain; a request's first position -1
    ([[0, 0], [15 * 64 + 63, 15 * 64 + 63]], None),                   # one row; every page (the capacity)
    ([[-1, -1], [9 * 64, 9 * 64 + 1]], [3, -1, 40, 99]),             # no query; page ids -1 / past NP at j = 1, 3
])
def test_page_pieces_tile_each_visible_page_once(positions, page_table) -> None:
    """The pages kernel's address math in the interpreter (RECORD): request b's pieces tile exactly the pages
    page_rows[b, j], j <= max_t positions[b, t] // PS (whole pages, 16 B aligned pieces, none spanning two pages),
    nothing past them, nothing for a page id outside [0, NP), nothing where no position is >= 0."""
    n_pages, ps, width, mp, programs = 40, 64, 576, 16, 4
    page_bytes = ps * width * 2
    gen = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(n_pages, generator=gen)[:mp] for _ in range(2)]).to(torch.int32)
    if page_table is not None:
        for j, page in enumerate(page_table):
            rows[1, j] = page
    pos = torch.tensor(positions, dtype=torch.int64)
    chunk, pieces = P.page_pieces(mp, page_bytes, programs)
    grid = (min(programs, -(-mp * pieces // P.THREADS)), 2)
    iters = -(-mp * pieces // (grid[0] * P.THREADS))
    rec = torch.full((2 * iters * grid[0] * P.THREADS * 2,), -7, dtype=torch.int64)
    P._l2_prefetch_pages_kernel[grid](
        torch.empty(16, dtype=torch.uint8), rows, pos, rec, 2, mp, ps, n_pages, page_bytes, page_bytes, rows.stride(0),
        pos.stride(0), CHUNK=chunk, PIECES=pieces, THREADS=P.THREADS, ITERS=iters, T_POW2=2, RECORD=True)
    got = rec.reshape(2, -1, 2)
    assert (got != -7).all()
    for b in range(2):
        last = max(positions[b])
        want = sorted(p for p in rows[b, :last // ps + 1].tolist() if 0 <= p < n_pages) if last >= 0 else []
        covered: dict[int, list[tuple[int, int]]] = {}
        for off, size in got[b].tolist():
            if size <= 0:
                continue
            page = off // page_bytes
            assert off % P.ALIGN == 0 and size <= chunk and (off + size - 1) // page_bytes == page
            covered.setdefault(page, []).append((off - page * page_bytes, off - page * page_bytes + size))
        assert sorted(covered) == want
        for parts in covered.values():
            parts.sort()
            assert parts[0][0] == 0 and parts[-1][1] == page_bytes
            assert all(a[1] == b_[0] for a, b_ in zip(parts, parts[1:]))   # contiguous, no overlap
