"""GPU bench of lingc.kernels.filtered_probs at Ling-3.0-tiny's vocabulary: V = 157184, fp32 logits (lm_head
output), B = 1, T = 1 (draft / decode) and T = 6 (verify).

Modes (temperature, top_k, top_p, logits = scale * randn): greedy; plain softmax; top_p 0.9 on peaked logits
(scale 3: most mass on a few hundred tokens, LM-like) and on flat ones (scale 1: the kept set is ~60% of the
vocabulary, the hardest case for the threshold search); top_k 50 + top_p 0.9 (peaked).
Checks per mode (`ok` needs all of them):
  * against the reference op: max_abs_err (<= 1e-4: a boundary token the reference's fp32 cumsum decides
    the other way holds ~1e-5), bit_exact (required for greedy);
  * the kept set against a float64 evaluation of the same filter: `kept_diff` counts tokens decided
    differently where the mass ahead of them is farther than BOUNDARY from top_p (must be 0);
  * the kept values against float64 softmax renormalised over the kernel's own kept set: `value_err` is the
    worst |error| / (1e-6 + 1e-5 * value) (must be <= 1);
  * `row_invariant`: each position of a T = 6 call equals that position alone, bit for bit;
  * `pdl_equal`: pdl=True == pdl=False, bit for bit (reported).
Times (bench/timing.py): the kernel (all its launches; PDL on, and off) and the reference op, each captured
in a CUDA graph over `cold_copies` distinct logits tensors. bytes = logits read once + probs written once
(the HBM floor; the threshold rounds re-read L2-resident logits).

With --coarse each row also prices the coarse distribution a draft could sample from (COARSE: one round a phase,
no exact finish, the crossing bin kept whole; speculative sampling stays exact for any draft distribution):
coarse_time_us, coarse_kept, and coarse_accept = sum(min(p, q)), a drafted token's chance to pass the acceptance
test against the exact p (1 would be drafting from p itself).

    python3 bench/kernel_filtered_probs.py [--sweep] [--coarse]  (JSON lines; --sweep also times a few configs)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_copies, graph_time_us, nbytes  # noqa: E402

VOCAB = 157184
ROWS_T = (1, 6)
BOUNDARY = 1e-5       # |mass ahead - top_p| below which fp32 rounding may decide a token either way
VALUE_TOL = 1e-6      # fp32 softmax: exp of an fp32 argument (|x - M| up to ~30) is good to ~1e-6 relative
VALUE_RTOL = 1e-5
MODES = {             # name: (temperature, top_k, top_p, logit scale)
    "greedy": (0.0, 0, 1.0, 3.0),
    "plain": (0.8, 0, 1.0, 3.0),
    "top_p0.9_peaked": (0.8, 0, 0.9, 3.0),
    "top_p0.9_flat": (1.0, 0, 0.9, 1.0),
    "top_k50_top_p0.9": (0.8, 50, 0.9, 3.0),
}


def _params(mode: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    temp, k, p, scale = MODES[mode]
    return (torch.tensor([temp], device=device), torch.tensor([k], dtype=torch.int64, device=device),
            torch.tensor([p], device=device), scale)


def _f64_check(logits: torch.Tensor, temp: float, k: int, p: float, got: torch.Tensor) -> tuple[int, float, int]:
    """(kept tokens that disagree with float64 away from the top-p boundary, max of |got - f| / (VALUE_TOL +
    VALUE_RTOL * f) with f the float64 probs over the kernel's kept set (<= 1 passes), kept count) over all
    rows of one request."""
    bad, err, kept_total = 0, 0.0, 0
    for x_row, g_row in zip(logits[0], got[0]):
        x = x_row.double() / (temp if temp > 0 else 1.0)
        kept = g_row > 0
        kept_total += int(kept.sum())
        if 0 < k < x.numel() or p < 1:
            xs, order = x.sort(descending=True)
            k_eff = k if 0 < k < x.numel() else x.numel()
            probs = torch.softmax(xs[:k_eff], dim=0)
            before = probs.cumsum(0) - probs
            want_sorted = torch.zeros_like(x, dtype=torch.bool)
            want_sorted[:k_eff] = before < p
            want = torch.zeros_like(want_sorted).scatter_(0, order, want_sorted)
            ahead = torch.full_like(x, 2.0)
            ahead.scatter_(0, order[:k_eff], before)
            bad += int(((kept ^ want) & ((ahead - p).abs() > BOUNDARY)).sum())
        e = torch.exp(x - x[kept].max()) * kept
        f = e / e.sum()
        err = max(err, float(((g_row.double() - f).abs() / (VALUE_TOL + VALUE_RTOL * f)).max()))
    return bad, err, kept_total


def _check(mode: str, t: int, device: torch.device, config=None) -> dict:
    from lingc.kernels.filtered_probs import filtered_probs, filtered_probs_ref

    temp, k, p, scale = _params(mode, device)
    g = torch.Generator(device=device).manual_seed(1000 * t + len(mode))
    logits = torch.randn(1, t, VOCAB, device=device, generator=g) * scale
    got = filtered_probs(logits, temp, k, p, config=config)
    got_pdl = filtered_probs(logits, temp, k, p, pdl=True, config=config)
    want = filtered_probs_ref(logits, temp, k, p)
    alone = [filtered_probs(logits[:, i:i + 1], temp, k, p, config=config) for i in range(t)]
    row_invariant = all(torch.equal(a[0, 0], got[0, i]) for i, a in enumerate(alone))
    torch.cuda.synchronize()
    bad, value_err, kept = _f64_check(logits, MODES[mode][0], MODES[mode][1], MODES[mode][2], got)
    bit_exact = bool(torch.equal(got, want))
    max_abs_err = float((got - want).abs().max())
    ok = (bit_exact if mode == "greedy" else max_abs_err <= 1e-4) and bad == 0 and value_err <= 1.0 and row_invariant
    return {"max_abs_err": max_abs_err, "bit_exact": bit_exact, "pdl_equal": bool(torch.equal(got, got_pdl)),
            "row_invariant": row_invariant,
            "kept": kept, "ref_kept": int((want > 0).sum()), "kept_diff": bad, "value_err": value_err, "ok": ok}


def _time(mode: str, t: int, device: torch.device, config=None) -> dict:
    from lingc.kernels.filtered_probs import filtered_probs, filtered_probs_ref

    temp, k, p, scale = _params(mode, device)
    per_copy = t * VOCAB * 4
    copies = [torch.randn(1, t, VOCAB, device=device) * scale for _ in range(cold_copies(per_copy))]
    kernel = graph_time_us([lambda x=x: filtered_probs(x, temp, k, p, pdl=True, config=config) for x in copies])
    row = {"time_us": kernel}
    if config is None:
        row["time_us_nopdl"] = graph_time_us([lambda x=x: filtered_probs(x, temp, k, p) for x in copies])
        row["ref_time_us"] = graph_time_us([lambda x=x: filtered_probs_ref(x, temp, k, p) for x in copies])
    moved = nbytes(copies[0]) + t * VOCAB * 4
    row.update(bytes=moved, gbps=moved / (kernel * 1e-6) / 1e9)
    del copies
    torch.cuda.empty_cache()
    return row


COARSE = dict(bins_k=(32,), bins_p=(32,), finish=False)   # one round a phase, the crossing bin kept whole


def _coarse(mode: str, t: int, device: torch.device) -> dict:
    """The coarse distribution q (COARSE: what a draft could sample from) against the exact p on the same logits:
    kept tokens, acceptance sum(min(p, q)) per row (a drafted token's chance to pass speculative sampling's test,
    mean over rows; 1 = as good as drafting from p itself), q's mass outside p's support, and q's time."""
    from lingc.kernels.filtered_probs import FilteredProbsConfig, filtered_probs

    cfg = FilteredProbsConfig(**COARSE)
    temp, k, p, scale = _params(mode, device)
    g = torch.Generator(device=device).manual_seed(1000 * t + len(mode))
    logits = torch.randn(1, t, VOCAB, device=device, generator=g) * scale
    q = filtered_probs(logits, temp, k, p, config=cfg)
    want = filtered_probs(logits, temp, k, p)
    row = {"coarse_kept": int((q > 0).sum()),
           "coarse_accept": float(torch.minimum(want, q).sum(-1).mean()),
           "coarse_mass_outside": float(q.masked_fill(want > 0, 0.0).sum(-1).mean())}
    row.update({f"coarse_{key}": v for key, v in _time(mode, t, device, config=cfg).items()})
    return row


def run(device: torch.device, coarse: bool = False):
    """One row per (mode, T): correctness vs the reference and float64, PDL on == off, kernel vs reference time;
    with `coarse`, the COARSE distribution's acceptance against the exact one and its time too."""
    for t in ROWS_T:
        for mode in MODES:
            row = {"kernel": "filtered_probs", "shape": [1, t, VOCAB], "mode": mode, "dtype": "fp32"}
            try:
                row.update(_check(mode, t, device))
                row.update(_time(mode, t, device))
                if coarse:
                    row.update(_coarse(mode, t, device))
            except Exception as exc:  # keep the other rows; the error is the result
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            yield row


def sweep(device: torch.device, only: tuple[str, ...] = ()):
    """Kernel time (PDL on) of a few tunable sets (`only`: these names), T = 1 and 6: greedy (the launch floor),
    peaked and flat top-p (flat: the search's worst case) and top-k 50 + top-p 0.9 (both phases); a row is yielded
    as it is measured."""
    from lingc.kernels.filtered_probs import FilteredProbsConfig

    # each set differs from the default (chunk 1024, top-k bins (32, 256), top-p bins (32, 64, 256) since the 2026-12-06
    # second sweep, bench/results/kernel-filtered-probs-sweep-h100-20261206.json) in the fields it names
    configs = {
        "default": FilteredProbsConfig(),
        "prev": FilteredProbsConfig(chunk=2048, bins_p=(32, 256, 256)),      # the default before that sweep
        "chunk2048": FilteredProbsConfig(chunk=2048),
        "chunk512": FilteredProbsConfig(chunk=512),                          # faster at one row, much slower at six
        "p32_256_256": FilteredProbsConfig(bins_p=(32, 256, 256)),
        "k32_64": FilteredProbsConfig(bins_k=(32, 64)),
        "rounds2+2": FilteredProbsConfig(bins_k=(32, 256), bins_p=(32, 256)),
        "scan512": FilteredProbsConfig(scan_max=512),
        "warps8": FilteredProbsConfig(num_warps=8),
        "cell4096": FilteredProbsConfig(cell=4096),
    }
    for name, cfg in configs.items():
        if only and name not in only:
            continue
        for t in ROWS_T:
            for mode in ("greedy", "top_p0.9_peaked", "top_p0.9_flat", "top_k50_top_p0.9"):
                row = {"kernel": "filtered_probs_sweep", "config": name, "shape": [1, t, VOCAB], "mode": mode}
                try:
                    checked = _check(mode, t, device, config=cfg)
                    row.update(ok=checked["ok"], kept_diff=checked["kept_diff"], pdl_equal=checked["pdl_equal"])
                    row.update(_time(mode, t, device, config=cfg))
                except Exception as exc:
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                yield row


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sweep", action="store_true", help="also time a few tunable sets")
    ap.add_argument("--sweep-configs", default="", help="comma-separated names: only these of the sweep's sets")
    ap.add_argument("--coarse", action="store_true",
                    help="also price the coarse distribution (COARSE: no exact finish, one round a phase)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for r in run(dev, args.coarse):                       # (generators: each row printed as it is measured)
        print(json.dumps(r), flush=True)
    only = tuple(filter(None, args.sweep_configs.split(",")))
    for r in sweep(dev, only) if args.sweep else ():     # a row as it is measured: a timeout keeps the rows before
        print(json.dumps(r), flush=True)
