"""GPU check of the engine: greedy NEXTN == plain decode on the GPU, and one real-size Ling-3.0-tiny run.

It runs the engine with backend="reference" and without CUDA graphs (the eager reference path, the
baseline this check was written for); bench/device_step.py measures lingc's speed (Triton kernels, CUDA graphs).
    python3 bench/device_engine.py --json $OUT/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch


def _compile(ck: str, dtype: torch.dtype, passes: list[str], options) -> object:
    import lingc
    from lingc.passes.manager import PassManager
    from lingc.trace import PROGRAMS, trace
    model = lingc.load(ck, dtype=dtype, device="cuda")
    return PassManager(passes).run(trace(model, PROGRAMS, options)).program, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default="engine.json")
    ap.add_argument("--real", action="store_true", help="also run Ling-3.0-tiny (+1 MTP layer) at real size")
    args = ap.parse_args()
    from lingc.init import write_random_checkpoint
    from lingc.presets import preset
    from lingc.runtime.engine import Engine, Request
    from lingc.trace import TraceOptions

    rows: dict[str, object] = {}
    tmp = tempfile.mkdtemp()
    ck = str(write_random_checkpoint(preset("test-tiny"), os.path.join(tmp, "tiny"), seed=0))
    prompt = [11, 22, 33, 44, 55]
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        program, model = _compile(ck, dtype, ["partition", "fuse_swiglu", "fuse_index_chains", "capture_metadata", "pdl"],
                                  TraceOptions(max_len=320, prefill_tokens=16))
        out = {}
        for spec in ("nextn", "none"):
            eng = Engine(program, "cuda", spec, backend="reference", cuda_graphs=False)
            eng.generate(Request(prompt, 8, ignore_eos=True))                       # warm-up
            t0 = time.perf_counter()
            r = eng.generate(Request(prompt, 128, ignore_eos=True))
            out[spec] = r
            rows[f"tiny_{name}_{spec}_ms_per_step"] = (time.perf_counter() - t0 - r.ttft_s) / max(r.steps, 1) * 1e3
        rows[f"tiny_{name}_nextn_equals_plain"] = out["nextn"].tokens == out["none"].tokens
        ref = model.generate(torch.tensor([prompt], device="cuda"), 128)[0].tolist()
        rows[f"tiny_{name}_plain_equals_reference"] = out["none"].tokens == ref

    if args.real:
        real = write_random_checkpoint(preset("ling-3.0-tiny", num_nextn_predict_layers=1),
                                       os.path.join(tmp, "real"), seed=0, device="cuda")
        t0 = time.perf_counter()
        program, _ = _compile(str(real), torch.bfloat16, ["all"], TraceOptions(max_len=1024, prefill_tokens=64))
        rows["real_load_trace_passes_s"] = time.perf_counter() - t0
        eng = Engine(program, "cuda", "nextn", simulate_accept_len=3.2, backend="reference", cuda_graphs=False)
        eng.generate(Request(prompt, 8, ignore_eos=True))
        r = eng.generate(Request(list(range(100, 164)), 64, ignore_eos=True))
        rows["real_nextn_mean_accept_len_simulated"] = r.mean_accept_len
        rows["real_nextn_eager_ms_per_step"] = (r.total_s - r.ttft_s) / max(r.steps, 1) * 1e3

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "commit": os.environ.get("LINGC_COMMIT", "unknown"), "command": " ".join(sys.argv), "results": rows,
              "note": "eager reference ops, no Triton kernels or CUDA graphs yet: a correctness run, not lingc's speed"}
    for k, v in rows.items():
        print(f"{k:42s} {v:.3f}" if isinstance(v, float) else f"{k:42s} {v}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
