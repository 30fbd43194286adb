"""PassManager: order the requested passes, run them, lint and snapshot after each, optionally verify.

Order: a networkx DAG over the requested passes with an edge a -> b when b declares `after` a or
`requires` a; ties keep the user's order (lexicographic topological sort keyed on it). `requires`
pulls in a missing pass. Unknown names and cycles are errors that list the known passes / the cycle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import networkx as nx

from lingc.ir.lint import LintError, lint
from lingc.ir.text import program_text
from lingc.passes.base import Pass, PassRecord
from lingc.passes.verify import compare_stages
from lingc.program import Program

log = logging.getLogger(__name__)


class PassOrderError(ValueError):
    """Bad --passes: unknown name or a constraint cycle."""


@dataclass
class Stage:
    """A snapshot after one pass (index 0 is the traced program)."""

    index: int
    name: str
    text: str
    record: PassRecord | None = None


@dataclass
class CompileResult:
    program: Program
    stages: list[Stage] = field(default_factory=list)

    @property
    def records(self) -> list[PassRecord]:
        return [s.record for s in self.stages if s.record is not None]


def resolve(names: list[str], registry: dict[str, type[Pass]]) -> list[type[Pass]]:
    """The passes to run, in order. 'all' means every registered pass but the opt-in ones (`in_all = False`), which
    run only when named (`--passes all,fuse_moe`)."""
    names = [n.strip() for n in names if n.strip()]
    if "all" in names:
        names = [n for n in names if n != "all"] + [n for n in registry if n not in names and registry[n].in_all]
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise PassOrderError(f"unknown pass(es) {unknown}; known passes: {', '.join(sorted(registry))}, all")
    wanted = list(dict.fromkeys(names))
    i = 0
    while i < len(wanted):                       # pull in what requested passes require
        for req in registry[wanted[i]].requires:
            if req not in registry:
                raise PassOrderError(f"pass '{wanted[i]}' requires '{req}', which is not a known pass")
            if req not in wanted:
                log.info("adding pass %s (required by %s)", req, wanted[i])
                wanted.append(req)
        i += 1
    dag = nx.DiGraph()
    dag.add_nodes_from(wanted)
    for name in wanted:
        cls = registry[name]
        for before in set(cls.after) | set(cls.requires):
            if before in dag:
                dag.add_edge(before, name)
    rank = {n: i for i, n in enumerate(wanted)}
    try:
        ordered = list(nx.lexicographical_topological_sort(dag, key=rank.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = " -> ".join(a for a, _ in nx.find_cycle(dag))
        raise PassOrderError(f"pass ordering constraints form a cycle: {cycle}") from None
    return [registry[n] for n in ordered]


class PassManager:
    def __init__(self, names: list[str], registry: dict[str, type[Pass]] | None = None, verify: bool = False):
        if registry is None:
            from lingc.passes import PASSES
            registry = PASSES
        self.passes = [cls() for cls in resolve(names, registry)]
        self.verify = verify

    def run(self, program: Program) -> CompileResult:
        lint(program)
        result = CompileResult(program, [Stage(0, "traced", program_text(program, "# stage 00: traced"))])
        for i, p in enumerate(self.passes, start=1):
            new, record = p.run(program)
            try:
                lint(new)
            except LintError as e:
                raise LintError(f"after pass '{p.name}': {e}") from None
            if self.verify:
                record.verify = compare_stages(program, new, exact=not p.changes_numerics, tolerance=p.tolerance,
                                               splits=getattr(p, "splits", None), variants=getattr(p, "variants", None))
                if not record.verify["ok"]:
                    bad = {g: r["problems"] for g, r in record.verify["graphs"].items() if r["problems"]}
                    raise VerifyError(f"--verify failed after pass '{p.name}': {bad}")
            header = (f"# stage {i:02d}: {p.name} (v{record.version}, {record.ms:.1f} ms, "
                      f"+{len(record.nodes_added)} -{len(record.nodes_removed)} ~{len(record.nodes_rewritten)} nodes, "
                      f"numerics {'changed' if p.changes_numerics else 'unchanged'})")
            result.stages.append(Stage(i, p.name, program_text(new, header), record))
            log.info(record.summary())
            program = new
        result.program = program
        return result


class VerifyError(AssertionError):
    """A stage's outputs differ from the previous stage's beyond what its pass declares."""
