"""fuse_mla's kernels in the Triton interpreter: mla_prep against the kernels it replaces and the reference ops.

mla_prep (rope of q_pe, [rmsnorm(c_kv) | rope(k_pe)] into each token's cache row) must give the bits of the rope,
rmsnorm, cat and mla_cache_write launches it replaces, on fresh random inputs (q_pe and c_kv / k_pe as strided views
of their projections, as in the graphs), B in {1, 2}, T in {1, 6}, a shuffled paged cache; its q_rope output is
NaN-poisoned, and every cache row but the written ones must keep its bits. Then the reference op is the composition of
the reference ops, bad inputs name the argument, and a test-tiny decode graph after fuse_mla runs on the kernels with
the unfused graph's bits. (The gate folded into mla_attention: tests/kernels/test_mla.py.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import lingc.kernels.mla as mla
from lingc.kernels.mla import mla_cache_write, mla_prep, mla_prep_ref, rope
from lingc.kernels.rmsnorm import rmsnorm
from kernel_support import poison_float_empty  # noqa: E402  (tests/kernels is on sys.path)

H, RR, R, N = 3, 8, 40, 16               # odd head count and latent width (R is padded to a 64 block)
PS, MP = 4, 5                            # pages of 4 rows, 5 pages per request
EPS, THETA = 1e-6, 6e6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
shapes = pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (1, 6), (2, 6)], ids=["B1-T1", "B2-T1", "B1-T6", "B2-T6"])


@pytest.fixture(autouse=True)
def _poisoned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float buffer the mla launchers allocate (mla_prep's q_rope) starts as NaN."""
    poison_float_empty(monkeypatch)


def _case(B: int, T: int, dtype: torch.dtype, seed: int) -> dict:
    """q_pe a view of [B, T, H, N + Rr] rows; c_kv, k_pe views of one kv_a row [B, T, 3 + R + Rr] (an odd offset, as
    after fuse_projections); each request's tokens at consecutive positions of its own shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, N + RR, generator=g).to(dtype)
    kv_a = (3 * torch.randn(B, T, 3 + R + RR, generator=g)).to(dtype)
    page_rows = torch.randperm(B * MP + 3, generator=g)[:B * MP].view(B, MP)               # [B, MP]
    positions = torch.randint(0, MP * PS - T + 1, (B, 1), generator=g) + torch.arange(T)   # [B, T]
    locs = page_rows.gather(1, positions // PS) * PS + positions % PS                      # flat cache rows
    return {"q_pe": q[..., N:], "c_kv": kv_a[..., 3:3 + R], "k_pe": kv_a[..., 3 + R:],
            "weight": (1 + 0.1 * torch.randn(R, generator=g)).to(dtype),
            "kv_pages": torch.randn(B * MP + 3, PS, R + RR, generator=g).to(dtype), "cache_locs": locs,
            "positions": positions}


def _args(c: dict, kv_pages: torch.Tensor) -> tuple:
    return (c["q_pe"], c["c_kv"], c["k_pe"], c["weight"], kv_pages, c["cache_locs"], c["positions"], THETA, EPS)


def _unfused_kernels(c: dict, kv_pages: torch.Tensor) -> torch.Tensor:
    """The launches fuse_mla replaces, as the graph runs them: q rope, k rope, norm, cat, cache write."""
    q_rope = rope(c["q_pe"], c["positions"], THETA)
    k_rope = rope(c["k_pe"].unsqueeze(2), c["positions"], THETA).squeeze(2)
    mla_cache_write(kv_pages, torch.cat([rmsnorm(c["c_kv"], c["weight"], EPS), k_rope], dim=-1), c["cache_locs"])
    return q_rope


@shapes
@dtypes
def test_prep_equals_the_kernels_it_replaces(B: int, T: int, dtype: torch.dtype) -> None:
    c = _case(B, T, dtype, seed=10 * B + T)
    got_kv, want_kv = c["kv_pages"].clone(), c["kv_pages"].clone()
    got = mla_prep(*_args(c, got_kv))
    want = _unfused_kernels(c, want_kv)
    assert got.shape == (B, T, H, RR) and got.dtype == dtype and not got.isnan().any()
    assert torch.equal(got, want), "q_rope differs from the rope kernel's"
    assert torch.equal(got_kv, want_kv), "the cache differs from rmsnorm + rope + cat + mla_cache_write's"
    written = torch.zeros(got_kv.shape[0] * PS, dtype=torch.bool)
    written[c["cache_locs"].reshape(-1)] = True
    assert torch.equal(got_kv.view(-1, R + RR)[~written], c["kv_pages"].view(-1, R + RR)[~written])


@shapes
@dtypes
def test_prep_matches_the_reference(B: int, T: int, dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    """Against the reference composition: within the rope and rmsnorm kernel tests' tolerance (cos / sin from numpy
    vs torch's libm may differ by an fp32 ulp, so a bf16 rounding may flip)."""
    c = _case(B, T, dtype, seed=20 * B + T)
    got_kv, want_kv = c["kv_pages"].clone(), c["kv_pages"].clone()
    got, want = mla_prep(*_args(c, got_kv)), mla_prep_ref(*_args(c, want_kv))
    close = assert_kernel_close if dtype == torch.bfloat16 else \
        (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5))
    close(got, want)
    close(got_kv, want_kv)


