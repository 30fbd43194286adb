"""GPU check and timing of the metadata / relay kernels (lingc.kernels.meta), `uniform` (kernels/sample.py) and the
one-launch KDA ops kda_conv_qkv / kda_commit_multi (kernels/kda.py) at the shapes Ling-3.0-tiny's step uses.

Shapes (lingc/steps.py, lingc/trace.py; B = 1 request in slot 1 of S = 2, V = 157184, h = 1536, an 8192-token
context: max_len 9344 in pages of 16, MP = 584 page-table entries, K + 1 = 6 verify positions):
    gather_rows    relay reads: int64 [S] (seq_len, root), fp32 [S, V] (draft_first_probs), bf16 [S, h]
                   (mtp_hidden), int32 [S, MP] (a page-table row)
    scatter_rows   relay writes: int64 [S] <- int64 [1], fp32 [S, V] <- [1, V], bf16 [S, h] <- [1, h]
    step_positions seq_len int64 [1], T in {1, 6};  paged_refill page_table [S, MP], positions [1, T], T in {1, 6}
    step_refill    the two at once (seq_len, page table), against step_positions + paged_refill (ref_time_us)
    pick_position  tokens int64 [1, 6], logits fp32 [1, 6, V], mtp hidden bf16 [1, 6, h]; index = accept_len - 1
    uniform        seed / counter int64 [1], n in {1, 6}
    kda_conv_qkv   q/k/v bf16 [1, 1, P] (column views of one fused projection), P = 16 heads x 128, W = 4
    kda_commit_multi  3 conv windows bf16 [S, P, 3] + the fp32 state [S, 16, 128, 128] from staging [1, 6, ...]
    kda_commit_multi[72]  the same for all 18 KDA layers in one launch, against launches of 8 pairs (ref_time_us)
Checks per row: the kernel against its torch reference op bit for bit (`bit_exact`; kda_conv_qkv: against three
kda_conv launches bit for bit, `kernels_equal`, and the reference op within bf16 rounding), PDL on == off bit for
bit (`pdl_equal`), and CUDA-graph replay medians of the kernel (PDL off and on) and of the reference op over
`cold_copies` distinct input copies (bench/timing.py). In-place ops (scatter_rows, the KDA ops) get fresh copies
of their buffers for every comparison.

On the CPU (`--device cpu`, or anywhere TRITON_INTERPRET=1 is set) the same checks run in the Triton interpreter
at tiny shapes, untimed: a smoke test of this script (a few seconds).
    python3 bench/kernel_meta.py [--device cpu|cuda]          # JSON lines
    python3 bench/device_kernels.py --families meta,router --json $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_copies, graph_time_or_none, kernel_row, nbytes  # noqa: E402

BF16_TOL = dict(rtol=2.0**-7, atol=1e-2)      # tests/kernels/conftest.py's bf16 tolerance


@dataclass(frozen=True)
class Shapes:
    slots: int          # S relay / pool slots (the request sits in the last one)
    vocab: int          # V
    hidden: int         # h
    pages: int          # MP page-table entries per slot
    page_size: int      # PS
    chain: int          # K + 1 verify positions
    kda_heads: int      # H
    kda_dim: int        # D (P = H * D)
    conv_width: int     # W
    kda_layers: int     # KDA layers: kda_commit_multi[layers] commits all their pairs


TINY_STEP = Shapes(slots=2, vocab=157184, hidden=1536, pages=584, page_size=16, chain=6, kda_heads=16, kda_dim=128,
                   conv_width=4, kda_layers=18)
CPU_SMOKE = Shapes(slots=3, vocab=50, hidden=24, pages=7, page_size=4, chain=6, kda_heads=2, kda_dim=8, conv_width=4,
                   kda_layers=5)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return all(_equal(x, y) for x, y in zip(a, b))


def _max_err(a, b) -> float:
    pairs = [(a, b)] if isinstance(a, torch.Tensor) else list(zip(a, b))
    return max(((x.double() - y.double()).abs().max().item() if x.numel() else 0.0) for x, y in pairs)


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else [t.clone() for t in a] if isinstance(a, list) else a
                 for a in args)


def _timed(fn: Callable, copies: list[tuple], timed: bool) -> float | None:
    """Median graph-replay time of fn over the input copies (None untimed or not capturable)."""
    return graph_time_or_none([lambda c=c: fn(*c) for c in copies]) if timed else None


def _row(name: str, shape: str, kernel: Callable, ref: Callable, make: Callable[[], tuple], timed: bool, moved: int,
         out: Callable[[tuple, object], object] = lambda args, result: result, **extra) -> dict:
    """Check kernel(*args) against ref(*args) bit for bit (fresh copies of the inputs each), PDL on == off, and time
    both. `out` picks what to compare from (the call's inputs, its result): in-place ops compare their buffers.
    `moved`: the bytes the op must read and write (the rows it touches, not whole relay buffers)."""
    args = make()
    a1, a2, a3 = _clone(args), _clone(args), _clone(args)
    got, want, got_pdl = out(a1, kernel(*a1)), out(a2, ref(*a2)), out(a3, kernel(*a3, pdl=True))
    exact = _equal(got, want)
    per_copy = nbytes(*[a for a in args if isinstance(a, torch.Tensor)])
    copies = [args] + [make() for _ in range(cold_copies(per_copy) - 1)] if timed else []
    return kernel_row(name, shape, exact, _max_err(got, want), exact, _equal(got, got_pdl),
                      _timed(kernel, copies, timed), _timed(ref, copies, timed),
                      moved, pdl_time_us=_timed(lambda *a: kernel(*a, pdl=True), copies, timed), **extra)


def _meta_rows(sh: Shapes, dev: torch.device, g: torch.Generator, timed: bool) -> list[dict]:
    from lingc.kernels import meta
    from lingc.kernels.sample import uniform

    ops = torch.ops.lingc
    S, V, h, MP, T = sh.slots, sh.vocab, sh.hidden, sh.pages, sh.chain
    slots = torch.tensor([S - 1], dtype=torch.int32, device=dev)

    def rand(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn(shape, device=dev, generator=g).to(dtype)
        return torch.randint(0, 1 << 20, shape, device=dev, generator=g, dtype=dtype)

    def row_bytes(shape: tuple, dtype: torch.dtype) -> int:
        return torch.empty(shape[1:], dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()

    rows = []
    relays = {"int64 [S]": ((S,), torch.int64), "fp32 [S, V]": ((S, V), torch.float32),
              "bf16 [S, h]": ((S, h), torch.bfloat16), "int32 [S, MP]": ((S, MP), torch.int32)}
    for label, (shape, dtype) in relays.items():
        rows.append(_row("gather_rows", f"{label} {list(shape)}", meta.gather_rows, ops.gather_rows,
                         lambda: (rand(shape, dtype), slots), timed, 2 * row_bytes(shape, dtype) + 4))
    for label, (shape, dtype) in list(relays.items())[:3]:
        rows.append(_row("scatter_rows", f"{label} {list(shape)}", meta.scatter_rows, ops.scatter_rows,
                         lambda: (rand(shape, dtype), slots, rand((1, *shape[1:]), dtype)), timed,
                         2 * row_bytes(shape, dtype) + 4, out=lambda args, _: args[0]))
    for t in (1, T):
        seq = lambda: (torch.randint(0, 8192, (1,), device=dev, generator=g),)  # noqa: E731
        rows.append(_row("step_positions", f"B=1 T={t}", lambda s, pdl=False: meta.step_positions(s, t, pdl=pdl),
                         lambda s: ops.step_positions(s, t), seq, timed, 8 + 8 * t))
        refill = lambda: (rand((S, MP), torch.int32), slots,  # noqa: E731
                          torch.randint(0, MP * sh.page_size, (1, t), device=dev, generator=g))
        rows.append(_row("paged_refill", f"page_table [{S}, {MP}] T={t} PS={sh.page_size}",
                         lambda pt, sl, pos, pdl=False: meta.paged_refill(pt, sl, pos, sh.page_size, pdl=pdl),
                         lambda pt, sl, pos: ops.paged_refill(pt, sl, pos, sh.page_size), refill, timed,
                         2 * MP * 4 + 16 * t + 4))
        def step() -> tuple:                                # seq_len, a page table, the slots
            return torch.randint(0, 8192, (1,), device=dev, generator=g), rand((S, MP), torch.int32), slots

        def separate(s_, pt, sl, pdl=False):               # what step_refill replaces: its two launches
            pos = meta.step_positions(s_, t, pdl=pdl)
            return (pos, *meta.paged_refill(pt, sl, pos, sh.page_size, pdl=pdl))
        rows.append(_row("step_refill", f"page_table [{S}, {MP}] T={t} PS={sh.page_size}",
                         lambda s_, pt, sl, pdl=False: meta.step_refill(s_, t, pt, sl, sh.page_size, pdl=pdl),
                         separate, step, timed, 2 * MP * 4 + 24 * t + 12))
    index = lambda: torch.randint(0, T, (1,), device=dev, generator=g)  # noqa: E731
    for label, shape, dtype in (("tokens", (1, T), torch.int64), ("logits", (1, T, V), torch.float32),
                                ("mtp_hidden", (1, T, h), torch.bfloat16)):
        rows.append(_row("pick_position", f"{label} {list(shape)} {str(dtype)[6:]}", meta.pick_position,
                         ops.pick_position, lambda: (rand(shape, dtype), index()), timed,
                         2 * row_bytes(shape[1:], dtype) + 8))
    for n in (1, T):
        rng = lambda: (torch.randint(-2**62, 2**62, (1,), device=dev, generator=g),  # noqa: E731
                       torch.randint(0, 2**40, (1,), device=dev, generator=g))
        rows.append(_row("uniform", f"B=1 n={n}", lambda s, c, pdl=False: uniform(s, c, n, pdl=pdl),
                         lambda s, c: ops.uniform(s, c, n), rng, timed, 16 + 4 * n))
    return rows


def _kda_rows(sh: Shapes, dev: torch.device, g: torch.Generator, timed: bool) -> list[dict]:
    from lingc.kernels import kda

    S, P, W, H, D, TS = sh.slots, sh.kda_heads * sh.kda_dim, sh.conv_width, sh.kda_heads, sh.kda_dim, sh.chain
    slots = torch.tensor([S - 1], dtype=torch.int32, device=dev)

    def conv_inputs() -> tuple:
        fused = torch.randn(1, 1, 3 * P + 64, device=dev, generator=g).to(torch.bfloat16)   # one fused projection
        xs = fused[..., :3 * P].split(P, dim=-1)
        ws = [0.5 * torch.randn(P, 1, W, device=dev, generator=g) for _ in range(3)]
        pools = [torch.randn(S, P, W - 1, device=dev, generator=g).to(torch.bfloat16) for _ in range(3)]
        return (*xs, *ws, *pools, slots)

    def conv_out(args: tuple, result: tuple) -> tuple:
        return (*result, *args[6:9])                                      # outputs and the updated windows

    args = conv_inputs()
    a1, a2 = _clone(args), _clone(args)
    fused_out = conv_out(a1, kda.kda_conv_qkv(*a1))
    separate = tuple(kda.kda_conv(a2[i], a2[3 + i], a2[6 + i], slots) for i in range(3))
    kernels_equal = _equal(fused_out, (*separate, *a2[6:9]))
    moved = 3 * (2 * P * 2 + P * W * 4 + 2 * P * (W - 1) * 2)          # x, y, weights, the window read + written
    row = _row("kda_conv_qkv", f"B=1 T=1 P={P} W={W} bf16", kda.kda_conv_qkv, kda.kda_conv_qkv_ref, conv_inputs,
               timed, moved, out=conv_out, kernels_equal=kernels_equal)
    a3 = _clone(args)
    ref_out = conv_out(a3, kda.kda_conv_qkv_ref(*a3))
    close = all(torch.allclose(x.float(), y.float(), **BF16_TOL) for x, y in zip(fused_out, ref_out))
    row["ok"] = bool(kernels_equal and close and row["pdl_equal"])
    rows = [row]

    shapes = [((P, W - 1), torch.bfloat16)] * 3 + [((H, D, D), torch.float32)]

    def commit_inputs() -> tuple:
        accept = torch.randint(1, TS + 1, (1,), device=dev, generator=g)
        pools, stagings = [], []
        for shape, dtype in shapes:
            pools.append(torch.randn(S, *shape, device=dev, generator=g).to(dtype))
            stagings.append(torch.randn(1, TS, *shape, device=dev, generator=g).to(dtype))
        return (slots, accept, pools, stagings)

    args = commit_inputs()
    a1, a2 = _clone(args), _clone(args)
    kda.kda_commit_multi(*a1)
    for pool, staging in zip(a2[2], a2[3]):
        kda.kda_commit(pool, a2[0], staging, a2[1])
    rows.append(_row("kda_commit_multi", f"B=1 TS={TS} 3 x bf16 [{S}, {P}, {W - 1}] + fp32 [{S}, {H}, {D}, {D}]",
                     kda.kda_commit_multi, kda.kda_commit_multi_ref, commit_inputs, timed,
                     2 * (3 * P * (W - 1) * 2 + H * D * D * 4), out=lambda a, _: a[2],
                     kernels_equal=_equal(a1[2], a2[2])))
    rows[-1]["ok"] = bool(rows[-1]["ok"] and rows[-1]["kernels_equal"])

    # every KDA layer's commits in one launch (FuseKda.commit_pairs = 4 x layers) against launches of 8 pairs (the
    # default, two layers a launch): `time_us` is the one launch, `ref_time_us` the 8-pair launches
    from lingc.ops.kda import COMMIT_MULTI_PAIRS
    layer_shapes = shapes * sh.kda_layers
    assert len(layer_shapes) <= COMMIT_MULTI_PAIRS

    def layers_inputs() -> tuple:
        accept = torch.randint(1, TS + 1, (1,), device=dev, generator=g)
        pools = [torch.randn(S, *shape, device=dev, generator=g).to(dt) for shape, dt in layer_shapes]
        stagings = [torch.randn(1, TS, *shape, device=dev, generator=g).to(dt) for shape, dt in layer_shapes]
        return (slots, accept, pools, stagings)

    def by_eight(slots_, accept_, pools, stagings, pdl=False):
        for i in range(0, len(pools), 8):
            kda.kda_commit_multi(slots_, accept_, pools[i:i + 8], stagings[i:i + 8], pdl=pdl)

    args = layers_inputs()
    a1, a2 = _clone(args), _clone(args)
    kda.kda_commit_multi(*a1)
    by_eight(*a2)
    rows.append(_row(f"kda_commit_multi[{len(layer_shapes)}]",
                     f"B=1 TS={TS} {sh.kda_layers} layers x (3 x bf16 [{S}, {P}, {W - 1}] + fp32 [{S}, {H}, {D}, {D}])",
                     kda.kda_commit_multi, by_eight, layers_inputs, timed,
                     2 * sh.kda_layers * (3 * P * (W - 1) * 2 + H * D * D * 4), out=lambda a, _: a[2],
                     kernels_equal=_equal(a1[2], a2[2])))
    rows[-1]["ok"] = bool(rows[-1]["ok"] and rows[-1]["kernels_equal"])
    return rows


def run(device: torch.device) -> list[dict]:
    """Rows for every kernel: Ling-3.0-tiny shapes and graph-replay times on CUDA, tiny untimed shapes on the CPU."""
    import lingc  # noqa: F401  (registers the reference ops)
    timed = device.type == "cuda"
    if timed:
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kernel_meta on the CPU needs TRITON_INTERPRET=1 before the kernels are imported "
                           "(python3 bench/kernel_meta.py --device cpu sets it)")
    shapes = TINY_STEP if timed else CPU_SMOKE
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for part in (_meta_rows, _kda_rows):
        try:
            rows += part(shapes, device, g, timed)
        except Exception as exc:  # noqa: BLE001  (keep the other part's rows; the error is the result)
            rows.append({"kernel": part.__name__, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="default: cuda if available and TRITON_INTERPRET is not set, else cpu")
    cli = ap.parse_args()
    use_cpu = cli.device == "cpu" or (cli.device is None and (os.environ.get("TRITON_INTERPRET") == "1"
                                                              or not torch.cuda.is_available()))
    if use_cpu:
        os.environ["TRITON_INTERPRET"] = "1"        # before any lingc.kernels import (triton.jit reads it then)
    results = run(torch.device("cpu" if use_cpu else "cuda"))
    for r in results:
        print(json.dumps(r), flush=True)
    sys.exit(0 if all(r.get("ok") for r in results) else 1)
