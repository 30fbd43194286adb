"""lingc.kernels.meta in the Triton interpreter against torch.ops.lingc.* (gather/scatter rows, positions,
paged refill, pick position, and fuse_relay's gather_rows_multi / scatter_rows_multi): bit for bit, every output
element written (outputs poisoned), odd shapes and dtypes, strided inputs, the fallbacks for layouts the kernels do
not take, bad arguments named, and the multi kernels' PDL path compiled for sm_90."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lingc.kernels.meta as meta
from lingc.kernels.lowering import kernel_table
from lingc.ops.meta import RELAY_MULTI_MAX

POISON = {torch.int64: -0x5A5A5A5A5A, torch.int32: -0x2152411, torch.float32: float("nan"),
          torch.bfloat16: float("nan"), torch.bool: True}


@pytest.fixture(autouse=True)
def _poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty inside the launchers returns poison, so an unwritten element fails the comparison."""
    real = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        t = real(*shape, dtype=dtype, device=device, **kw)
        return t.fill_(POISON.get(t.dtype, 7))
    monkeypatch.setattr(meta.torch, "empty", empty)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


def test_every_meta_op_is_lowered() -> None:
    table = kernel_table()
    for op in ("gather_rows", "scatter_rows", "step_positions", "paged_refill", "step_refill", "pick_position",
               "gather_rows_multi", "scatter_rows_multi", "embedding", "emit_tokens", "emit_accepted"):
        assert table[op] is getattr(meta, op)


def test_pick_position_offset() -> None:
    """pick_position(x, index, -1) is x[b, index[b] - 1] (verify's bonus token, extend's rows at accept_len - 1)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 40, generator=g)
    index = torch.tensor([6, 1], dtype=torch.int32)
    got = meta.pick_position(x, index, -1)
    _same(got, torch.ops.lingc.pick_position(x, index, -1))
    _same(got, torch.stack([x[0, 5:6], x[1, 0:1]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,h", [(1, 1, 1536), (1, 6, 96), (2, 3, 1500)])
def test_embedding(dtype: torch.dtype, B: int, T: int, h: int) -> None:
    g = torch.Generator().manual_seed(B * 100 + T)
    table = torch.randn(50, h, generator=g).to(dtype)
    ids = torch.randint(0, 50, (B, T), generator=g)
    _same(meta.embedding(ids, table), torch.ops.lingc.embedding(ids, table))
    _same(meta.embedding(ids[:, ::2], table), torch.ops.lingc.embedding(ids[:, ::2], table))   # strided ids


def test_embedding_maps_ids_through_an_int64_table() -> None:
    """draft_vocab's map back from a hot index to its token: embedding(index [B, T], map [N, 1] int64), exact."""
    table = torch.tensor([3, 17, 40, 99, 157000], dtype=torch.int64).view(-1, 1)
    ids = torch.tensor([[4, 0], [2, 2]])
    got = meta.embedding(ids, table)
    _same(got, torch.ops.lingc.embedding(ids, table))
    assert got.view(2, 2).tolist() == [[157000, 3], [40, 40]]


@pytest.mark.parametrize("with_count", [False, True])
@pytest.mark.parametrize("n", [1, 6])
def test_emit_tokens(n: int, with_count: bool) -> None:
    g = torch.Generator().manual_seed(n)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    tokens = torch.randint(0, 1000, (2, n), generator=g)
    count = torch.tensor([n, max(n - 2, 1)], dtype=torch.int32) if with_count else None
    outs = [(torch.full((4, 6), -7, dtype=torch.int64), torch.full((4,), -3, dtype=torch.int32)) for _ in range(2)]
    meta.emit_tokens(*outs[0], slots, tokens, count)
    torch.ops.lingc.emit_tokens(*outs[1], slots, tokens, count)
    _same(outs[0][0], outs[1][0])
    _same(outs[0][1], outs[1][1])


