"""kernels/carveout.py: LINGC_SMEM_CARVEOUT is parsed strictly (default 100), and unless it is "none" its hook is
chained onto Triton's kernel_load_end_hook for lingc's own kernels only (the attribute call itself needs a GPU; bench/device_step.py A/Bs it
on the H200)."""

from __future__ import annotations

import pytest
import triton

from lingc.kernels import carveout


@pytest.mark.parametrize("raw,want", [("", 100), ("none", None), ("NONE", None), ("0", 0), ("100", 100), (" 50 ", 50)])
def test_percent_parses(raw: str, want: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(carveout.ENV, raw)
    assert carveout.carveout_percent() == want


@pytest.mark.parametrize("raw", ["101", "-1", "max", "1.5"])
def test_bad_percent_names_the_variable(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(carveout.ENV, raw)
    with pytest.raises(ValueError, match=f"LINGC_SMEM_CARVEOUT={raw!r}"):
        carveout.carveout_percent()


def test_install_chains_the_load_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "kernel_load_end_hook", lambda *args: seen.append(args[2]))
    monkeypatch.setenv(carveout.ENV, "none")
    assert not carveout.install()
    monkeypatch.setenv(carveout.ENV, "100")
    calls = []
    monkeypatch.setattr(carveout, "_set_carveout", lambda percent: lambda *args: calls.append((percent, args[2])))
    assert carveout.install()
    triton.knobs.runtime.kernel_load_end_hook(None, 0, "k", None, "h")
    assert seen == ["k"] and calls == [(100, "k")]


def test_only_lingc_kernels_are_named() -> None:
    """The hook acts on lingc's kernels only: their names come from the triton.jit functions of lingc.kernels."""
    import lingc.kernels.linear  # noqa: F401
    import lingc.kernels.rmsnorm  # noqa: F401
    names = carveout.lingc_kernel_names()
    assert {"_linear_dot_kernel", "_linear_fma_kernel"} <= names
    assert not any(n.startswith("triton_") for n in names)      # Inductor's kernels are named triton_*


def test_hook_skips_other_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that is not lingc's is never handed to the driver call (which would need libcuda, absent here)."""
    hook = carveout._set_carveout(100)
    hook(None, 0, "triton_poi_fused_add_0", None, "h")           # returns before opening libcuda


def test_a_failed_driver_call_warns_once_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The carveout is a hint: a driver error on a lingc kernel is one RuntimeWarning, never an exception."""
    import lingc.kernels.linear  # noqa: F401

    class FakeCuda:
        def cuFuncSetAttribute(self, *args) -> int:
            return 1                                               # CUDA_ERROR_INVALID_VALUE

    monkeypatch.setattr(carveout.ctypes, "CDLL", lambda name: FakeCuda())
    hook = carveout._set_carveout(100)
    with pytest.warns(RuntimeWarning, match="_linear_dot_kernel failed with CUresult 1"):
        hook(None, 0, "_linear_dot_kernel", None, "h")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hook(None, 0, "_linear_fma_kernel", None, "h")             # once only
