"""embedding_rmsnorm / embedding_rmsnorm_cat (kernels/rmsnorm.py GATHER, fuse_embed_norm) in the Triton interpreter:
bit for bit the embedding kernel followed by the rmsnorm / rmsnorm_cat kernel, within the kernel tolerance of the
references; ids repeated and out of order, rows of masked widths; and test-tiny's decode / mtp_decode graphs with and
without the fuse_embed_norm pass, bit for bit on the kernels."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lingc.kernels.meta import embedding
from lingc.passes.manager import PassManager
from lingc.kernels.rmsnorm import (embedding_rmsnorm, embedding_rmsnorm_cat, embedding_rmsnorm_cat_ref,
                                   embedding_rmsnorm_ref, rmsnorm, rmsnorm_cat)

EPS = 1e-6
CASES = [(1, 1, 16), (1, 6, 48), (2, 3, 130)]        # (B, T, N): decode, verify, a masked tail


def _inputs(B: int, T: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(37, n, generator=g).mul(3).to(dtype)                  # [V, N]
    ids = torch.randint(0, 37, (B, T), generator=g)
    ids[0, 0] = 36                                                             # the last row
    if T > 1:
        ids[0, 1] = ids[0, 0]                                                  # a repeated id
    w1 = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    w2 = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    hidden = torch.randn(B, T, n, generator=g).to(dtype)
    return ids, table, w1, w2, hidden


@pytest.mark.parametrize("B,T,n", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_embedding_rmsnorm_is_the_pair(B: int, T: int, n: int, dtype: torch.dtype,
                                       assert_kernel_close: Callable) -> None:
    ids, table, w, _, _ = _inputs(B, T, n, dtype, seed=B * 100 + T * 10 + n)
    out, x = embedding_rmsnorm(ids, table, w, EPS)
    rows = embedding(ids, table)                                               # the two kernels it replaces
    assert torch.equal(x, table[ids]) and torch.equal(x, rows)
    assert torch.equal(out, rmsnorm(rows, w, EPS))
    want_out, want_x = embedding_rmsnorm_ref(ids, table, w, EPS)
    assert torch.equal(x, want_x)
    assert_kernel_close(out, want_out)


@pytest.mark.parametrize("B,T,n", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_embedding_rmsnorm_cat_is_the_pair(B: int, T: int, n: int, dtype: torch.dtype,
                                           assert_kernel_close: Callable) -> None:
    ids, table, w1, w2, hidden = _inputs(B, T, n, dtype, seed=B * 100 + T * 10 + n + 1)
    out = embedding_rmsnorm_cat(ids, table, w1, hidden, w2, EPS)
    assert out.shape == (B, T, 2 * n)
    assert torch.equal(out, rmsnorm_cat(embedding(ids, table), w1, hidden, w2, EPS))
    assert_kernel_close(out, embedding_rmsnorm_cat_ref(ids, table, w1, hidden, w2, EPS))


def test_fallbacks_run_the_reference() -> None:
    """Shapes the GATHER kernels do not take (1-D ids, a column-strided table) give the reference's values."""
    ids, table, w1, w2, hidden = _inputs(1, 3, 16, torch.float32, seed=5)
    out, x = embedding_rmsnorm(ids[0], table, w1, EPS)                        # ids [T]
    want_out, want_x = embedding_rmsnorm_ref(ids[0], table, w1, EPS)
    assert torch.equal(out, want_out) and torch.equal(x, want_x)
    wide = torch.zeros(table.shape[0], 32)
    wide[:, ::2] = table                                                       # stride 2 along the row
    out = embedding_rmsnorm_cat(ids, wide[:, ::2], w1, hidden, w2, EPS)
    assert torch.equal(out, embedding_rmsnorm_cat_ref(ids, table, w1, hidden, w2, EPS))


def _run_triton(program, graph: str) -> list[torch.Tensor]:
    """Graph `graph` on the Triton kernels (the interpreter) from verify's random inputs: its outputs and every
    buffer (state pools, caches) after the run."""
    from lingc.passes.verify import random_inputs
    from lingc.runtime.executor import Executor
    exe = Executor(program, "cpu", backend="triton")
    for name, value in random_inputs(program, graph).items():
        exe.input(graph, name).copy_(value)
    out = exe.run(graph)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [t for t in outs if isinstance(t, torch.Tensor)] + [exe.buffers.tensors[k]
                                                              for k in sorted(exe.buffers.tensors)]


def test_fused_graphs_are_bit_exact_on_the_kernels(tiny_program_bf16) -> None:
    """decode (embedding_rmsnorm) and mtp_decode (embedding_rmsnorm_cat) in bf16 on the Triton backend: every output
    and buffer equal to the unfused program's."""
    program = tiny_program_bf16.copy()
    program.graphs = {g: program.graphs[g] for g in ("decode", "mtp_decode")}
    before = PassManager(["fuse_cat_norm"]).run(program).program
    from lingc.passes.fuse_embed_norm import FuseEmbedNorm
    after, record = FuseEmbedNorm().run(before)
    assert record.matches == 2
    for graph in ("decode", "mtp_decode"):
        want, got = _run_triton(before, graph), _run_triton(after, graph)
        assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got)), graph