def test_reference_op_is_the_composition() -> None:
    ops = torch.ops.lingc
    c = _case(2, 6, torch.bfloat16, seed=3)
    got_kv, want_kv = c["kv_pages"].clone(), c["kv_pages"].clone()
    got = ops.mla_prep(*_args(c, got_kv))
    want = ops.rope(c["q_pe"], c["positions"], THETA)
    k_rope = ops.rope(c["k_pe"].unsqueeze(2), c["positions"], THETA).squeeze(2)
    ops.mla_cache_write(want_kv, torch.cat([ops.rmsnorm(c["c_kv"], c["weight"], EPS), k_rope], -1), c["cache_locs"])
    assert torch.equal(got, want) and torch.equal(got_kv, want_kv)


def test_pdl_on_cpu_falls_back() -> None:
    c = _case(1, 2, torch.float32, seed=4)
    a, b = c["kv_pages"].clone(), c["kv_pages"].clone()
    assert torch.equal(mla_prep(*_args(c, a), pdl=True), mla_prep(*_args(c, b))) and torch.equal(a, b)


def test_bad_inputs_name_the_argument() -> None:
    c = _case(1, 2, torch.float32, seed=5)
    kv = c["kv_pages"]
    bad = {"k_pe": dict(c, k_pe=c["k_pe"][..., :4]), "c_kv": dict(c, c_kv=c["c_kv"][:, :1]),
           "kv_norm_weight": dict(c, weight=c["weight"][:7]), "cache_locs": dict(c, cache_locs=c["cache_locs"][:, :1]),
           "positions": dict(c, positions=c["positions"].float())}
    for name, case in bad.items():
        with pytest.raises(ValueError, match=f"mla_prep: {name} is"):
            mla_prep(*_args(case, kv))
    with pytest.raises(ValueError, match=r"mla_prep: kv_pages is \[\d+, 4, 47\], want contiguous \[NP, PS, 48\]"):
        mla_prep(*_args(c, kv[..., :47]))
    with pytest.raises(ValueError, match="mla_prep: q_pe must be"):
        mla_prep(*_args(dict(c, q_pe=c["q_pe"][..., :7]), kv))


def test_fused_decode_graph_on_kernels_is_bit_exact(tiny_model_bf16, tiny_options,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """test-tiny's decode graph after every pass of `all` but pdl (a no-op on CPU), without and with fuse_mla, on the
    Triton backend: the same logits and caches, bit for bit, over two steps at shuffled pages (the launchers get their
    arguments, views of the fused projections included, as the graph passes them)."""
    import lingc
    import lingc.kernels.linear as linear
    # one `dot` config for every linear, as tests/kernels/test_lowering.py does: the table's `fma` tiles cost the
    # interpreter ~10x the time
    config = linear.LinearConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=1)
    monkeypatch.setattr(linear, "pick_config", lambda n, k, dtype: config)
    from lingc.passes import PASSES
    from lingc.passes.fuse_mla import FuseMla
    from lingc.passes.manager import PassManager
    from lingc.runtime.executor import Executor
    others = [n for n, p in PASSES.items() if p.in_all and n not in ("fuse_mla", "pdl")]
    plain = PassManager(others).run(lingc.trace(tiny_model_bf16, ["decode"], tiny_options)).program
    fused, record = FuseMla().run(plain)
    assert record.matches == 6                                  # 3 MLA layers: prep and gate each
    runs = {}
    for name, program in (("plain", plain), ("fused", fused)):
        exe = Executor(program, "cpu", backend="triton")
        pages = exe.buffers.tensors["page_table"]
        pages.copy_(torch.randperm(pages.numel(), generator=torch.Generator().manual_seed(0)).view(pages.shape))
        logits = []
        for pos, token in enumerate([5, 300]):
            exe.input("decode", "input_ids").fill_(token)
            exe.input("decode", "positions").fill_(pos + 17)
            logits.append(exe.run("decode")[0].clone())
        runs[name] = (logits, {k: v.clone() for k, v in exe.buffers.tensors.items() if k.endswith("kv_pages")})
    assert all(torch.equal(a, b) for a, b in zip(runs["plain"][0], runs["fused"][0]))
    assert len(runs["fused"][1]) == 3 and runs["plain"][1].keys() == runs["fused"][1].keys()
    assert all(torch.equal(runs["plain"][1][k], runs["fused"][1][k]) for k in runs["plain"][1])
