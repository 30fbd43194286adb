"""What a kernel boundary costs inside a CUDA graph: PDL's grid-dependency wait against a flag handoff.

lingc's step is a chain of ~250 dependent launches (decode) and every boundary costs time the bytes do not explain
(shared/docs/kernels.md 5.2: ~1.4 us a tiny kernel with PDL). Under PDL a kernel's `griddepcontrol.wait` returns only
once the whole kernel before it has completed and flushed. A flag handoff replaces that wait: every program of the
producer, after its stores, adds 1 to the link's counter (CTA barrier, then a release atomic, gpu scope); the
consumer, launched early by PDL as now, polls the counter (acquire) until it reaches the producer's grid size, then
triggers its own dependents and runs. This probe measures both on a chain of tiny kernels, so a later change to
every kernel family's wait is judged by a number, not a guess. On the H200 (results/flag-chain-h200-20261205.json)
the flag handoff cost more than gdc_wait at every grid (1.14 vs 0.73 us a kernel at 132 programs).

    link i, program p:  [before the wait: read a cold weight slice (--weight-kb)]  wait  y[p] = x[p] + 1  signal

Modes (one row each, per grid size and weight slice):
    graph  plain graph launches, no PDL: each kernel starts after the previous one has finished
    pdl    PDL launches, gdc_wait then the trigger (lingc's `early` trigger, kernels/pdl.py)
    entry  PDL launches, the trigger at kernel entry (before the weight read), then gdc_wait: every kernel's programs
           may start while the one before still waits, so the pre-wait weight reads of many links overlap (the deep
           form of lingc's `entry_trigger` hint, kernels/pdl.py; what it costs is SM slots held while waiting)
    flag   PDL launches, the counter poll instead of gdc_wait, then the trigger; signal after the stores; the
           consumer's programs each add 1 again at their end and the one that brings it to 2G resets it to 0, so
           the counter is ready for the next replay (no host work). The chain's first kernel keeps gdc_wait (nothing
           signals it; without the wait it could overwrite a buffer the previous chain's last kernel still reads)
The value check (the chain's output is its length, every element) runs after the timed replays; a poll that gives up
after --max-spins counts a timeout (reported; any timeout makes the row not ok).

    python3 bench/kernel_flag_chain.py [--links 256] [--grids 1,16,132,264] [--weight-kb 0,16] [--modes graph,pdl,flag]
                                       [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from timing import graph_time_us  # noqa: E402

MODES = {"graph": 0, "pdl": 1, "flag": 2, "entry": 3}
BLOCK = 256          # fp32 values a program passes on (1 KB)
WARPS = 4


@triton.jit
def _link_kernel(x_ptr, y_ptr, w_ptr, flags_ptr, timeouts_ptr, link, zero, max_spins,
                 MODE: tl.constexpr, BLOCK: tl.constexpr, WBLOCK: tl.constexpr, FIRST: tl.constexpr,
                 LAST: tl.constexpr, PDL: tl.constexpr = True):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    if MODE == 3:
        tl.extra.cuda.gdc_launch_dependents()
    ws = 0.0
    if WBLOCK > 0:                      # a weight slice no kernel writes: read before the wait, as lingc's GEMVs do
        w = tl.load(w_ptr + pid.to(tl.int64) * WBLOCK + tl.arange(0, WBLOCK))
        ws = tl.sum(w.to(tl.float32), axis=0)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 3:
        tl.extra.cuda.gdc_wait()
    if MODE == 2:
        if FIRST and PDL:   # the chain's entry waits on whatever ran before it (as after a kernel that signals nothing)
            tl.extra.cuda.gdc_wait()
        if not FIRST:
            c = 0
            spins = 0
            while (c < grid) & (spins <= max_spins):     # the first poll and up to max_spins more
                c = tl.atomic_add(flags_ptr + link - 1, 0, sem="acquire", scope="gpu")
                spins += 1
            if c < grid:
                tl.atomic_add(timeouts_ptr, 1)
        if PDL:                                              # off only in the interpreter (the protocol's CPU test)
            tl.extra.cuda.gdc_launch_dependents()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if FIRST:
        x = tl.zeros([BLOCK], tl.float32)
    else:
        x = tl.load(x_ptr + offs, cache_modifier=".cg")
    tl.store(y_ptr + offs, x + 1.0 + ws * zero)
    if MODE == 2:
        tl.debug_barrier()                                   # every thread's store before the signal
        if not LAST:
            tl.atomic_add(flags_ptr + link, 1, sem="release", scope="gpu")
        if not FIRST:                                        # consumed: the last of the 2G adds resets the counter
            old = tl.atomic_add(flags_ptr + link - 1, 1, sem="relaxed", scope="gpu")
            if old == 2 * grid - 1:
                tl.store(flags_ptr + link - 1, 0)


def chain(mode: str, links: int, grid: int, weight_kb: int, max_spins: int, dev: torch.device, pdl: bool = True):
    """The chain's launch closures, its output buffer, the timeouts counter and the link counters. pdl=False (the
    interpreter) launches the flag mode without PDL: the protocol alone, one kernel after another."""
    bufs = [torch.zeros(grid * BLOCK, device=dev) for _ in range(2)]
    wblock = weight_kb * 1024 // 2
    weights = [torch.randn(max(grid * wblock, 1), device=dev, dtype=torch.bfloat16) for _ in range(links)]
    flags = torch.zeros(links, dtype=torch.int32, device=dev)
    timeouts = torch.zeros(1, dtype=torch.int32, device=dev)
    m = MODES[mode]

    def launch(i: int):
        return lambda: _link_kernel[(grid,)](
            bufs[i % 2], bufs[(i + 1) % 2], weights[i], flags, timeouts, i, 0.0, max_spins, MODE=m, BLOCK=BLOCK,
            WBLOCK=wblock, FIRST=i == 0, LAST=i == links - 1, PDL=pdl, num_warps=WARPS,
            **({"launch_pdl": True} if pdl and m > 0 else {}))
    return [launch(i) for i in range(links)], bufs[links % 2], timeouts, flags


def measure(mode: str, links: int, grid: int, weight_kb: int, max_spins: int, dev: torch.device) -> dict:
    calls, out, timeouts, flags = chain(mode, links, grid, weight_kb, max_spins, dev)
    us = [graph_time_us(calls, repeats=20) for _ in range(3)]
    ok_values = bool((out == float(links)).all().item())
    row = {"mode": mode, "links": links, "grid": grid, "weight_kb_per_program": weight_kb,
           "us_per_kernel": statistics.median(us), "runs_us": us, "values_ok": ok_values,
           "timeouts": int(timeouts.item()), "flags_reset": bool((flags == 0).all().item())}
    row["ok"] = ok_values and row["timeouts"] == 0 and row["flags_reset"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", type=int, default=256)
    ap.add_argument("--grids", default="1,16,132,264")
    ap.add_argument("--weight-kb", default="0,16", help="cold weight KB each program reads before its wait")
    ap.add_argument("--modes", default="graph,pdl,flag")
    ap.add_argument("--max-spins", type=int, default=1 << 22)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for wkb in (int(x) for x in args.weight_kb.split(",")):
        for grid in (int(x) for x in args.grids.split(",")):
            for mode in args.modes.split(","):
                row = measure(mode, args.links, grid, wkb, args.max_spins, dev)
                rows.append(row)
                print(f"{mode:6s} grid {grid:4d} weight {wkb:3d} KB  {row['us_per_kernel']:6.3f} us/kernel  "
                      f"ok {row['ok']} (timeouts {row['timeouts']})", flush=True)
    if args.json:
        commit = os.environ.get("LINGC_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
               "commit": commit, "command": "python3 " + " ".join(sys.argv), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
