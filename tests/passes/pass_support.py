"""Helpers shared by the pass tests (tests/passes is on sys.path): op counts per graph, a program cut to some graphs."""

from __future__ import annotations

from lingc.passes.base import op_counts
from lingc.program import Program


def count(program: Program, graph: str, op: str) -> int:
    """Calls of lingc.<op> in one graph of `program`."""
    return op_counts(program.graphs[graph]).get(f"lingc.{op}", 0)


def only(program: Program, graphs: tuple[str, ...]) -> Program:
    """A copy of `program` with only `graphs` (numerics checks on the decode-sized graphs keep a test cheap)."""
    new = program.copy()
    new.graphs = {g: new.graphs[g] for g in graphs}
    return new
