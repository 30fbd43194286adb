"""Greedy NEXTN == plain decode on the Triton kernels (the interpreter), which holds only if every kernel is row
invariant: a verify chain position computes exactly what a decode step computes.

Its own file (pytest-xdist's --dist loadfile keeps a file on one worker): the two generations are the suite's
longest test (~3-4 minutes on 2 cores), so they run beside test_lowering.py rather than after it.
"""

from __future__ import annotations

import pytest

from lingc.runtime.engine import Engine, Request

pytestmark = pytest.mark.usefixtures("few_linear_programs")


def test_greedy_nextn_equals_plain_on_kernels(tiny_partitioned_bf16) -> None:
    """The verify chain reproduces decode's tokens exactly. A one-token prompt: its prefill is one decode step (the
    chain positions compared are the generated ones either way), two interpreter graph runs fewer an engine."""
    prompt, n = [11], 6
    out = {spec: Engine(tiny_partitioned_bf16, "cpu", spec, backend="triton").generate(
        Request(prompt, n, ignore_eos=True)).tokens for spec in ("nextn", "none")}
    assert len(out["none"]) == n
    assert out["nextn"] == out["none"]
