"""A guard that fails when the step path reads a device value on the host (.item(), .tolist(), int(t), ...).

Run-ahead dies on any such read: the host would wait for the device. Inside `NoHostReads()` the Tensor
methods that read values are patched; a call is allowed only from functions whose qualified name is in
`allow` (the documented one-step-late copy, `LateCopy.consume`) and, with allow_ops=True (the default),
from op implementations (lingc/ops): the guard's subject is the host code around the kernels, and the
reference ops stand in for device kernels. They do read today (moe_align and the MoE grouped GEMM size
their work on the host), which syncs the GPU wherever the reference ops run eagerly there;
allow_ops=False lists those reads. Everything else is recorded as a violation and, with strict=True, raised.

It sees Tensor reads only: a synchronising host-to-device copy from pageable memory, an explicit
`synchronize()` or a data-dependent op (nonzero, boolean-mask indexing) is not caught.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReadError(RuntimeError):
    """The step path read a device value on the host."""


class NoHostReads:
    def __init__(self, allow: tuple[str, ...] = ("LateCopy.consume",), strict: bool = True, allow_ops: bool = True):
        import lingc.ops
        self.allow, self.strict, self.allow_ops = allow, strict, allow_ops
        self.violations: list[str] = []
        self._saved: dict[str, object] = {}
        self._ops_dir = str(Path(lingc.ops.__file__).parent) + os.sep

    def _allowed(self, frame) -> bool:
        f = frame
        while f is not None:
            code = f.f_code
            if (self.allow_ops and code.co_filename.startswith(self._ops_dir)) or code.co_qualname in self.allow:
                return True
            if "/torch/" not in code.co_filename:
                return False      # the first non-torch frame decides
            f = f.f_back
        return False

    def __enter__(self) -> "NoHostReads":
        for name in READ_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def patched(t, *a, _orig=original, _name=name, **k):
                frame = sys._getframe(1)
                if not self._allowed(frame):
                    where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
                    self.violations.append(f"Tensor.{_name} at {where}")
                    if self.strict:
                        raise HostReadError(f"host read of a device value on the step path: Tensor.{_name} at {where}")
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, patched)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
