"""lingc.kernels.mla in the Triton interpreter against the lingc reference ops (MLA attention, cache write, rope, gate).

Small odd MLA shapes (H=2, N=16, Rr=8, R=32, Vd=16, pages of 4 or 5 rows out of order, B=2 with different page
lists and positions, up to ~40 cached tokens). The key property is row invariance: each query of a verify chain
gives exactly the bits of a T=1 decode call at the same position (torch.equal), whatever the batch and the cache
capacity. Every buffer the launchers allocate is NaN-poisoned, so a read of an unwritten element shows. The head gate
folded into mla_attention (fuse_mla) must give the sigmoid_gate kernel's bits; mla_prep: tests/kernels/test_mla_prep.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import lingc.kernels.mla as mla
from lingc.kernels.mla import (mla_attention, mla_attention_ref, mla_cache_write, mla_cache_write_ref, rope,
                               rope_ref, sigmoid_gate, sigmoid_gate_ref)
from kernel_support import poison_float_empty  # noqa: E402  (tests/kernels is on sys.path)

H, N, RR, R, VD = 2, 16, 8, 32, 16
SCALE = (N + RR) ** -0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (rtol, atol) vs the reference, which expands K/V in fp32: the kernel absorbs kv_b and rounds q_lat and the
# probabilities to the cache dtype before its MMAs. Measured max abs error on these inputs (|out| <= ~2):
# fp32 ~5e-7, bf16 ~8e-3 (one bf16 ulp of the largest outputs).
ATTN_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.6e-2)}
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
# the interpreter converts a data-dependent loop bound (a 1-element array) to int with a numpy deprecation
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True)
def _poisoned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float buffer the launchers allocate (outputs, q_lat, split partials) starts as NaN."""
    poison_float_empty(monkeypatch)


def _case(B: int, T: int, dtype: torch.dtype, seed: int, ps: int = 4, mp: int = 11, spare: int = 7,
          ) -> dict[str, torch.Tensor]:
    """Random inputs: each request owns MP distinct pages of a shuffled pool, positions end near its length."""
    g = torch.Generator().manual_seed(seed)
    NP = B * mp + spare
    perm = torch.randperm(NP, generator=g)
    page_rows = perm[:B * mp].view(B, mp).to(torch.int32)                               # [B, MP], out of order
    last = torch.randint(T - 1, mp * ps, (B,), generator=g)                             # last position per request
    positions = last.view(B, 1) - torch.arange(T - 1, -1, -1).view(1, T)               # [B, T] consecutive
    q = torch.randn(B, T, H, N + RR, generator=g).to(dtype)                            # q_nope / q_rope as views
    return {
        "q_nope": q[..., :N], "q_rope": q[..., N:],
        "kv_pages": torch.randn(NP, ps, R + RR, generator=g).to(dtype),
        "kv_b_weight": (torch.randn(H * (N + VD), R, generator=g) * R ** -0.5).to(dtype),
        "page_rows": page_rows, "positions": positions,
    }


def _attend(c: dict[str, torch.Tensor], **tunables) -> torch.Tensor:
    return mla._mla_attention(c["q_nope"], c["q_rope"], c["kv_pages"], c["kv_b_weight"], c["page_rows"],
                              c["positions"], SCALE, **tunables)


def _reference(c: dict[str, torch.Tensor]) -> torch.Tensor:
    return mla_attention_ref(c["q_nope"], c["q_rope"], c["kv_pages"], c["kv_b_weight"], c["page_rows"],
                             c["positions"], SCALE)


def _rows(c: dict[str, torch.Tensor], b: slice, t: slice) -> dict[str, torch.Tensor]:
    """The inputs of requests b and queries t only (same cache)."""
    out = dict(c)
    for k in ("q_nope", "q_rope", "positions"):
        out[k] = c[k][b, t]
    out["page_rows"] = c["page_rows"][b]
    return out


SPLITS = {"split16": {"split_rows": 16, "block_n": 16}, "split32": {"split_rows": 32, "block_n": 16},
          "default": {}}


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("B,T,ps", [(2, 1, 4), (2, 5, 4), (1, 3, 5)], ids=["B2-T1-PS4", "B2-T5-PS4", "B1-T3-PS5"])
@dtypes
def test_attention_matches_reference(B: int, T: int, ps: int, split: dict, dtype: torch.dtype) -> None:
    c = _case(B, T, dtype, seed=B * 100 + T * 10 + ps, ps=ps)
    got, want = _attend(c, **split), _reference(c)
    assert got.shape == want.shape == (B, T, H, VD) and got.dtype == dtype
    assert not got.isnan().any()
    rtol, atol = ATTN_TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@dtypes
