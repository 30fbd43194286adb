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


# PTX comparisons of kernels compiled offline for sm_90 (the *_sm90 tests): the float arithmetic and shuffles of a
# row reduction, which decide its bits on the GPU


def sm90_ptx(fn, sig: dict, const: dict, div16: list[str], warps: int) -> list[str]:
    """The PTX instruction lines of Triton kernel `fn` compiled for sm_90 (no GPU needed) with argument types `sig`,
    constexprs `const`, the arguments in `div16` specialised as divisible by 16 (as a launch with aligned tensors and
    strides is). Run it in a process without TRITON_INTERPRET (the *_sm90 tests' subprocesses)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}), constexprs=const, attrs=attrs)
    text = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    return [l.strip() for l in text.splitlines() if re.match(r"\s+[a-z@]", l) and not l.strip().startswith(".")]

PTX_REDUCTION_OPS = ("mul.f32", "fma.rn.f32", "add.f32", "shfl.sync.bfly.b32", "div.full.f32", "rsqrt.approx.ftz.f32")


def ptx_reduction(lines: list[str]) -> list[str]:
    """From the first square (mul.f32 r, x, x) to the rsqrt: the arithmetic and shuffles, registers renamed in order of
    appearance (so two kernels' sequences compare as dataflow)."""
    start = next(i for i, l in enumerate(lines)
                 if l.startswith("mul.f32") and len(set(l.rstrip(";").replace(",", " ").split()[2:])) == 1)
    end = next(i for i, l in enumerate(lines) if l.startswith("rsqrt"))
    names: dict[str, str] = {}
    out = []
    for line in lines[start:end + 1]:
        op, _, rest = line.partition(" ")
        if op in PTX_REDUCTION_OPS:
            regs = [names.setdefault(r, f"v{len(names)}") if r.startswith("%") else r
                    for r in rest.rstrip(";").replace(",", " ").split()]
            out.append(" ".join([op, *regs]))
    return out


def ptx_op(line: str) -> str:
    """The opcode of a PTX line, past a predicate guard (`@%p1 ld.global...`)."""
    words = line.split()
    return words[1] if words[0].startswith("@") else words[0]
