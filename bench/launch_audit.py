"""Launch audit on the CPU: what each step graph launches outside lingc's Triton kernels, at TP1 and TP2.

The step graphs (decode step, the NEXTN draft / verify / extend, the greedy copies) of Ling-3.0-tiny's graph structure
(24 layers in groups of 4: 18 KDA + 6 MLA, 1 dense + 23 MoE with the fused shared expert, 1 MTP layer, NEXTN 5/6; its
widths, with 16 experts and a small vocabulary: `structure_config`), every default pass (`all`), then for TP2 the tp stage as
`lingc compile --tp 2` runs it; each graph lowered with the triton backend (`runtime.executor.lower`) and its launches
counted by label. Pure views (aten.view, getitem, split_with_sizes, ...: `passes.matchers.VIEW_OPS` and getitem)
launch no kernel and are left out. A label `triton:<op>` is one of lingc's Triton (or Gluon) kernels; any other
label is a torch op the executor dispatches (aten, or a lingc reference op with no kernel), which under a CUDA graph
is one or more torch kernels. docs/tp.md's "Launch audit" table is this script's output.

    python3 bench/launch_audit.py [--json OUT] [--tp 1,2]      (~2 minutes and ~12 GB on the CPU)
"""

from __future__ import annotations

import argparse
import datetime
import json
import operator
import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

GRAPHS = ("step", "draft", "verify", "extend", "step_greedy", "draft_greedy", "verify_greedy", "extend_greedy")


def structure_config():
    """Ling-3.0-tiny with 16 experts instead of 128 and a 2048-token vocabulary: the same graphs (the expert count
    and the vocabulary enter no pass's choice; the widths do, e.g. fuse_norm_linear's weight-size limit, so they
    stay Ling-3.0-tiny's), in ~2.5 GB of bf16 weights instead of 16 GB."""
    from lingc.presets import preset
    return preset("ling-3.0-tiny", num_experts=16, vocab_size=2048, num_nextn_predict_layers=1)


def programs(tps: list[int], config=None) -> dict[int, object]:
    """tp -> the (rank 0) Program of `config` (default: structure_config()) after every default pass (and the tp
    stage where tp > 1)."""
    from lingc.compile import default_programs
    from lingc.init import random_model
    from lingc.passes.manager import PassManager
    from lingc.passes.tp import run_tp_stage
    from lingc.trace import trace
    config = config or structure_config()
    model = random_model(config, seed=0, dtype=torch.bfloat16)
    out = {}
    for tp in tps:
        result = PassManager(["all"]).run(trace(model, default_programs(config.num_nextn_predict_layers)))
        if tp > 1:
            run_tp_stage(result, tp)
        out[tp] = result.program
    return out


def audit(program, graphs: tuple[str, ...] = GRAPHS) -> dict[str, dict]:
    """graph -> {"triton": launches of lingc kernels, "other": {label: count} of everything else, "views": n}."""
    from lingc.passes.matchers import VIEW_OPS
    from lingc.runtime.executor import lower
    free = {*(op for op in VIEW_OPS), operator.getitem}
    rows = {}
    for name in graphs:
        if name not in program.graphs:
            continue
        views = sum(1 for n in program.graphs[name].nodes if n.op == "call_function" and n.target in free)
        labels = Counter()
        for launch in lower(program, name, backend="triton").launches:
            labels[launch.label] += 1
        rows[name] = {"triton": sum(v for k, v in labels.items() if k.startswith("triton:")),
                      "other": {k: v for k, v in sorted(labels.items())
                                if not k.startswith("triton:") and k not in _view_labels(free)},
                      "views": views}
    return rows


def _view_labels(free: set) -> set[str]:
    from lingc.ops.registry import op_name
    return {op_name(t) for t in free}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes (default 1,2)")
    args = ap.parse_args(argv)
    tps = [int(x) for x in args.tp.split(",") if x]
    report = {tp: audit(p) for tp, p in programs(tps).items()}
    for tp, rows in report.items():
        print(f"TP{tp}")
        for name, row in rows.items():
            other = ", ".join(f"{k} {v}" for k, v in row["other"].items()) or "none"
            print(f"  {name:14s} triton {row['triton']:4d}  outside Triton: {other}")
    if args.json:
        meta = {"machine": f"cpu ({platform.machine()}, {os.cpu_count()} cores), no GPU: launch counts only",
                "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                "commit": os.environ.get("LINGC_COMMIT") or subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
                "command": "python3 bench/launch_audit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "config": "Ling-3.0-tiny with num_experts 16, vocab_size 2048, 1 MTP layer (structure_config)"}
        args.json.write_text(json.dumps({**meta, **{f"tp{tp}": rows for tp, rows in report.items()}}, indent=1)
                             + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
