"""GPU timing helpers shared by the kernel and step benchmarks: CUDA graphs, CUDA events, cold L2, medians.

Method (shared/seed, /work/.library/device/METHOD.md): launch overhead is removed by capturing the work in a
CUDA graph and timing graph replays with CUDA events; weights are kept cold by rotating through enough
distinct copies that their total exceeds the H200's 60 MB L2 several times over (`cold_copies`); the
reported number is the median over repeats, per call.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

L2_BYTES = 60 * 2**20          # H200 L2 is 60 MB (50 MB usable per partition pair; round up to be safe)
COLD_FACTOR = 4                 # rotate through at least this many L2-fuls of weights


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cold_copies(bytes_per_copy: int, minimum: int = 2, maximum: int = 256) -> int:
    """How many distinct weight copies to rotate through so that one pass reads >= COLD_FACTOR x L2."""
    need = -(-COLD_FACTOR * L2_BYTES // max(bytes_per_copy, 1))
    return max(minimum, min(maximum, need))


def graph_time_us(calls: Sequence[Callable[[], object]], repeats: int = 30, warmup: int = 3) -> float:
    """Median time of one call, in microseconds: all `calls` captured back to back in one CUDA graph,
    the graph replayed `repeats` times between CUDA events, each replay's time divided by len(calls).
    Each call should read different weights (see `cold_copies`) for a cold-L2 number."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):                 # compile / autotune outside the capture
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def events_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one eager call of fn between two CUDA events (launch overhead included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def hbm_bandwidth_gbps(size_bytes: int = 4 * 2**30, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes / time), GB/s, median of repeats."""
    n = size_bytes // 2
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * n / statistics.median(times) / 1e9


def graph_time_or_none(calls: Sequence[Callable[[], object]]) -> float | None:
    """graph_time_us(calls), or None (with a note on stderr) when the calls cannot be captured in a CUDA graph,
    e.g. a reference op that reads a device value on the host."""
    import sys
    try:
        return graph_time_us(calls)
    except Exception as err:  # noqa: BLE001
        print(f"# not timed: {type(err).__name__}: {err}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def kernel_row(kernel: str, shape: str, ok: bool, max_abs_err: float, bit_exact: bool, pdl_equal: bool,
               time_us: float | None, ref_time_us: float | None, bytes_: int, **extra) -> dict:
    """One result row of a kernel bench (bench/kernel_<family>.py), with GB/s from bytes and time."""
    gbps = bytes_ / (time_us * 1e3) if time_us else None
    return {"kernel": kernel, "shape": shape, "ok": bool(ok and pdl_equal), "max_abs_err": float(max_abs_err),
            "bit_exact": bool(bit_exact), "pdl_equal": bool(pdl_equal), "time_us": time_us,
            "ref_time_us": ref_time_us, "bytes": int(bytes_), "gbps": gbps, **extra}


def check_main(script: str, doc: str, run: Callable[[torch.device], dict]) -> None:
    """A one-GPU check script's main: `--json OUT` (optional), then run(cuda) under the result header every bench
    JSON carries (GPU, torch, Python, LINGC_COMMIT, the command)."""
    import argparse
    import json
    import os
    import platform
    import sys
    from pathlib import Path
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "python": platform.python_version(),
              "commit": os.environ.get("LINGC_COMMIT", "unknown"),
              "command": f"bench/{script} " + " ".join(sys.argv[1:]), **run(dev)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
