"""An artifact opened for generation: the engine, the tokenizer (if the checkpoint had one) and result summaries."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingc.artifact import load_artifact
from lingc.runtime.engine import Engine, EngineError, Result

TOKENIZER_FILE = "tokenizer.json"


def draft_vocab_size(engine) -> int | None:
    """How many hot ids the draft proposes from (the draft_vocab pass), or None (no pass, or an engine without a
    program, as TP's front end)."""
    program = getattr(engine, "program", None)
    hot = program.options.get("draft_vocab") if program is not None else None
    return hot.get("size") if isinstance(hot, dict) else None


@dataclass
class Session:
    path: Path
    engine: Engine
    tokenizer: Any | None          # tokenizers.Tokenizer

    def encode(self, prompt_ids: str, prompt: str) -> list[int]:
        """Token ids from '11,22,33' or from text (needs the tokenizer)."""
        if bool(prompt_ids) == bool(prompt):
            raise EngineError("give exactly one of --prompt-ids and --prompt")
        if prompt_ids:
            try:
                return [int(x) for x in prompt_ids.split(",") if x.strip()]
            except ValueError:
                raise EngineError(f"--prompt-ids must be comma-separated integers, got {prompt_ids!r}") from None
        if self.tokenizer is None:
            raise EngineError(f"{self.path} has no {TOKENIZER_FILE} (the checkpoint had none); use --prompt-ids")
        return self.tokenizer.encode(prompt).ids

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    def summary(self, prompt: list[int], r: Result) -> dict[str, Any]:
        """What `lingc generate --json` prints."""
        decode_s = max(r.total_s - r.ttft_s, 1e-9)
        return {"prompt_tokens": len(prompt), "tokens": r.tokens, "text": self.decode(r.tokens),
                "finish_reason": r.finish_reason, "spec": r.spec, "steps": r.steps,
                "accept_lens": r.accept_lens, "mean_accept_len": r.mean_accept_len,
                "simulated_accept_len": r.simulated_accept_len, "ttft_ms": r.ttft_s * 1e3, "tpot_ms": r.tpot_s * 1e3,
                "tok_per_s": len(r.tokens) / r.total_s if r.total_s else 0.0,
                "step_ms": decode_s / r.steps * 1e3 if r.steps else 0.0, "graphs": list(r.graphs),
                "draft_vocab": draft_vocab_size(self.engine) if r.spec == "nextn" else None}


def open_session(artifact: str | Path, spec: str = "nextn", device: str = "cpu",
                 simulate_accept_len: float = 0.0, backend: str = "auto", cuda_graphs: bool | None = None,
                 pdl: bool | None = None, greedy_graphs: bool = True) -> Session:
    art = load_artifact(artifact, device=device)
    tokenizer = None
    tok_file = Path(artifact) / TOKENIZER_FILE
    if tok_file.exists():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(tok_file))
    return Session(Path(artifact), Engine(art.program, device, spec, simulate_accept_len, backend=backend,
                                               cuda_graphs=cuda_graphs, pdl=pdl, greedy_graphs=greedy_graphs),
                   tokenizer)