@pytest.mark.parametrize("seq_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n", [1, 6])
def test_emit_accepted(n: int, seq_dtype: torch.dtype) -> None:
    """fuse_emit's op: the emit, the last accepted token (count 1 .. n, and a count of 0 wrapping to the last token
    as torch's index -1 does) and seq + count in torch's promoted dtype, each equal to the reference's."""
    g = torch.Generator().manual_seed(10 + n)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    tokens = torch.randint(0, 1000, (3, n), generator=g)
    count = torch.tensor([n, 1, 0], dtype=torch.int32)
    seq = torch.tensor([5, 0, 8190], dtype=seq_dtype)
    outs = [(torch.full((4, 6), -7, dtype=torch.int64), torch.full((4,), -3, dtype=torch.int32)) for _ in range(2)]
    got = meta.emit_accepted(*outs[0], slots, tokens, count, seq)
    want = torch.ops.lingc.emit_accepted(*outs[1], slots, tokens, count, seq)
    for a, b in zip((*outs[0], *got), (*outs[1], *want)):
        _same(a, b)
    assert got[0].view(-1).tolist() == [tokens[0, n - 1].item(), tokens[1, 0].item(), tokens[2, n - 1].item()]
    assert got[1].dtype == torch.promote_types(seq_dtype, torch.int32) and got[1].tolist() == [5 + n, 1, 8190]
    strided = torch.randint(0, 1000, (3, 2 * n), generator=g)[:, ::2]             # a layout the kernel declines
    _same(meta.emit_accepted(*outs[0], slots, strided, count, seq)[0],
          torch.ops.lingc.emit_accepted(*outs[1], slots, strided, count, seq)[0])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("shape", [(5,), (5, 3), (4, 2, 7), (3, 1500)])
