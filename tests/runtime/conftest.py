"""Fixtures for the runtime gates (shared/docs/techniques.md section 13): one fp32 test-tiny checkpoint,
its reference model, one trace of all step programs, one program per pass combination and cached engines.

Shapes: `OPTIONS` (max_len 320, 16-token prefill chunks, verify width 6, 2 request slots) fits a 37-token
prompt plus 256 new tokens. One NEXTN step of test-tiny takes ~40 ms on one CPU core, so a 256-token
greedy run (accept length ~1 with random MTP weights) takes ~10 s: greedy runs are cached (`greedy_run`)
and shared by gate 1 (byte identity) and gate 3 (the re-run after interleaved requests, same instance).
Gate 1 runs a covering subset of its matrix by default; LINGC_FULL_MATRIX=1 runs all of it.
(Forked workers do not help on the 2-vCPU test machine: two concurrent runs take 2.4x as long as one.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

import lingc
from lingc.init import write_random_checkpoint
from lingc.passes.manager import PassManager
from lingc.presets import preset
from lingc.program import Program
from lingc.runtime.engine import Engine, Result
from lingc.trace import PROGRAMS, trace
from rt_support import COMBOS, FULL, NEW_TOKENS, OPTIONS, PROMPTS, greedy   # tests/runtime is on sys.path


# ---- the model and its programs ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rt_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random test-tiny checkpoint (seed 0). Read-only: tests that add files copy it first."""
    return write_random_checkpoint(preset("test-tiny"), tmp_path_factory.mktemp("rt_ckpt"), seed=0)


@pytest.fixture(scope="session")
def rt_model(rt_ckpt: Path) -> lingc.LingForCausalLM:
    """The fp32 reference model of `rt_ckpt`. Shared: do not modify it."""
    return lingc.load(rt_ckpt, dtype=torch.float32)


@pytest.fixture(scope="session")
def rt_traced(rt_model: lingc.LingForCausalLM) -> Program:
    """All step programs at `OPTIONS`, traced once. Passes copy it; never edit it in place."""
    return trace(rt_model, PROGRAMS, OPTIONS)


class _Programs:
    """One program per pass combination, built on first use (PassManager copies the traced program)."""

    def __init__(self, traced: Program):
        self.traced, self.cache = traced, {}

    def __call__(self, combo: str) -> Program:
        if combo not in self.cache:
            self.cache[combo] = (self.traced if combo == "traced"
                                 else PassManager(list(COMBOS[combo])).run(self.traced).program)
        return self.cache[combo]


@pytest.fixture(scope="session")
def rt_programs(rt_traced: Program) -> _Programs:
    """rt_programs(combo) -> Program; combo is a key of COMBOS, or 'traced' for no pass at all."""
    return _Programs(rt_traced)


@pytest.fixture(scope="session")
def rt_engine(rt_programs: _Programs) -> Callable[..., Engine]:
    """rt_engine(spec, combo=FULL) -> a cached Engine shared across tests (engines reset a request's state on
    open; gate 3 checks that). Tests that need a private instance build `Engine(rt_programs(...), ...)`."""
    cache: dict[tuple[str, str], Engine] = {}

    def get(spec: str, combo: str = FULL) -> Engine:
        if (spec, combo) not in cache:
            cache[spec, combo] = Engine(rt_programs(combo), spec=spec)
        return cache[spec, combo]

    return get


@pytest.fixture(scope="session")
def rt_reference(rt_model: lingc.LingForCausalLM) -> Callable[[str], list[int]]:
    """rt_reference(prompt_name) -> the reference model's greedy 256 tokens (model.generate), cached."""
    cache: dict[str, list[int]] = {}

    def get(name: str) -> list[int]:
        if name not in cache:
            cache[name] = _reference_tokens(rt_model, PROMPTS[name])
        return cache[name]

    return get


def _reference_tokens(model: lingc.LingForCausalLM, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), NEW_TOKENS)[0].tolist()


@pytest.fixture(scope="session")
def greedy_run(rt_programs: _Programs) -> Callable[[str, str, str], Result]:
    """greedy_run(combo, spec, prompt_name) -> the Result of a 256-token greedy request, computed once.

    Each (combo, spec) has one private Engine, used only through this fixture and by gate 3 (`.engine`),
    which pollutes it with other requests and re-runs the greedy request on the same instance."""
    engines: dict[tuple[str, str], Engine] = {}
    results: dict[tuple[str, str, str], Result] = {}

    def engine(combo: str, spec: str) -> Engine:
        if (combo, spec) not in engines:
            engines[combo, spec] = Engine(rt_programs(combo), spec=spec)
        return engines[combo, spec]

    def run(combo: str, spec: str, prompt: str) -> Result:
        if (combo, spec, prompt) not in results:
            results[combo, spec, prompt] = engine(combo, spec).generate(greedy(PROMPTS[prompt]))
        return results[combo, spec, prompt]

    run.engine = engine
    return run
