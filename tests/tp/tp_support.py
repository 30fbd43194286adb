"""Helpers shared by the TP tests (conftest.py holds the fixtures): compile test-tiny once, append the tp stage."""

from __future__ import annotations

from pathlib import Path

import torch

import lingc
from lingc.compile import default_programs
from lingc.passes.manager import CompileResult, PassManager
from lingc.passes.tp import run_tp_stage
from lingc.trace import TraceOptions, trace

OPTIONS = TraceOptions(max_len=64, prefill_tokens=16)      # requests of up to 52 tokens (2 x 6 kept as margin)


def compiled(ckpt: Path, dtype: torch.dtype, passes: list[str]) -> CompileResult:
    model = lingc.load(ckpt, dtype=dtype)
    return PassManager(passes).run(trace(model, default_programs(1), OPTIONS))


def with_tp(result: CompileResult, tp: int) -> tuple[CompileResult, list | None]:
    """A copy of `result` with the tp stage appended (result itself untouched) and every rank's weights."""
    copy = CompileResult(result.program, list(result.stages))
    return copy, (run_tp_stage(copy, tp) if tp > 1 else None)
