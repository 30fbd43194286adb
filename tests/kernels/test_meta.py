"""lingc.kernels.meta in the Triton interpreter against torch.ops.lingc.* (gather/scatter rows, positions,
paged refill, pick position): bit for bit, every output element written (outputs poisoned), odd shapes and
dtypes, strided inputs, and the fallbacks for layouts the kernels do not take."""

from __future__ import annotations

import pytest
import torch

import lingc.kernels.meta as meta
from lingc.kernels.lowering import kernel_table

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
    for op in ("gather_rows", "scatter_rows", "step_positions", "paged_refill", "pick_position"):
        assert table[op] is getattr(meta, op)


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
