"""Where a kernel's time goes on the H200, from Nsight Compute's counters: one lingc kernel family at Ling-3.0-tiny's
step shapes, launched eagerly (PDL off: ncu serialises launches anyway) on cold weight copies, a few times, between
cudaProfilerStart / Stop so that ncu sees only the timed launches and not the Triton compiles.

    ncu --clock-control none --profile-from-start off --csv --page details \
        --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
        python3 bench/device_ncu.py mla6

Targets: mla1 / mla6 (mla_attention's four kernels at 1 and 6 queries, 8192 rows), kda1 / kda6 (kda_fused_decode,
kda_fused_verify), moe1 (moe_up_act aligned at one token), moe6 (moe_up_act_pairs at 6 tokens), o_proj1 / qkv1 (the
skinny GEMM at one row: 2048 -> 1536 and 1536 -> 10256), and filtered_probs at V = 157184 in
bench/kernel_filtered_probs.py's modes: fp_peaked1 (top-p 0.9, peaked logits), fp_flat1 / fp_flat6 (top-p 0.9, flat,
1 and 6 rows), fp_k50p1 (top-k 50 + top-p 0.9). A filtered_probs call is 7 launches of 3 kernels (stats, 5 threshold
rounds, write), so for the fp_* targets `summarise` keeps every launch of the last call, in order ("0:_stats_kernel",
"1:_round_kernel", ...): which round takes the time. `bench/device_ncu.sh` runs them all and writes one CSV per
target; `summarise` turns the CSVs into one JSON table (duration, throughputs, the top warp stalls per kernel).
Not a speed measurement (ncu replays each kernel with its caches flushed and its clocks left alone): a map of
stalls, for choosing what to change.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPEATS = 3
TARGETS = ("mla1", "mla6", "kda1", "kda6", "moe1", "moe6", "o_proj1", "qkv1", "fp_peaked1", "fp_flat1", "fp_flat6",
           "fp_k50p1")
FP_MODES = {"fp_peaked1": ("top_p0.9_peaked", 1), "fp_flat1": ("top_p0.9_flat", 1), "fp_flat6": ("top_p0.9_flat", 6),
            "fp_k50p1": ("top_k50_top_p0.9", 1)}
FP_LAUNCHES = 7                    # a filtered_probs call: stats, 5 rounds (the default bins), write


def _mla(T: int) -> list:
    import kernel_mla as KM
    from lingc.kernels.mla import mla_attention
    c = KM._case(T, KM.CAPACITY, 4, seed=T)
    return [lambda k=k, w=w: mla_attention(c["q_nope"], c["q_rope"], k, w, c["page_rows"], c["positions"], KM.SCALE)
            for k, w in zip(c["kv"], c["w"])]


def _kda(T: int) -> list:
    import torch
    import kernel_kda as KK
    from lingc.kernels import kda as K
    g = torch.Generator(device="cuda").manual_seed(T)
    x = KK.Fused(T, 4, torch.device("cuda"), g)
    if T == 1:
        return [lambda i=i: K.kda_fused_decode(*x.raw, x.f, x.b, *x.ws, *x.cpools[i], x.A_log, x.dt_bias, x.state[i],
                                               x.slots, KK.LOWER_BOUND) for i in range(4)]
    return [lambda i=i: K.kda_fused_verify(*x.args(i), *x.stg[i], KK.LOWER_BOUND) for i in range(4)]


def _moe(T: int) -> list:
    import torch
    import kernel_moe as KM
    from lingc.kernels.moe import moe_up_act, moe_up_act_pairs
    g = torch.Generator(device="cuda").manual_seed(T)
    dev = torch.device("cuda")
    p = KM.Problem(T, dev, g, KM._stacks(dev, g))
    if T == 1:
        return [lambda c=c: moe_up_act(p.x[c], p.w13i[c % KM.COPIES], *p.align[c], KM.TOP_K, KM.BLOCK_M, 0.0)
                for c in range(4)]
    return [lambda c=c: moe_up_act_pairs(p.x[c], p.w13i[c % KM.COPIES], p.ids[c], 0.0) for c in range(4)]


def _linear(K: int, N: int) -> list:
    import torch
    from lingc.kernels.linear import linear
    ws = [torch.randn(N, K, device="cuda").mul(0.02).to(torch.bfloat16) for _ in range(8)]
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    return [lambda w=w: linear(x, w) for w in ws]


def _filtered(mode: str, T: int) -> list:
    import torch
    import kernel_filtered_probs as KF
    from lingc.kernels.filtered_probs import filtered_probs
    dev = torch.device("cuda")
    temp, k, p, scale = KF._params(mode, dev)
    g = torch.Generator(device=dev).manual_seed(T)
    xs = [torch.randn(1, T, KF.VOCAB, device=dev, generator=g) * scale for _ in range(4)]
    return [lambda x=x: filtered_probs(x, temp, k, p) for x in xs]


def calls(target: str) -> list:
    if target not in TARGETS:
        raise SystemExit(f"device_ncu: unknown target {target!r}; choose from {', '.join(TARGETS)}")
    if target.startswith("mla"):
        return _mla(int(target[3:]))
    if target.startswith("kda"):
        return _kda(int(target[3:]))
    if target.startswith("moe"):
        return _moe(int(target[3:]))
    if target in FP_MODES:
        return _filtered(*FP_MODES[target])
    return _linear(2048, 1536) if target == "o_proj1" else _linear(1536, 10256)


def main(target: str) -> None:
    import torch
    fns = calls(target)
    for f in fns:                      # compile and warm up outside the profiled range
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for i in range(REPEATS):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


KEEP = ("Duration", "Memory Throughput", "DRAM Throughput", "L2 Cache Throughput", "Compute (SM) Throughput",
        "Registers Per Thread", "Achieved Occupancy", "Grid Size", "Block Size", "Warp Cycles Per Issued Instruction",
        "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block")


SASS_TOP = 12       # instructions listed a SASS profile, by stall samples
SASS_WINDOW = 100   # instructions a bucket of the profile's sample histogram


def sass_summary(path: Path) -> dict:
    """One `ncu --page source --csv --print-source sass` dump (device_ncu.sh's TARGET_sass.txt) in brief: the stall
    samples in all, their share by SASS_WINDOW-instruction bucket (where the kernel's time sits: entry, loops, tail),
    and the SASS_TOP instructions with the most samples, each with its share, executions, source text and its two
    largest stall reasons. A map of where warps wait, in samples, not time: a lone program's serial tail (e.g. one
    deciding program of many) weighs one program's samples however long it sets the kernel's end."""
    rows = list(csv.reader(path.read_text(errors="replace").splitlines()))
    start = next((i for i, r in enumerate(rows) if "Warp Stall Sampling (All Samples)" in r), None)
    if start is None:
        return {"error": "no 'Warp Stall Sampling (All Samples)' column"}
    head, body = rows[start], rows[start + 1:]
    col = {name: head.index(name) for name in ("Warp Stall Sampling (All Samples)", "Source", "Instructions Executed")}
    reasons = [(i, h[len("stall_"):]) for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]

    def num(r: list, i: int) -> float:
        try:
            return float(r[i].replace(",", "")) if i < len(r) and r[i] else 0.0
        except ValueError:
            return 0.0

    samples = [(num(r, col["Warp Stall Sampling (All Samples)"]), i, r) for i, r in enumerate(body)]
    total = sum(s for s, _, _ in samples)
    if total <= 0:
        return {"samples": 0, "instructions": len(body)}
    buckets: dict[int, float] = {}
    for s, i, _ in samples:
        buckets[i // SASS_WINDOW] = buckets.get(i // SASS_WINDOW, 0.0) + s
    top = []
    for s, i, r in sorted((x for x in samples if x[0] > 0), key=lambda x: -x[0])[:SASS_TOP]:
        why = sorted(((num(r, j), name) for j, name in reasons), reverse=True)[:2]
        top.append({"index": i, "share": round(s / total, 4), "executed": num(r, col["Instructions Executed"]),
                    "sass": r[col["Source"]].strip() if col["Source"] < len(r) else "",
                    "stalls": {name: v for v, name in why if v > 0}})
    return {"samples": total, "instructions": len(body),
            "by_instructions": {f"{b * SASS_WINDOW}-{(b + 1) * SASS_WINDOW - 1}": round(v / total, 4)
                                for b, v in sorted(buckets.items()) if v > 0},
            "top": top}


def summarise(csv_dir: str, out: str) -> None:
    """The CSVs of `ncu --csv --page details` (one per target) as one JSON: per target and kernel (the last
    profiled launch of each name; for the fp_* targets every launch of the last call, numbered in order), the KEEP
    metrics and the five largest 'Stall *' warp states; and, where device_ncu.sh dumped a kernel's SASS stall
    samples (TARGET_sass.txt), their `sass_summary` under the target's "sass" key."""
    table = {}
    for path in sorted(Path(csv_dir).glob("*.csv")):
        text = path.read_text(errors="replace")
        lines = text[text.find('"ID"'):].splitlines() if '"ID"' in text else []
        rows = list(csv.DictReader(lines))
        ids = sorted({int(r["ID"]) for r in rows if r.get("ID", "").isdigit()})
        last_call = {i: n for n, i in enumerate(ids[-FP_LAUNCHES:])} if path.stem in FP_MODES else {}
        kernels: dict[str, dict] = {}
        for row in rows:
            name = row.get("Kernel Name", "?").split("(")[0]
            if path.stem in FP_MODES:
                if not row.get("ID", "").isdigit() or int(row["ID"]) not in last_call:
                    continue
                name = f"{last_call[int(row['ID'])]}:{name}"
            k = kernels.setdefault(name, {})
            metric, value = row.get("Metric Name", ""), row.get("Metric Value", "")
            if metric in KEEP or metric.startswith("Stall "):
                try:
                    k[metric] = float(value.replace(",", ""))
                except ValueError:
                    k[metric] = value
        for k in kernels.values():
            stalls = sorted(((m, v) for m, v in k.items() if m.startswith("Stall ") and isinstance(v, float)),
                            key=lambda mv: -mv[1])
            for m, _ in stalls[5:]:
                del k[m]
        table[path.stem] = kernels
    for path in sorted(Path(csv_dir).glob("*_sass.txt")):
        table.setdefault(path.stem[:-len("_sass")], {})["sass"] = sass_summary(path)
    Path(out).write_text(json.dumps(table, indent=1))
    print(json.dumps(table, indent=1)[:20000])


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "summarise":
        summarise(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        raise SystemExit("usage: python3 bench/device_ncu.py TARGET | summarise CSV_DIR OUT.json")