def test_gather_scatter_rows(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    buf = _rand(shape, dtype, g)
    slots = torch.tensor([shape[0] - 1, 0, shape[0] - 1], dtype=torch.int32)
    _same(meta.gather_rows(buf, slots), torch.ops.lingc.gather_rows(buf, slots))
    uniq = torch.tensor([2, 0], dtype=torch.int32)
    value = _rand((2, *shape[1:]), dtype, g)
    a, b = buf.clone(), buf.clone()
    meta.scatter_rows(a, uniq, value)
    torch.ops.lingc.scatter_rows(b, uniq, value)
    _same(a, b)


def test_scatter_casts_and_takes_strided_rows() -> None:
    g = torch.Generator().manual_seed(1)
    buf = torch.zeros(4, 6, dtype=torch.int64)
    value = torch.randint(0, 99, (2, 12), generator=g, dtype=torch.int32)[:, ::2]      # non-contiguous rows
    slots = torch.tensor([1, 3], dtype=torch.int32)
    a, b = buf.clone(), buf.clone()
    meta.scatter_rows(a, slots, value)                                                  # falls back to torch
    torch.ops.lingc.scatter_rows(b, slots, value)
    _same(a, b)
    fvalue = torch.randn(2, 6, generator=g) * 50
    a, b = buf.clone(), buf.clone()
    meta.scatter_rows(a, slots, fvalue)
    torch.ops.lingc.scatter_rows(b, slots, fvalue)
    _same(a, b)


def test_gather_rows_of_a_strided_buffer_falls_back() -> None:
    buf = torch.arange(60, dtype=torch.int64).view(6, 10)[:, ::2]
    slots = torch.tensor([5, 1], dtype=torch.int32)
    _same(meta.gather_rows(buf, slots), torch.ops.lingc.gather_rows(buf, slots))


@pytest.mark.parametrize("tokens", [1, 6, 7, 16])
def test_step_positions(tokens: int) -> None:
    seq = torch.tensor([0, 8191, 17], dtype=torch.int32)
    _same(meta.step_positions(seq, tokens), torch.ops.lingc.step_positions(seq, tokens))
    _same(meta.step_positions(seq.long(), tokens), torch.ops.lingc.step_positions(seq.long(), tokens))


@pytest.mark.parametrize("mp,page_size,tokens", [(4, 16, 1), (584, 16, 7), (1500, 8, 3), (3, 4, 16)])
def test_paged_refill(mp: int, page_size: int, tokens: int) -> None:
    g = torch.Generator().manual_seed(mp * 31 + tokens)
    page_table = torch.randint(0, 10_000, (3, mp), generator=g, dtype=torch.int32)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    hi = mp * page_size + 2 * page_size             # some positions past the table: clamped to the last page
    positions = torch.randint(0, hi, (2, tokens + 3), generator=g, dtype=torch.int64)[:, 1:tokens + 1]
    got = meta.paged_refill(page_table, slots, positions, page_size)
    want = torch.ops.lingc.paged_refill(page_table, slots, positions, page_size)
    for x, y in zip(got, want):
        _same(x, y)


@pytest.mark.parametrize("mp,page_size,tokens", [(4, 16, 1), (584, 16, 6), (1500, 8, 4), (3, 4, 16)])
def test_step_refill(mp: int, page_size: int, tokens: int) -> None:
    """step_refill == step_positions then paged_refill of those positions (the op's reference), bit for bit, and
    the kernels it replaces; PDL on == off (a CPU launch drops PDL)."""
    g = torch.Generator().manual_seed(mp * 7 + tokens)
    page_table = torch.randint(0, 10_000, (3, mp), generator=g, dtype=torch.int32)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    seq_lens = torch.tensor([mp * page_size - tokens // 2, 5], dtype=torch.int64)   # one run past the table
    got = meta.step_refill(seq_lens, tokens, page_table, slots, page_size)
    want = torch.ops.lingc.step_refill(seq_lens, tokens, page_table, slots, page_size)
    positions = meta.step_positions(seq_lens, tokens)
    separate = (positions, *meta.paged_refill(page_table, slots, positions, page_size))
    for x, y, z, w in zip(got, want, separate, meta.step_refill(seq_lens, tokens, page_table, slots, page_size,
                                                                pdl=True)):
        _same(x, y)
        _same(x, z)
        _same(x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_pick_position(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = _rand((2, 7, 3, 5), dtype, g)
    index = torch.tensor([6, 0], dtype=torch.int32)
    _same(meta.pick_position(x, index), torch.ops.lingc.pick_position(x, index))
    wide = _rand((2, 7, 40), dtype, g)[:, :, 5:25]                  # a column view of a fused output: rows
    _same(meta.pick_position(wide, index), torch.ops.lingc.pick_position(wide, index))   # contiguous, strided T
    nd = _rand((2, 7), dtype, g)
    _same(meta.pick_position(nd, index), torch.ops.lingc.pick_position(nd, index))


# ---- gather_rows_multi / scatter_rows_multi (fuse_relay) ------------------------------------------------------
# a step's relay tables: counters (int64 / int32), sampling params (fp32), token rows, a hidden row (bf16), a probs
# row wider than one BLOCK (several programs per table row)
RELAY_ROWS = [(torch.int64, ()), (torch.float32, ()), (torch.int32, ()), (torch.int64, (5,)), (torch.bfloat16, (7,)),
              (torch.float32, (1500,)), (torch.int32, (2, 3)), (torch.float32, (3,)), (torch.int64, ()),
              (torch.bool, (4,)), (torch.int32, (9,))]
S = 4


def _tables(n: int, g: torch.Generator) -> list[torch.Tensor]:
    return [_rand((S, *row), dtype, g) for dtype, row in RELAY_ROWS[:n]]


def _slots(B: int) -> torch.Tensor:
    return torch.tensor([3, 1][:B], dtype=torch.int32)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the multi kernels' launches (a launcher that fell back to the reference launches none)."""
    counts = {"gather": 0, "scatter": 0}

    class Counted:
        def __init__(self, kernel, key):
            self.kernel, self.key = kernel, key

        def __getitem__(self, grid):
            counts[self.key] += 1
            return self.kernel[grid]
    monkeypatch.setattr(meta, "_gather_rows_multi_kernel", Counted(meta._gather_rows_multi_kernel, "gather"))
    monkeypatch.setattr(meta, "_scatter_rows_multi_kernel", Counted(meta._scatter_rows_multi_kernel, "scatter"))
    return counts


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("n", [1, 3, RELAY_MULTI_MAX, len(RELAY_ROWS)], ids=lambda n: f"N{n}")
def test_gather_rows_multi(n: int, B: int, launches: dict[str, int]) -> None:
    """Mixed dtypes and row widths in one launch (N <= 8), two launches past RELAY_MULTI_MAX tables."""
    g = torch.Generator().manual_seed(n * 10 + B)
    tables, slots = _tables(n, g), _slots(B)
    got, want = meta.gather_rows_multi(tables, slots), torch.ops.lingc.gather_rows_multi(tables, slots)
    assert len(got) == len(want) == n and launches["gather"] == -(-n // RELAY_MULTI_MAX)
    for x, y, t in zip(got, want, tables):
        _same(x, y)
        _same(y, torch.ops.lingc.gather_rows(t, slots))                  # the reference is the composition


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("n", [1, 3, RELAY_MULTI_MAX, len(RELAY_ROWS)], ids=lambda n: f"N{n}")
def test_scatter_rows_multi(n: int, B: int, launches: dict[str, int]) -> None:
    """table[slots] = value + add: adds on the integer tables (int64 and int32), none on the others; the rows of
    other slots keep their values (the whole tables are compared)."""
    g = torch.Generator().manual_seed(n * 10 + B + 1)
    tables, slots = _tables(n, g), _slots(B)
    values = [_rand((B, *t.shape[1:]), t.dtype, g) for t in tables]
    adds = [(13, -1, 1, 7)[i % 4] if t.dtype in (torch.int32, torch.int64) else 0 for i, t in enumerate(tables)]
    got, want, comp = ([t.clone() for t in tables] for _ in range(3))
    meta.scatter_rows_multi(got, slots, values, adds)
    torch.ops.lingc.scatter_rows_multi(want, slots, values, adds)
    assert launches["scatter"] == -(-n // RELAY_MULTI_MAX)
    for t, v, a in zip(comp, values, adds):                              # the composition the op stands for
        torch.ops.lingc.scatter_rows(t, slots, v + a if a else v)
    for x, y, z in zip(got, want, comp):
        _same(x, y)
        _same(y, z)


def test_scatter_rows_multi_adds_wrap_and_cast_like_torch(launches: dict[str, int]) -> None:
    """The add runs in the value's dtype (int32 wraps at 2^31, as aten.add does), then the cast to the table's."""
    slots = _slots(2)
    i32 = torch.tensor([2**31 - 1, -5], dtype=torch.int32)
    i64 = torch.tensor([2**62, 3], dtype=torch.int64)
    tables = [torch.zeros(S, dtype=torch.int64), torch.zeros(S, dtype=torch.int32), torch.zeros(S, dtype=torch.int64)]
    values, adds = [i32, i64, i64], [1, 2**40, -(2**40)]
    got, want = [t.clone() for t in tables], [t.clone() for t in tables]
    meta.scatter_rows_multi(got, slots, values, adds)
    torch.ops.lingc.scatter_rows_multi(want, slots, values, adds)
    for x, y in zip(got, want):
        _same(x, y)
    assert got[0][3] == -(2**31) and got[2][1] == 3 - 2**40 and launches["scatter"] == 1


def test_scatter_rows_multi_falls_back(launches: dict[str, int]) -> None:
    """Tables sharing memory (one launch would race), strided rows and an add that does not fit an int32 value run
    the sequential reference."""
    g = torch.Generator().manual_seed(4)
    slots = _slots(2)

    def aliased() -> list[torch.Tensor]:
        pool = torch.zeros(S, 6, dtype=torch.int64)
        return [pool, pool[:, :3]]

    def strided() -> list[torch.Tensor]:
        return [torch.arange(40, dtype=torch.int64).view(S, 10)[:, ::2], torch.zeros(S, dtype=torch.int32)]

    def small() -> list[torch.Tensor]:
        return [torch.zeros(S, dtype=torch.int32)]

    cases = [(aliased, [_rand((2, 6), torch.int64, g), _rand((2, 3), torch.int64, g)], [0, 1]),
             (strided, [_rand((2, 5), torch.int64, g), _rand((2,), torch.int32, g)], [2, 0]),
             (small, [_rand((2,), torch.int32, g)], [2**33])]
    for make, values, adds in cases:
        got, want = make(), make()
        meta.scatter_rows_multi(got, slots, values, adds)
        torch.ops.lingc.scatter_rows_multi(want, slots, values, adds)
        for x, y in zip(got, want):
            _same(x, y)
    assert launches["scatter"] == 0


@pytest.mark.parametrize("B", [1, 2])
def test_scatter_rows_multi_into_column_slices(B: int, launches: dict[str, int]) -> None:
    """fuse_relay_cat's form: a chain table [S, 6] and a probs table [S, 5, V] written column by column (views of
    one buffer that share no element) with another table, in one launch per RELAY_MULTI_MAX tables; every other
    element of the tables keeps its value."""
    g = torch.Generator().manual_seed(17 + B)
    slots = _slots(B)

    def make() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        chain, probs, seq = _rand((S, 6), torch.int64, torch.Generator().manual_seed(1)), \
            _rand((S, 5, 1500), torch.float32, torch.Generator().manual_seed(2)), torch.zeros(S, dtype=torch.int64)
        cols = [chain[:, i:i + 1] for i in range(6)] + [probs[:, i:i + 1] for i in range(5)]
        return [seq, chain, probs], [seq, *cols]

    values = [_rand((B,), torch.int64, g)] + [_rand((B, 1), torch.int64, g) for _ in range(6)] \
        + [_rand((B, 1, 1500), torch.float32, g) for _ in range(5)]
    adds = [1] + [0] * 11
    (got_bufs, got), (want_bufs, want) = make(), make()
    assert meta._disjoint(got)
    meta.scatter_rows_multi(got, slots, values, adds)
    torch.ops.lingc.scatter_rows_multi(want, slots, values, adds)
    assert launches["scatter"] == -(-len(got) // RELAY_MULTI_MAX)
    for x, y in zip(got_bufs, want_bufs):
        _same(x, y)
    cat = torch.cat(values[1:7], dim=1)                                 # what the cat + one scatter wrote
    _same(want_bufs[1][slots.long()], cat)
    _same(want_bufs[2][slots.long()], torch.cat(values[7:], dim=1))


def test_disjoint_tables() -> None:
    """The launcher's overlap test: column slices of one table are disjoint; overlapping slices, a slice and its
    table, slices that start in different rows or cross a row's end, and different dtypes of one buffer are not."""
    t = torch.zeros(S, 8, dtype=torch.int64)
    p = torch.zeros(S, 4, 3)
    assert meta._disjoint([t[:, 0:1], t[:, 1:4], t[:, 4:8], p[:, 0:1], p[:, 3:4], torch.zeros(S)])
    assert meta._disjoint([p[:, 1:2], p[:, 0:1]])                      # any order
    assert not meta._disjoint([t[:, 0:3], t[:, 2:4]])
    assert not meta._disjoint([t, t[:, 5:6]])
    assert not meta._disjoint([t[:, 0:2], t[1:, 2:4]])                  # a different first row
    assert not meta._disjoint([t.view(S * 2, 4)[:, 0:2], t.view(S * 2, 4)[:, 2:4], t[:, 0:1]])   # row strides differ
    assert not meta._disjoint([t[:, 0:1], t.view(torch.float64)[:, 1:2]])
    assert not meta._disjoint([t.t()[0:1], t.t()[1:2]])                # [8, S] views: rows of stride 1


def test_gather_rows_multi_of_a_strided_table_falls_back(launches: dict[str, int]) -> None:
    strided = torch.arange(40, dtype=torch.int64).view(S, 10)[:, ::2]
    tables, slots = [strided, torch.arange(S, dtype=torch.float32)], _slots(2)
    for x, y in zip(meta.gather_rows_multi(tables, slots), torch.ops.lingc.gather_rows_multi(tables, slots)):
        _same(x, y)
    assert launches["gather"] == 0


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_multi_ops_name_bad_arguments(impl: str) -> None:
    gather = meta.gather_rows_multi if impl == "kernel" else torch.ops.lingc.gather_rows_multi
    scatter = meta.scatter_rows_multi if impl == "kernel" else torch.ops.lingc.scatter_rows_multi
    t64, tf = torch.zeros(S, dtype=torch.int64), torch.zeros(S, 3)
    slots = _slots(2)
    with pytest.raises(ValueError, match="tables is empty"):
        gather([], slots)
    with pytest.raises(ValueError, match="slots must be a 1-D int32 / int64 tensor, got \\[2, 1\\]"):
        gather([t64], slots.view(2, 1))
    with pytest.raises(ValueError, match="slots must be .* torch.float32"):
        gather([t64], slots.float())
    with pytest.raises(ValueError, match="tables\\[1\\] is 0-D"):
        gather([t64, torch.tensor(1)], slots)
    with pytest.raises(ValueError, match="tables, values and adds must have one entry per table, got 2, 1 and 2"):
        scatter([t64, tf], slots, [torch.zeros(2, dtype=torch.int64)], [0, 0])
    with pytest.raises(ValueError, match="values\\[1\\] is \\[2, 4\\], want \\[2, 3\\]"):
        scatter([t64, tf], slots, [torch.zeros(2, dtype=torch.int64), torch.zeros(2, 4)], [0, 0])
    with pytest.raises(ValueError, match="adds\\[1\\] = 1 on torch.float32 values"):
        scatter([t64, tf], slots, [torch.zeros(2, dtype=torch.int64), torch.zeros(2, 3)], [1, 1])


_PTX_PROBE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.meta as K

def compiled(fn, sig, consts):
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
    find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
    return find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents"), find("ld.global")

kinds = ["i64", "fp32", "bf16"]
for pdl in (True, False):
    sig = {"slots_ptr": "*i32"}
    for k in range(8):
        dt = kinds[k] if k < 3 else "i32"
        sig |= {f"src{k}": f"*{dt}", f"out{k}": f"*{dt}", f"R{k}": "i32", f"s{k}": "i32", f"E{k}": "i32"}
    sig |= {"N": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"}
    print("gather", pdl, *compiled(K._gather_rows_multi_kernel, sig, dict(N=3, BLOCK=1024, PDL=pdl)), sep="|")
    sig = {"slots_ptr": "*i32"}
    for k in range(8):
        dt = kinds[k] if k < 3 else "i32"
        sig |= {f"buf{k}": f"*{dt}", f"val{k}": f"*{dt}", f"R{k}": "i32", f"sb{k}": "i32", f"sv{k}": "i32",
                f"E{k}": "i32"}
    sig |= {f"A{k}": "constexpr" for k in range(8)} | {"N": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"}
    consts = dict(A0=1, A1=0, A2=0, A3=0, A4=0, A5=0, A6=0, A7=0, N=3, BLOCK=1024, PDL=pdl)
    print("scatter", pdl, *compiled(K._scatter_rows_multi_kernel, sig, consts), sep="|")
"""


def test_multi_kernels_pdl_path_compiles_for_sm90() -> None:
    """Both multi kernels compile for sm_90 (no GPU needed) with PDL on: one gdc_wait, before every global load
    (the slot, then the table rows an earlier kernel wrote; no weights here) and a launch_dependents (right
    behind the wait under LINGC_PDL_TRIGGER=early, the default); with PDL off, no GDC instruction at all."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LINGC_PDL_TRIGGER")}
    proc = subprocess.run([sys.executable, "-c", _PTX_PROBE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|") for line in proc.stdout.strip().splitlines()]
    assert len(rows) == 4
    for kernel, pdl, waits, triggers, loads in rows:
        waits, triggers, loads = eval(waits), eval(triggers), eval(loads)
        assert loads, kernel
        if pdl == "True":
            assert len(waits) == 1 and waits[0] < loads[0], (kernel, waits, loads)
            assert len(triggers) == 1 and waits[0] < triggers[0] < loads[0], (kernel, triggers)
        else:
            assert waits == [] and triggers == [], kernel
