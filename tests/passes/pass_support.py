"""Helpers shared by the pass tests (tests/passes is on sys.path): op counts per graph, a program cut to some graphs."""

from __future__ import annotations

from lingc.passes.base import op_counts
from lingc.passes.matchers import is_free
from lingc.program import Program


def count(program: Program, graph: str, op: str) -> int:
    """Calls of lingc.<op> in one graph of `program`."""
    return op_counts(program.graphs[graph]).get(f"lingc.{op}", 0)


def launches(program: Program, graph: str) -> int:
    """Nodes of one graph that launch work (calls that are not free views / getitems)."""
    return sum(1 for n in program.graphs[graph].nodes if n.op == "call_function" and not is_free(n))


def only(program: Program, graphs: tuple[str, ...]) -> Program:
    """A copy of `program` with only `graphs` (numerics checks on the decode-sized graphs keep a test cheap)."""
    new = program.copy()
    new.graphs = {g: new.graphs[g] for g in graphs}
    return new
