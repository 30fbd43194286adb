"""lingc: a compiler and runtime that takes Ling-3.0 (BailingMoeV3) to the batch-1 decode floor.

Python API:
    model = lingc.load("ck/", dtype=torch.float32, device="cpu")   # reference model
    logits = model(input_ids)                                      # [B, T] -> fp32 [B, T, V]
    programs = lingc.trace(model, ["prefill", "decode"])           # fixed-shape FX step programs
"""

from lingc import ops  # noqa: F401  (registers torch.ops.lingc.*)
from lingc.checkpoint import CheckpointError, load
from lingc.config import ConfigError, LingConfig
from lingc.model import LingForCausalLM
from lingc.presets import preset
from lingc.trace import trace

__all__ = ["load", "trace", "preset", "LingConfig", "LingForCausalLM", "ConfigError", "CheckpointError"]