def test_attention_packed_tile_matches_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPLIT_TILE_ROWS = 64 (4 queries a split program) on a chain of 5 (a tile with 3 padded slots) and 2
    requests, against the reference."""
    monkeypatch.setattr(mla, "SPLIT_TILE_ROWS", 64)
    c = _case(2, 5, dtype, seed=77)
    rtol, atol = ATTN_TOL[dtype]
    for split in SPLITS.values():
        torch.testing.assert_close(_attend(c, **split), _reference(c), rtol=rtol, atol=atol)


@dtypes
def test_attention_one_big_page_and_short_prefixes(dtype: torch.dtype) -> None:
    """ModelState.new's layout (MP=1, one page of 40 rows) and positions 0, 1 (a single visible row)."""
    c = _case(2, 2, dtype, seed=5, ps=40, mp=1, spare=1)
    c["positions"] = torch.tensor([[0, 1], [17, 39]])
    rtol, atol = ATTN_TOL[dtype]
    torch.testing.assert_close(_attend(c, split_rows=16, block_n=16), _reference(c), rtol=rtol, atol=atol)


@pytest.mark.parametrize("tile", [16, 64], ids=["tile16", "tile64"])
@pytest.mark.parametrize("split", [SPLITS["split16"], SPLITS["default"]], ids=["split16", "default"])
@dtypes
def test_attention_row_invariance(split: dict, dtype: torch.dtype, tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of T=6 queries == the same queries one at a time (T=1) == each request alone; and a larger
    cache capacity (more pages in page_rows, so more splits) changes no bit either. tile: the split's MMA rows
    (SPLIT_TILE_ROWS; 64 packs 4 queries of a chain into one program at H <= 16, a T=1 call fills one slot).
    Request 0's chain straddles a 16-row split boundary (positions 13..18), so at split16 the tile runs steps past
    its first queries' last rows."""
    monkeypatch.setattr(mla, "SPLIT_TILE_ROWS", tile)
    c = _case(2, 6, dtype, seed=42)
    c["positions"][0] = torch.arange(13, 19)
    chain = _attend(c, **split)                                                         # [B, 6, H, Vd]
    for b in range(2):
        alone = _attend(_rows(c, slice(b, b + 1), slice(None)), **split)
        assert torch.equal(alone[0], chain[b]), f"request {b} alone differs from the batch"
        for t in range(6):
            single = _attend(_rows(c, slice(b, b + 1), slice(t, t + 1)), **split)
            assert torch.equal(single[0, 0], chain[b, t]), f"query ({b}, {t}) differs from its T=1 call"
    bigger = dict(c, page_rows=torch.cat([c["page_rows"], c["page_rows"].flip(1)], dim=1))   # MP 11 -> 22
    assert torch.equal(_attend(bigger, **split), chain), "the cache capacity changed a query's bits"


ABSORB_TILES = {"qa": ("QA_TILE",), "va": ("VA_TILE",), "qa+va": ("QA_TILE", "VA_TILE")}


@pytest.mark.parametrize("flags", ABSORB_TILES.values(), ids=ABSORB_TILES.keys())
@dtypes
def test_absorb_tiles_match_reference_and_keep_row_invariance(flags: tuple[str, ...], dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The absorptions' tile forms (QA_TILE / VA_TILE: a program's queries as the rows of one dot; VA_TILE's combine
    stores o_lat in the cache dtype): within the reference's tolerance, with and without the gate, and row invariant,
    including a tile boundary: 3 requests x 6 queries = 18 queries span two 16-row tiles (QA_TILE_M), so queries of
    request 2 sit in the second tile in the batch and in the first alone; each query of a chain equals its T=1 call."""
    for flag in flags:
        monkeypatch.setattr(mla, flag, True)
    c = _case(3, 6, dtype, seed=91)
    rtol, atol = ATTN_TOL[dtype]
    chain = _attend(c)
    assert not chain.isnan().any()
    torch.testing.assert_close(chain, _reference(c), rtol=rtol, atol=atol)
    logits = (4 * torch.randn(3, 6, H, generator=torch.Generator().manual_seed(5))).to(dtype)
    assert torch.equal(_attend(c, gate=logits), sigmoid_gate(chain, logits))
    for b in range(3):
        assert torch.equal(_attend(_rows(c, slice(b, b + 1), slice(None)))[0], chain[b]), f"request {b} alone"
        for t in (0, 5):
            single = _attend(_rows(c, slice(b, b + 1), slice(t, t + 1)))
            assert torch.equal(single[0, 0], chain[b, t]), f"query ({b}, {t}) differs from its T=1 call"


@pytest.mark.parametrize("split", [SPLITS["split16"], SPLITS["default"]], ids=["split16", "default"])
@dtypes
def test_combine_in_one_step_has_the_loops_bits(split: dict, dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """COMBINE_ONE_STEP (every split in one CB_BLOCK_S step, the maximum from the step's own loads) gives the loop's
    bits, for a chain and its single queries, at two capacities; and a capacity past one step (CB_BLOCK_S = 4
    splits) still runs the loop."""
    c = _case(2, 6, dtype, seed=43)
    c["positions"][0] = torch.arange(13, 19)
    bigger = dict(c, page_rows=torch.cat([c["page_rows"], c["page_rows"].flip(1)], dim=1))
    monkeypatch.setattr(mla, "COMBINE_ONE_STEP", 0)
    loop = [_attend(x, **split) for x in (c, bigger, _rows(c, slice(0, 1), slice(2, 3)))]
    monkeypatch.setattr(mla, "COMBINE_ONE_STEP", 16)
    for x, want in zip((c, bigger, _rows(c, slice(0, 1), slice(2, 3))), loop):
        assert torch.equal(_attend(x, **split), want)
    small = _attend(c, split_rows=16, block_n=16, combine_block_s=4)        # S_POW2 > 4: the loop, as before
    monkeypatch.setattr(mla, "COMBINE_ONE_STEP", 0)
    assert torch.equal(small, _attend(c, split_rows=16, block_n=16, combine_block_s=4))


def test_combine_takes_one_step_up_to_its_query_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default (COMBINE_ONE_STEP = 1) a one-query launch (decode, the draft) combines in one step and a verify
    chain's six queries by the loop; the knob moves the limit. The bits are the same either way (test above)."""
    seen = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["ONE_STEP"])
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(mla, "_combine_kernel", Spy(mla._combine_kernel))
    c = _case(1, 6, torch.float32, seed=5)
    assert mla.COMBINE_ONE_STEP == 1
    _attend(c, **SPLITS["default"])
    _attend(_rows(c, slice(0, 1), slice(2, 3)), **SPLITS["default"])
    monkeypatch.setattr(mla, "COMBINE_ONE_STEP", 6)
    _attend(c, **SPLITS["default"])
    assert seen == [False, True, True]


def test_attention_pdl_on_cpu_falls_back() -> None:
    c = _case(1, 2, torch.float32, seed=3)
    assert torch.equal(mla_attention(*_args(c), pdl=True), mla_attention(*_args(c)))


def _args(c: dict[str, torch.Tensor]) -> tuple:
    return (c["q_nope"], c["q_rope"], c["kv_pages"], c["kv_b_weight"], c["page_rows"], c["positions"], SCALE)


def test_attention_bad_inputs_name_the_problem() -> None:
    c = _case(1, 1, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"kv_pages is \[\d+, 4, 39\], want \[NP, PS, 40\]"):
        mla_attention(c["q_nope"], c["q_rope"], c["kv_pages"][..., :39], *_args(c)[3:])
    with pytest.raises(ValueError, match="must share one of"):
        mla_attention(c["q_nope"], c["q_rope"], c["kv_pages"].bfloat16(), *_args(c)[3:])
    with pytest.raises(ValueError, match=r"positions is \[1, 2\], want \[1, 1\]"):
        mla_attention(*_args(c)[:5], c["positions"].repeat(1, 2), SCALE)


@pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (1, 6), (2, 6)], ids=["B1-T1", "B2-T1", "B1-T6", "B2-T6"])
@dtypes
def test_gate_folded_into_attention_equals_the_gate_kernel(B: int, T: int, dtype: torch.dtype) -> None:
    """fuse_mla's gate argument: v_absorb's epilogue gives the bits of the sigmoid_gate kernel after the attention, and
    the reference op with a gate is the sigmoid_gate reference of its output."""
    c = _case(B, T, dtype, seed=7 * B + T)
    logits = (4 * torch.randn(B, T, H, generator=torch.Generator().manual_seed(T))).to(dtype)
    gated = _attend(c, split_rows=16, block_n=16, gate=logits)
    assert not gated.isnan().any()
    assert torch.equal(gated, sigmoid_gate(_attend(c, split_rows=16, block_n=16), logits))
    assert torch.equal(mla_attention_ref(*_args(c), logits), sigmoid_gate_ref(_reference(c), logits))
    with pytest.raises(ValueError, match=rf"mla_attention: gate is \[{B}, {T}, {H - 1}\]"):
        mla_attention(*_args(c), logits[..., :H - 1])


