"""Helpers shared by the kernel tests (tests/kernels is on sys.path, as pytest puts a test's directory there)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """torch.empty returns NaN (floats) / -777 (ints) inside the block, so an unwritten output cell shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.dtype.is_floating_point else -777)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def poison_float_empty(monkeypatch) -> None:
    """For the rest of a test, torch.empty returns NaN-filled float tensors (other dtypes as torch makes them), so a
    float output cell a launcher allocates and its kernel never writes shows. monkeypatch restores it."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def pretend_sm90(monkeypatch, module) -> None:
    """For the rest of a test, a Gluon module's `eligible` (kda_gluon, router_gluon, mla_gluon) sees a CUDA sm_90 device: no
    interpreter, compute capability 9, the device index taken as given."""
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(module, "_major", lambda device: 9)
    monkeypatch.setattr(module, "indexed", lambda device: device)


class BrokenGluonKernel:
    """A Gluon kernel stand-in whose launch fails as another Triton's Gluon API would (the AttributeError message names
    the missing attribute), for the kernels/gluon_launch.py fallback tests."""

    def __init__(self, missing: str) -> None:
        self.missing = missing

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise AttributeError(f"module 'gluon' has no attribute '{self.missing}'")
        return launch
