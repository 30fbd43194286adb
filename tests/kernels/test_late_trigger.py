"""Late PDL triggers (kernels/pdl.py LATE_TRIGGER_ROWS), compiled for sm_90 without a GPU. combine_add_rmsnorm: under
the early trigger `griddepcontrol.launch_dependents` follows the wait before any load of the expert rows; with
LATE_TRIGGER it follows those loads; with the entry trigger one precedes the wait. mla_prep (an A/B knob): with
LATE_TRIGGER the trigger follows the first of its loads after the wait (the compiler may sink later ones past it);
with its entry trigger (passes/pdl.py PREP_ENTRY_TRIGGER) one comes first, before the weight loads and the wait.
Which launches take the late trigger is kernels/pdl.py `late_trigger` (rows at or over the op's limit, PDL on, no
entry trigger). The trigger never changes a value (the interpreter runs no PDL; the other kernel tests check the
values)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lingc.kernels import pdl

_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.moe as K
entry, late = sys.argv[1] == "1", sys.argv[2] == "1"
sig = dict(e_ptr="*bf16", w_ptr="*fp32", res_ptr="*bf16", nw_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16",
           H="i32", stride_e="i32", stride_w="i32", stride_res="i32", stride_out="i32", stride_res_out="i32",
           eps="fp32")
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


_PREP_PROBE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lingc.kernels.mla as K
late, entry = sys.argv[1] == "late", sys.argv[1] == "entry"
ints = ["T", "NH", "HALF", "R", "stride_qb", "stride_qt", "stride_qh", "stride_c", "stride_k", "stride_row",
        "stride_locs_b", "stride_locs_t", "stride_pos_b", "stride_pos_t"]
sig = dict(q_ptr="*bf16", c_ptr="*bf16", k_ptr="*bf16", w_ptr="*bf16", kv_ptr="*bf16", locs_ptr="*i64",
           pos_ptr="*i64", qout_ptr="*bf16", ln_theta_hi="fp32", ln_theta_lo="fp32", eps="fp32",
           **{n: "i32" for n in ints})
const = dict(BLOCK_NH=16, BLOCK_HALF=32, BLOCK_R=512, MUL_RN=True, PDL=True, LATE_TRIGGER=late, ENTRY_TRIGGER=entry)
sig = {n: sig.get(n, "constexpr") for n in K._mla_prep_kernel.arg_names}
ptx = triton.compile(ASTSource(fn=K._mla_prep_kernel, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
lines = [l.strip().split(" ", 1)[-1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines()]
find = lambda s: [i for i, l in enumerate(lines) if l.startswith(s)]
print(find("griddepcontrol.wait"), find("griddepcontrol.launch_dependents"), find("ld.global"), sep="|")
"""


@pytest.mark.parametrize("mode", ["early", "late", "entry"])
def test_mla_prep_trigger_placement(mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PREP_PROBE, mode], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    waits, triggers, loads = (eval(part) for part in proc.stdout.strip().splitlines()[-1].split("|"))
    # entry: the trigger at entry, and the early trigger's after the wait (a no-op by then)
    assert len(waits) == 1 and len(triggers) == (2 if mode == "entry" else 1), (waits, triggers)
    after_wait = [i for i in loads if i > waits[0]]
    assert len(after_wait) >= 4, loads          # the position, the slot, q_pe and the token's c_kv / k_pe rows
    if mode == "entry":
        assert triggers[0] < min(loads) and triggers[0] < waits[0] < triggers[1] < after_wait[0], (triggers, loads)
    elif mode == "late":   # after the wait's first loads (the compiler may sink a later row load below it: a hint, not a fence)
        assert len([i for i in after_wait if i < triggers[0]]) >= 3, (triggers, after_wait)
    else:
        assert waits[0] < triggers[0] < after_wait[0], (waits, triggers, after_wait)


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
    assert pdl.LATE_TRIGGER_ROWS == {"combine_add_rmsnorm": 2}       # the default: verify's combine only
    late = pdl.late_trigger
    assert late("combine_add_rmsnorm", True, 6) and late("combine_add_rmsnorm", True, 2)
    assert not late("combine_add_rmsnorm", True, 1)                  # decode: one row
    assert not late("combine_add_rmsnorm", True, 6, entry_trigger=True)   # the entry trigger wins
    assert not late("combine_add_rmsnorm", False, 6)                 # no PDL, no trigger
    assert not late("mla_prep", True, 6) and not late("router_topk", True, 6)
    with pytest.raises(ValueError, match="moe_up_act"):
        late("moe_up_act", True, 6)                                  # a kernel without the placement
    monkeypatch.setattr(pdl, "LATE_TRIGGER_ROWS", {"mla_prep": 1})
    assert late("mla_prep", True, 1) and not late("combine_add_rmsnorm", True, 6)
