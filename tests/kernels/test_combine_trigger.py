"""combine_add_rmsnorm's PDL trigger (kernels/moe.py COMBINE_LATE_TRIGGER_ROWS), compiled for sm_90 without a GPU:
under the early trigger `griddepcontrol.launch_dependents` follows the wait before any load of the expert rows; with
LATE_TRIGGER it follows those loads; with the entry trigger one precedes the wait. Which launches take the late
trigger is `combine_late_trigger` (rows at or over the knob, PDL on, no entry trigger). The trigger never changes a
value (the interpreter runs no PDL; the other combine tests check the values)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lingc.kernels import moe

_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.moe as K
entry, late = sys.argv[1] == "1", sys.argv[2] == "1"
sig = dict(e_ptr="*bf16", w_ptr="*fp32", res_ptr="*bf16", nw_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16",
           H="i32", stride_e="i32", stride_w="i32", stride_res="i32", stride_out="i32", stride_res_out="i32", eps="fp32")
const = dict(TOP_K=9, BLOCK_H=2048, ORDER=1, MUL_RN=True, PDL=True, ENTRY_TRIGGER=entry, LATE_TRIGGER=late)
sig.update({k: "constexpr" for k in const})
ptx = triton.compile(ASTSource(fn=K._combine_add_rmsnorm_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents"), find("ld.global"), sep="|")
"""


def _probe(entry: bool, late: bool) -> tuple[list[int], list[int], list[int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, "1" if entry else "0", "1" if late else "0"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tuple(eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))


@pytest.mark.parametrize("mode", ["early", "late", "entry"])
def test_trigger_placement(mode: str) -> None:
    waits, triggers, loads = _probe(mode == "entry", mode == "late")
    # entry: the trigger at entry, and the early trigger's after the wait (a no-op by then)
    assert len(waits) == 1 and len(triggers) == (2 if mode == "entry" else 1), (waits, triggers)
    after_wait = [i for i in loads if i > waits[0]]        # the expert rows, the routing weights, the residual
    assert len(after_wait) >= 9, loads
    if mode == "entry":
        assert triggers[0] < waits[0]
    elif mode == "early":
        assert waits[0] < triggers[0] < after_wait[0]
    else:
        assert triggers[0] > max(after_wait), (triggers, after_wait)


def test_which_launches_trigger_late(monkeypatch) -> None:
    monkeypatch.setattr(moe, "COMBINE_LATE_TRIGGER_ROWS", 2)
    assert moe.combine_late_trigger(True, False, 6)
    assert moe.combine_late_trigger(True, False, 2)
    assert not moe.combine_late_trigger(True, False, 1)     # decode: one row
    assert not moe.combine_late_trigger(True, True, 6)      # the entry trigger wins
    assert not moe.combine_late_trigger(False, False, 6)    # no PDL, no trigger
    monkeypatch.setattr(moe, "COMBINE_LATE_TRIGGER_ROWS", 0)
    assert not moe.combine_late_trigger(True, False, 16)
