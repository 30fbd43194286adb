"""kernels/pdl.py's trigger modes, compiled for sm_90 without a GPU: where `griddepcontrol.launch_dependents`
lands relative to the wait and to the kernel's loads in the PTX, for LINGC_PDL_TRIGGER=early / late, and that a
bad value is an error naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import os
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.rmsnorm as K
sig = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", stride_x="i32", stride_out="i32", N="i32", eps="fp32",
           BLOCK_N="constexpr", PDL="constexpr", ENTRY_TRIGGER="constexpr")
entry = os.environ.get("PROBE_ENTRY") == "1"
ptx = triton.compile(ASTSource(fn=K._rmsnorm_kernel, signature=sig,
                               constexprs=dict(BLOCK_N=2048, PDL=True, ENTRY_TRIGGER=entry)),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents"), find("ld.global"), sep="|")
"""


def _probe(mode: str, entry: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LINGC_PDL_TRIGGER"] = mode
    env["PROBE_ENTRY"] = "1" if entry else "0"
    return subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)


@pytest.mark.parametrize("mode", ["early", "late"])
def test_trigger_placement_in_ptx(mode: str) -> None:
    proc = _probe(mode)
    assert proc.returncode == 0, proc.stderr[-2000:]
    waits, triggers, loads = (eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))
    assert len(waits) == 1 and len(triggers) == 1, (waits, triggers)
    after_wait = [i for i in loads if i > waits[0]]          # x: what an earlier kernel wrote
    assert after_wait, "the kernel loads x after the wait"
    if mode == "early":   # right behind the wait, before the loads of x
        assert waits[0] < triggers[0] < after_wait[0]
    else:                 # after the last load of x
        assert triggers[0] > after_wait[-1]


@pytest.mark.parametrize("mode", ["early", "late"])
def test_entry_trigger_comes_first(mode: str) -> None:
    """ENTRY_TRIGGER (the pdl pass's entry_trigger hint): launch_dependents before the wait and before every load,
    whatever the mode; under `late` the mode's own trigger still follows the loads of x."""
    proc = _probe(mode, entry=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    waits, triggers, loads = (eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))
    assert len(waits) == 1 and triggers and loads, (waits, triggers, loads)
    assert triggers[0] < waits[0] and triggers[0] < loads[0]


def test_bad_mode_names_the_variable() -> None:
    proc = _probe("soon")
    assert proc.returncode != 0 and "LINGC_PDL_TRIGGER='soon'" in proc.stderr