@pytest.mark.parametrize("latent_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cache_write_matches_reference(latent_dtype: torch.dtype) -> None:
    """Scatter of B*T rows (fp32 rows are rounded into a bf16 cache like the reference's .to)."""
    g = torch.Generator().manual_seed(9)
    kv = torch.randn(6, 4, R + RR, generator=g).bfloat16()
    latent = torch.randn(2, 3, R + RR, generator=g).to(latent_dtype)
    locs = torch.randperm(24, generator=g)[:6].view(2, 3)
    got, want = kv.clone(), kv.clone()
    mla_cache_write(got, latent, locs)
    mla_cache_write_ref(want, latent, locs)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="cache_locs is"):
        mla_cache_write(got, latent, locs[:, :2])


@dtypes
def test_rope_matches_reference(dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    """q-style input (a strided view of q, several heads) and k-style (one vector), positions up to ~8000."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 5, N + 64, generator=g).to(dtype)[..., N:]                 # [B, T, n=5, Rr=64] view
    positions = torch.tensor([[0, 1, 2], [8189, 8190, 8191]])
    got, want = rope(q, positions, 6e6), rope_ref(q, positions, 6e6)
    # fp32: cos/sin of one fp32 angle from numpy vs torch's libm; bf16: at most a rounding flip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5) if dtype == torch.float32 \
        else assert_kernel_close(got, want)
    k = torch.randn(2, 3, 1, RR, generator=g).to(dtype)
    assert_kernel_close(rope(k, positions, 1e4), rope_ref(k, positions, 1e4)) if dtype != torch.float32 \
        else torch.testing.assert_close(rope(k, positions, 1e4), rope_ref(k, positions, 1e4), rtol=1e-5, atol=1e-5)
    assert torch.equal(rope(q[:, 1:2], positions[:, 1:2], 6e6), got[:, 1:2]), "rope is not row invariant"


@dtypes
def test_sigmoid_gate_matches_reference(dtype: torch.dtype, assert_kernel_close: Callable) -> None:
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 3, 5, 24, generator=g).to(dtype)
    logits = (4 * torch.randn(2, 3, 5, generator=g)).to(dtype)
    assert_kernel_close(sigmoid_gate(x, logits), sigmoid_gate_ref(x, logits))
    with pytest.raises(ValueError, match="gate_logits"):
        sigmoid_gate(x, logits[..., :4])


@dtypes
def test_program_tiling_knobs_keep_the_results(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch tilings bench/device_boundary_ab.sh sweeps: CB_BLOCK_R (latent columns a combine program) does not
    enter the arithmetic, so fewer columns a program give the same bits; VA_BLOCK_V / QA_BLOCK_R (rows or columns an
    absorb program) may reduce in another layout on a GPU, so they are held to the reference's tolerance."""
    c = _case(2, 3, dtype, seed=31)
    base = _attend(c)
    monkeypatch.setattr(mla, "CB_BLOCK_R", R // 2)
    assert torch.equal(_attend(c), base)
    monkeypatch.setattr(mla, "VA_BLOCK_V", VD // 2)
    monkeypatch.setattr(mla, "QA_BLOCK_R", R // 2)
    got = _attend(c)
    assert not got.isnan().any()
    rtol, atol = ATTN_TOL[dtype]
    torch.testing.assert_close(got, _reference(c), rtol=rtol, atol=atol)
