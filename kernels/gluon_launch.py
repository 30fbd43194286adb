"""The launch guard of lingc's Gluon kernels (kernels/kda_gluon.py, linear_tma.py, router_gluon.py, mla_gluon.py).

A Gluon kernel that does not compile (a Triton whose Gluon API differs from the 3.6 these were written against)
warns once, naming its module and its off switch, and the caller runs the Triton kernel it stands in for; the
module's FAILED list keeps the first message, so its `eligible` says no from then on. Compilation comes before any
GPU work, so nothing has half-run when the fallback starts. `major` is the cached compute-capability query their
`eligible` shares.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import triton
from triton.compiler.errors import CompilationError

ERRORS = (CompilationError, AttributeError, TypeError, ValueError, RuntimeError)


def guarded(launch: Callable[[], object], failed: list[str], what: str, fallback: str, knob: str) -> bool:
    """launch(); True, or False after recording the error in `failed` and warning (RuntimeWarning) that `what` did
    not compile, `fallback` runs instead and `knob`=0 skips the attempt."""
    try:
        launch()
    except ERRORS as exc:
        failed.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        warnings.warn(f"lingc: {what} did not compile with Triton {triton.__version__} ({failed[0]}); {fallback} "
                      f"runs instead. {knob}=0 skips the attempt.", RuntimeWarning, stacklevel=3)
        return False
    return True


@functools.lru_cache(maxsize=None)
def major(device: torch.device) -> int:
    """The compute capability's major number of a CUDA device (cached: the Gluon modules' `eligible` asks at every
    launch). Each module imports it as `_major`, the name the tests replace."""
    return torch.cuda.get_device_capability(device)[0]
