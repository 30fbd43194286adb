"""lingc compile: checkpoint -> reference model -> traced step programs -> passes -> artifact."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lingc.artifact import write_artifact
from lingc.checkpoint import load
from lingc.passes.manager import CompileResult, PassManager
from lingc.trace import TraceOptions, trace

log = logging.getLogger(__name__)

EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",   # copied and hashed
               "generation_config.json")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def default_programs(num_mtp_layers: int) -> list[str]:
    """Every program the checkpoint supports: the MTP programs (and NEXTN) only when it has an MTP layer."""
    return ["prefill", "decode", "step"] + (["mtp_prefill", "mtp_decode", "nextn"] if num_mtp_layers else [])


def compile_checkpoint(checkpoint: str | Path, out: str | Path, passes: list[str], programs: list[str] | None = None,
                       dtype: str = "bf16", verify: bool = False, options: TraceOptions | None = None,
                       progress: bool = False, tp: int = 1) -> CompileResult:
    """Compile `checkpoint` with `passes` and write the artifact to `out`; returns the CompileResult.

    tp > 1 runs the `tp` pass after every other pass and writes one weight set per rank (docs/tp.md)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    manager = PassManager(passes, verify=verify)          # validates pass names before any heavy work
    if tp != 1:                                           # a bad --tp fails before any weight is read
        from lingc.config import LingConfig
        from lingc.passes.tp import check_tp
        check_tp(LingConfig.from_json(checkpoint), tp)
    model = load(checkpoint, dtype=DTYPES[dtype], progress=progress)
    programs = programs or default_programs(model.config.num_nextn_predict_layers)
    program = trace(model, programs, options)
    result = manager.run(program)
    rank_weights = None
    if tp != 1:
        from lingc.passes.tp import run_tp_stage
        rank_weights = run_tp_stage(result, tp, verify)
    extra = [p for p in (Path(checkpoint) / f for f in EXTRA_FILES) if p.exists()]
    write_artifact(result, out, source=str(checkpoint), extra_files=extra, rank_weights=rank_weights)
    return result
