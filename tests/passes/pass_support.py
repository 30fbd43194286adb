"""Helpers shared by the pass tests (tests/passes is on sys.path): op counts per graph, a program cut to some graphs,
the reference backend's bit-exactness between two stages, greedy NEXTN against plain decoding on the CPU engine."""

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


def assert_reference_exact(before: Program, after: Program, graphs: tuple[str, ...]) -> None:
    """`graphs` of the two stages give the same bits on the reference backend (passes/verify.py compare_stages)."""
    from lingc.passes.verify import compare_stages

    report = compare_stages(only(before, graphs), only(after, graphs), exact=True, tolerance=None)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}


def greedy_tokens(program: Program, spec: str, n: int = 10) -> list[int]:
    """The CPU engine's greedy tokens for one fixed prompt, speculating with `spec` ("nextn" or "none")."""
    from lingc.runtime.engine import Engine, Request

    return Engine(program, "cpu", spec).generate(Request([11, 22, 33], n, ignore_eos=True)).tokens


def assert_greedy_nextn_equals_plain(program: Program, n: int = 10) -> None:
    """NEXTN speculation gives plain decoding's n greedy tokens on the CPU engine (the pass tests' parity gate)."""
    tokens = {spec: greedy_tokens(program, spec, n) for spec in ("nextn", "none")}
    assert len(tokens["none"]) == n and tokens["nextn"] == tokens["none"]
