"""Fixtures for the tensor-parallel tests: test-tiny compiled once per dtype with every pass (the tp pass then
runs on copies), and TP artifacts written from that one compile (tp 1, 2, 4; fp32) so that no test compiles twice.

Budget (2-core CPU): the whole tests/tp run takes about 65 s; the multi-process tests dominate (a TP4
session on 2 cores runs 4 processes and steps ~4x slower than TP1), so they generate few tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lingc.artifact import write_artifact
from lingc.passes.manager import CompileResult
from tp_support import compiled, with_tp   # tests/tp is on sys.path


@pytest.fixture(scope="session")
def all_fp32(tiny_ckpt: Path) -> CompileResult:
    """test-tiny, fp32, every program, --passes all. Shared: never edit it in place."""
    return compiled(tiny_ckpt, torch.float32, ["all"])


@pytest.fixture(scope="session")
def all_bf16(tiny_ckpt: Path) -> CompileResult:
    """test-tiny, bf16 (the serving dtype), every program, --passes all."""
    return compiled(tiny_ckpt, torch.bfloat16, ["all"])


@pytest.fixture(scope="session")
def tp_artifacts(all_fp32: CompileResult, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """fp32 --passes all artifacts of test-tiny for tp 1, 2 and 4 (read-only: copy before tampering)."""
    root = tmp_path_factory.mktemp("tp_art")
    out = {}
    for tp in (1, 2, 4):
        result, ranks = with_tp(all_fp32, tp)
        out[tp] = write_artifact(result, root / f"tp{tp}", source="test-tiny", rank_weights=ranks)
    return out
