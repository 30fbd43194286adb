"""GPU check of the foundation on real sizes: random Ling-3.0-tiny (+1 MTP layer) write, streamed load, trace, one step.

Run on the device machine (see bench/README.md):
    python3 bench/device_foundation.py --out /tmp/tiny --json $OUT/foundation.json
Prints a short table and writes JSON with the GPU, torch version, commit and command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="/tmp/ling-tiny")
    ap.add_argument("--json", default="foundation.json")
    ap.add_argument("--mtp-layers", type=int, default=1)
    args = ap.parse_args()

    from lingc.checkpoint import checkpoint_layout, load
    from lingc.init import random_tensor, write_random_checkpoint
    from lingc.presets import preset
    from lingc.trace import TraceOptions, example_inputs, trace

    rows: dict[str, object] = {}
    config = preset("ling-3.0-tiny", num_nextn_predict_layers=args.mtp_layers)
    specs = checkpoint_layout(config)
    nbytes = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in specs)
    rows["checkpoint_GB"] = nbytes / 1e9

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in specs:                                   # drawing only: the compute part of `lingc init --device cuda`
        random_tensor(s, 0, "cuda")
    torch.cuda.synchronize()
    rows["init_draw_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    write_random_checkpoint(config, args.out, seed=0, device="cuda")
    rows["init_write_total_s"] = time.perf_counter() - t0

    rss0 = _rss_gb()
    t0 = time.perf_counter()
    model = load(args.out, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    rows["load_s"] = time.perf_counter() - t0
    rows["load_host_peak_rss_GB"] = _rss_gb()
    rows["load_host_rss_before_GB"] = rss0
    rows["gpu_mem_GB"] = torch.cuda.memory_allocated() / 1e9

    opts = TraceOptions(max_len=1024, prefill_tokens=64)
    t0 = time.perf_counter()
    program = trace(model, ["prefill", "decode", "verify", "extend", "draft"], opts)
    rows["trace_s"] = time.perf_counter() - t0
    rows["nodes_decode"] = len(program.graphs["decode"].nodes)

    inputs = example_inputs(model, "decode", opts)
    inputs["input_ids"].fill_(11)
    inputs["positions"].fill_(0)
    eager_state = {k: v.clone() for k, v in inputs.items()}
    with torch.no_grad():
        out = program.run("decode", inputs)
        from lingc.state import ModelState
        from lingc.trace import state_key
        st = ModelState({state_key(k): v for k, v in eager_state.items() if k.startswith("state_")}, opts.max_len)
        ref = model.step(eager_state["input_ids"], eager_state["positions"], st)
    torch.cuda.synchronize()
    rows["decode_traced_equals_eager"] = bool(torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]))
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(3):
            program.run("decode", inputs)
    torch.cuda.synchronize()
    rows["reference_decode_step_ms_eager"] = (time.perf_counter() - t0) / 3 * 1e3

    commit = os.environ.get("LINGC_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "commit": commit or "unknown", "command": " ".join(sys.argv),
              "results": rows}
    for k, v in rows.items():
        print(f"{k:34s} {v:.3f}" if isinstance(v, float) else f"{k:34s} {v}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
