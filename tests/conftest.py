"""Shared fixtures: one test-tiny random checkpoint per session (seed 0) and its fp32 reference model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lingc
from lingc.init import write_random_checkpoint
from lingc.presets import preset


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A test-tiny checkpoint directory (sharded, with an index), written once. Treat it as read-only."""
    return write_random_checkpoint(preset("test-tiny"), tmp_path_factory.mktemp("tiny_ckpt"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_fp32(tiny_ckpt: Path) -> lingc.LingForCausalLM:
    """The reference model loaded from `tiny_ckpt` in fp32 (eval mode). Shared: do not modify it."""
    return lingc.load(tiny_ckpt, dtype=torch.float32)
