"""Kernel tests run in the Triton CPU interpreter (shared/docs/kernels.md section 2).

TRITON_INTERPRET must be set before any `@triton.jit` kernel is decorated: triton.jit reads it at decoration
time. This conftest is imported before the test modules of this directory, and nothing else in the suite
imports lingc.kernels.*. Per-dtype tolerances for all kernel tests live here (fixture `assert_kernel_close`).

The Triton 3.6 interpreter rounds fp32 -> bf16 casts toward zero (`cast_impl` passes no rounding mode to
`_convert_float`, which then truncates; its RTNE branch rounds half up and drops the mantissa carry), while
the GPU rounds to nearest even, as torch does. `_rne_bf16_casts` makes the interpreter round like the GPU so
that bf16 results can be compared bit for bit; without it bf16 outputs are off by an ulp or two
and the fused residual is not bit-identical to torch's `residual + x`.

It also keeps bf16 as raw uint16 inside `tl.dot` and would multiply the bit patterns; `_bf16_dots` widens bf16
operands to fp32 first, which is what the GPU's bf16 MMA does (exact products, fp32 accumulation), and computes
fp32 dots in float64 rounded once per element, so an element's bits do not depend on the BLAS kernel numpy picks
for its column (they did on an AMD EPYC host).

Speed only: the interpreter re-patches triton.language (`inspect.getmembers` over tl, tl.tensor and tl.math, ~1 ms)
at every call of a nested @triton.jit helper, although the launch has already patched the same modules with the same
builder and restores them when it ends. `_patch_lang_once_per_launch` skips a nested re-patch that the running
launch's patch already covers; every value stays the same (the same members, patched once instead of again).
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

# (rtol, atol) per activation dtype, against lingc's reference ops. fp32: summation order and rsqrt differ
# by a few ulp. bf16: a different fp32 rstd may flip one rounding of the output, i.e. 1 ulp <= 2^-7 * |value|
# (with the RNE shim below the interpreter is in fact bit-exact on the test inputs).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-6, 1e-6),
    torch.bfloat16: (2.0**-7, 1e-2),
}


def _fp32_to_bf16_rne(data: np.ndarray) -> np.ndarray:
    """fp32 array -> bf16 bits (uint16) rounded to nearest even, NaN kept quiet (as torch and PTX cvt.rn)."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(data, dtype=np.float32))
    rounded[nan] = ((bits[nan] >> 16).astype(np.uint16) | 0x0040)
    return rounded.reshape(np.shape(data))


def _assert_kernel_close(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[want.dtype]
    assert got.dtype == want.dtype, f"kernel output is {got.dtype}, want {want.dtype}"
    assert not got.isnan().any(), "kernel left unwritten (NaN-poisoned) elements"
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.fixture
def assert_kernel_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Compare a kernel output with its reference at the tolerance of the reference's dtype (TOLERANCES)."""
    return _assert_kernel_close


@pytest.fixture(autouse=True)
def _rne_bf16_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16 and rounding_mode in (None, tl.core.ir.ROUNDING_MODE.RTNE):
            return _fp32_to_bf16_rne(data)
        return original(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


@pytest.fixture(autouse=True)
def _bf16_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    original = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = widen(a), widen(b)
        if a.dtype.scalar == tl.float32 and b.dtype.scalar == tl.float32 and d.dtype.scalar == tl.float32:
            # one rounding per element: numpy's fp32 matmul goes through a BLAS whose kernels round an output
            # element differently by its column position (OpenBLAS on an AMD EPYC host), which made two kernels
            # that put the same dot in other columns (moe_up_act's interleaved w13) differ in the last bit
            prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
            return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(autouse=True)
def _patch_lang_once_per_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    original_patch, original_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    local = threading.local()          # per thread: the language modules the running launch has patched

    def launch(self, *args, **kwargs):
        outer = getattr(local, "langs", None)
        local.langs = set()            # filled by the launch's own _patch_lang call, restored by the launch itself
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            local.langs = outer

    def patch_lang(fn):
        current = getattr(local, "langs", None)
        if current is None:
            return original_patch(fn)  # not inside a launch: as Triton does
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if current and langs <= current:
            return None                # a nested helper call (its caller ignores the scope): already patched
        current |= langs               # the launch's own patch, or a helper that sees other language modules
        return original_patch(fn)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch)
    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)


@pytest.fixture
def few_linear_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's cost is per program: the table's 4-feature `fma` tiles for test-tiny's small weights make
    a NEXTN step take ~100 s. One 64 x 128 `dot` config for every shape (still independent of M, so still row
    invariant) makes it ~9 s; the table's configs themselves are tested in test_linear.py. For whole-program
    tests (test_lowering*.py: `pytestmark = pytest.mark.usefixtures("few_linear_programs")`)."""
    import lingc.kernels.linear as linear
    config = linear.LinearConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=1)
    monkeypatch.setattr(linear, "pick_config", lambda n, k, dtype: config)


@pytest.fixture(scope="module")
def tiny_partitioned_bf16(tiny_program_bf16):
    """The bf16 test-tiny program after every pass in `all` (a module's own copy)."""
    from lingc.passes.manager import PassManager
    return PassManager(["all"]).run(tiny_program_bf16).program

