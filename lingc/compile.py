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
                       progress: bool = False, tp: int = 1, draft_vocab: list[int] | None = None) -> CompileResult:
    """Compile `checkpoint` with `passes` and write the artifact to `out`; returns the CompileResult.

    tp > 1 runs the `tp` pass after every other pass and writes one weight set per rank (docs/tp.md).
    draft_vocab: token ids for the draft_vocab pass (added to `passes` if missing; passes/draft_vocab.py)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    if draft_vocab is not None and "draft_vocab" not in passes:
        passes = [*passes, "draft_vocab"]
    if draft_vocab is not None and tp != 1:
        raise ValueError("--draft-vocab does not combine with --tp (the token map is not sharded)")
    manager = PassManager(passes, verify=verify)          # validates pass names before any heavy work
    if draft_vocab is None and any(p.name == "draft_vocab" for p in manager.passes):
        raise ValueError("the draft_vocab pass needs a token map: lingc compile --draft-vocab FILE (a JSON list of "
                         "token ids)")
    if tp != 1:                                           # a bad --tp fails before any weight is read
        from lingc.config import LingConfig
        from lingc.passes.tp import check_tp
        check_tp(LingConfig.from_json(checkpoint), tp)
    model = load(checkpoint, dtype=DTYPES[dtype], progress=progress)
    programs = programs or default_programs(model.config.num_nextn_predict_layers)
    program = trace(model, programs, options)
    if draft_vocab is not None:
        from lingc.passes.draft_vocab import OPTION, check_token_map
        program.options[OPTION] = check_token_map(draft_vocab, model.config.vocab_size, "--draft-vocab")
    result = manager.run(program)
    rank_weights = None
    if tp != 1:
        from lingc.passes.tp import run_tp_stage
        rank_weights = run_tp_stage(result, tp, verify)
    extra = [p for p in (Path(checkpoint) / f for f in EXTRA_FILES) if p.exists()]
    write_artifact(result, out, source=str(checkpoint), extra_files=extra, rank_weights=rank_weights)
    return result
