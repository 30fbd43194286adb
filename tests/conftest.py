"""Shared fixtures: one test-tiny random checkpoint per session (seed 0), its fp32 and bf16 reference models,
their six traced step programs (small shapes: `tiny_options`) and the fp32 program after `partition`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# pytest-xdist workers run with COLUMNS=80 in their environment; rich consoles (lingc.cli) fix their width from COLUMNS at
# import, so CLI tests that pass a wider COLUMNS to CliRunner would see tables wrapped at 80. Drop it before lingc.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

import lingc  # noqa: E402
from lingc.init import write_random_checkpoint
from lingc.presets import preset
from lingc.program import Program
from lingc.trace import PROGRAMS, TraceOptions


def pytest_configure(config: pytest.Config) -> None:
    # Test tensors are tiny: a second intra-op thread only adds OpenMP hand-offs, and on a busy 2-core
    # machine its spin-waits made the suite ~7x slower (7 min vs 1 min). Results do not depend on it.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A test-tiny checkpoint directory (sharded, with an index), written once. Treat it as read-only."""
    return write_random_checkpoint(preset("test-tiny"), tmp_path_factory.mktemp("tiny_ckpt"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_fp32(tiny_ckpt: Path) -> lingc.LingForCausalLM:
    """The reference model loaded from `tiny_ckpt` in fp32 (eval mode). Shared: do not modify it."""
    return lingc.load(tiny_ckpt, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model_bf16(tiny_ckpt: Path) -> lingc.LingForCausalLM:
    """The reference model loaded from `tiny_ckpt` in bf16 (the serving dtype). Shared: do not modify it."""
    return lingc.load(tiny_ckpt, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_options() -> TraceOptions:
    """Small trace shapes for CPU tests: 32-token prefill chunks, 48 tokens per request in pages of 16,
    2 request slots, verify width 6 (5 draft tokens)."""
    return TraceOptions(batch=1, prefill_tokens=32, max_len=48, page_size=16, request_slots=2,
                        draft_tokens=6)


@pytest.fixture(scope="session")
def tiny_program(tiny_model_fp32: lingc.LingForCausalLM, tiny_options: TraceOptions) -> Program:
    """All six step programs of the fp32 test-tiny model. Shared: passes copy it; never edit it in place."""
    return lingc.trace(tiny_model_fp32, PROGRAMS, tiny_options)


@pytest.fixture(scope="session")
def tiny_program_bf16(tiny_model_bf16: lingc.LingForCausalLM, tiny_options: TraceOptions) -> Program:
    """All six step programs of the bf16 test-tiny model. Shared: never edit it in place."""
    return lingc.trace(tiny_model_bf16, PROGRAMS, tiny_options)


@pytest.fixture(scope="session")
def tiny_partitioned(tiny_program: Program) -> Program:
    """`tiny_program` after the partition pass: nextn split into draft, verify and extend. Never edit it in place."""
    from lingc.passes.partition import Partition
    return Partition().run(tiny_program)[0]
