"""PDL (programmatic dependent launch) for every kernel family: whether a launch may use it, and the two
device-side calls, with where the trigger goes.

A PDL-launched kernel calls `pdl_wait()` before its first access to anything an earlier kernel wrote, and
`pdl_trigger()` where the old rule put `gdc_launch_dependents` (after its last load of such data). Where the
trigger fires is a speed choice, never a correctness one: a dependent's own `gdc_wait` waits for this kernel's
completion whatever the trigger does. LINGC_PDL_TRIGGER picks it (read once, at import; it is a constexpr, so
it is part of every kernel's compile key):

    early (default)  `pdl_wait()` triggers right after the wait. The next kernel's programs are scheduled as soon
                     as every program of this one has passed its wait (the kernel before it has completed), and
                     its pre-wait prologue (weights into registers, kda's state slice)
                     overlaps this kernel's whole run. Only one kernel runs ahead: it in turn triggers only after
                     its own wait returns. `pdl_trigger()` is then a no-op.
    late             the trigger after the last dependent load (`pdl_trigger()`), as Inductor places it.

Early is not "at kernel entry" (shared/docs/kernels.md 1.5's pitfall): triggering before the wait would let every
later kernel of a chain launch and hold SM slots while it waits. Against `late` with PDL launches on (H100,
2026-12-06, two processes of one device call: bench/results/step-ab-h100-20261206-combine-late-c.json against
step-h100-20261206-pdl-trigger-late.json): greedy decode 1.304-1.317 ms early against 1.444-1.448 late, greedy verify
2.585-2.588 against 2.646, so `early` stays. (The older A/B, bench/results/pdl-trigger-h200-20261130.json, ran the
step without PDL launches, a bench bug, and says nothing.) One launch takes the late placement by default:
combine_add_rmsnorm at 2 rows or more (LATE_TRIGGER_ROWS below; verify 4-8 us faster on the H100).

Loads before the wait. A PDL kernel's programs start only after every program of the kernel before it has passed
its own wait, i.e. after the kernel two launches back has completed (under either trigger). So data written two or
more launches back may be loaded (through L2, `.cg`: L1 is not coherent) before `pdl_wait()`; only what the kernel
just before writes must wait. Three kernels do it (H200 decode step, same bits): kda's fused decode / verify (state
slice, pool windows, slot), the down-GEMM at decode's pair counts (its align's outputs and its whole weight tile,
into registers) and MLA's q_absorb (q and its sum). (Weights need no such argument: the small "fma" linears, the
router GEMV, load their whole slice into registers before the wait, kernels/linear.py FMA_PRELOAD.) Where the launch
just before one of them writes or produces
those inputs, the pdl pass launches it without PDL (passes/pdl.py PREWAIT_INPUTS). What it does not buy: an L2
prefetch of a static 31.5 MB weight during an idle window made the linear reading it only 9.5 -> 8.6 us (the linear
reads L2 hardly faster than HBM here; bench/results/kernels-l2-prefetch-h200-20261201.json), and in the step the
linear's pre-wait L2 prefetch of its weight slice made decode slower (1.281 ms with it, 1.249 without), and so did
the "dot" linears loading their first weight blocks into registers (1.33-1.38 against 1.28; kernels/linear.py).

Entry triggers (`pdl_launch_next()`, the launch hint `entry_trigger` that passes/pdl.py sets): a short kernel B
whose next launch C reads nothing but weights before its own wait (a linear: the Gluon TMA GEMV's weight slice, the
small GEMVs' register preload) may trigger at its entry instead, so C's programs start while the kernel before B
still runs and C's pre-wait weight read overlaps it, not only B. What it costs: C's programs hold SM slots while
they wait, and the rule above moves by one for C alone (its programs may start before the kernel two back has
completed; C reads only weights there, so nothing C reads early is written). The kernel after C starts as before,
after C has passed its wait (B, hence everything earlier, complete). Correctness never depends on it: C's wait
still waits for B's completion.

`prefetch_l2(ptrs)` asks L2 for the lines at ptrs (inline PTX; PDL path only, the interpreter cannot run it): the
pre-wait prologues (all opt-in now: LINGC_LINEAR_PREFETCH_BLOCKS, LINGC_MOE_DOWN_PREFETCH, LINGC_MLA_PREFETCH) use it
for bytes no earlier kernel writes (weights), or, with the early trigger, for a tile
chosen from outputs of the kernel two back (complete by the time this one runs, see kernels/moe.py). A prefetch is
a hint: nothing reads its result, so a stale address costs bandwidth, never correctness.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lingc.knobs import env_int

PDL_MIN_CAPABILITY = 9  # griddepcontrol needs sm90+
TRIGGER_MODES = ("early", "late")


def _trigger_mode() -> str:
    mode = os.environ.get("LINGC_PDL_TRIGGER", "early")
    if mode not in TRIGGER_MODES:
        raise ValueError(f"LINGC_PDL_TRIGGER={mode!r}: want one of {', '.join(TRIGGER_MODES)}")
    return mode


TRIGGER = _trigger_mode()
TRIGGER_EARLY = tl.constexpr(TRIGGER == "early")


@triton.jit
def pdl_wait():
    """gdc_wait; under the early trigger, also let the next kernel launch (call only on the PDL path)."""
    tl.extra.cuda.gdc_wait()
    if TRIGGER_EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_trigger():
    """gdc_launch_dependents under the late trigger; nothing under the early one (pdl_wait did it)."""
    if not TRIGGER_EARLY:
        tl.extra.cuda.gdc_launch_dependents()


# Late triggers by op: a launch of `op` over at least LATE_TRIGGER_ROWS[op] rows (absent or 0: never) triggers after
# its row loads (`pdl_trigger_late`) instead of right after its wait, so the next kernel's programs are scheduled,
# and issue whatever they read before their own wait, once this short kernel's reads are in. Not with an entry
# trigger (that launch hint wins). combine_add_rmsnorm at 2 rows and more (verify): greedy verify 4-8 us faster in
# five pairings on an H100, decode untouched (2026-12-06, bench/results/step-ab-h100-20261206-combine-late*.json;
# LINGC_COMBINE_LATE_TRIGGER_ROWS=0 turns it off; off, verify was 7 us slower on another H100, -late-ops.json). The
# others are A/B knobs (bench/device_step.py --variant 'x:lingc.kernels.pdl.LATE_TRIGGER_ROWS={"mla_prep": 2}'):
# mla_prep at 2 rows, router_topk at 2, both, and router_align + mla_prep at 1 row measured level
# (bench/results/step-ab-h100-20261206-late-ops.json), so they stay off.
LATE_TRIGGER_OPS = ("combine_add_rmsnorm", "mla_prep", "router_topk", "router_align")
LATE_TRIGGER_ROWS: dict[str, int] = {"combine_add_rmsnorm": env_int("LINGC_COMBINE_LATE_TRIGGER_ROWS", 2)}


def late_trigger(op: str, pdl: bool, rows: int, entry_trigger: bool = False) -> bool:
    """Whether a PDL launch of `op` (one of LATE_TRIGGER_OPS) over `rows` rows triggers after its loads."""
    if op not in LATE_TRIGGER_OPS:
        raise ValueError(f"late_trigger: {op!r} has no late trigger placement; the ops that do: {LATE_TRIGGER_OPS}")
    limit = LATE_TRIGGER_ROWS.get(op, 0)
    return pdl and not entry_trigger and 0 < limit <= rows


@triton.jit
def pdl_wait_late(LATE: tl.constexpr):
    """pdl_wait, except that a LATE launch does not trigger here (its pdl_trigger_late does, after its loads)."""
    tl.extra.cuda.gdc_wait()
    if TRIGGER_EARLY and not LATE:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_trigger_late(LATE: tl.constexpr):
    """pdl_trigger, which a LATE launch makes fire under the early trigger too."""
    if LATE or not TRIGGER_EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_launch_next():
    """gdc_launch_dependents at kernel entry, before the wait (a launcher's `entry_trigger`; module docstring)."""
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """prefetch.global.L2 of every address in ptrs (call only on the PDL path, on the GPU)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


try:  # the same two calls for Gluon kernels (kernels/linear_tma.py, kernels/kda_gluon.py); Gluon: Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def gluon_gdc_wait():
        """griddepcontrol.wait in a Gluon kernel (the caller decides where the early trigger goes)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def gluon_gdc_launch_dependents():
        """griddepcontrol.launch_dependents in a Gluon kernel."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
except ImportError:  # pragma: no cover - depends on the Triton build
    pass


def pdl_supported(device: torch.device) -> bool:
    """PDL needs a CUDA tensor on sm90+, a Triton with gdc_wait, and no interpreter (it cannot run GDC)."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= PDL_MIN_CAPABILITY
