"""Every bench/ script imports on the CPU (the device calls are the only place they run, and a broken import there
costs a device call: bench/gluon_linear_probe.py imported helpers kernels/linear_tma.py no longer had)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


def test_the_bench_folder_has_scripts():
    assert len(SCRIPTS) > 20 and "device_step" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_imports(name: str, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(name)
    assert module.__doc__, f"bench/{name}.py has no module docstring"
    sys.modules.pop(name, None)
