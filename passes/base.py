"""The Pass interface: a named, declared rewrite of a Program that returns a record of what it changed.

A pass subclasses `Pass`, sets `name`, `summary`, `requires` / `after` (ordering), `changes_numerics`
(and `tolerance` when it does), and implements `apply(program) -> details` on a copy the base class
made. `run` times it, re-infers shapes and diffs the graphs and weights into a `PassRecord`.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch.fx as fx

from lingc.ir.shapes import propagate
from lingc.ops.registry import op_name
from lingc.program import Program


@dataclass
class PassRecord:
    """What one pass did. Node ids are 'graph:node'; weights by name."""

    name: str
    version: str
    changes_numerics: bool
    ms: float = 0.0
    matches: int = 0
    nodes_added: list[str] = field(default_factory=list)
    nodes_removed: list[str] = field(default_factory=list)
    nodes_rewritten: list[str] = field(default_factory=list)
    weights_added: list[str] = field(default_factory=list)
    weights_removed: list[str] = field(default_factory=list)
    weights_changed: list[str] = field(default_factory=list)
    op_counts_before: dict[str, dict[str, int]] = field(default_factory=dict)
    op_counts_after: dict[str, dict[str, int]] = field(default_factory=dict)
    tolerance: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    verify: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.name}: {self.matches} match(es), +{len(self.nodes_added)} -{len(self.nodes_removed)} "
                f"~{len(self.nodes_rewritten)} nodes, {len(self.weights_changed) + len(self.weights_added)} "
                f"weight(s) written, {self.ms:.1f} ms")


def op_counts(graph: fx.Graph) -> dict[str, int]:
    """Calls per op name ('lingc.moe_up': 5), the op-count view tests and `lingc diff` use."""
    return dict(sorted(Counter(op_name(n.target) for n in graph.nodes if n.op == "call_function").items()))


def _signature(node: fx.Node) -> tuple:
    meta = {k: v for k, v in node.meta.items() if k not in ("lingc.tensor", "lingc.scope")}
    args = fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)
    return (node.op, str(node.target), repr(args), repr(sorted(meta.items(), key=lambda kv: kv[0])))


class Pass:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()     # must also run, before this one
    after: ClassVar[tuple[str, ...]] = ()        # if also requested, run before this one
    changes_numerics: ClassVar[bool] = False
    tolerance: ClassVar[float | None] = None     # max |delta| of float outputs --verify accepts (numerics changed)
    in_all: ClassVar[bool] = True                # False: opt-in, only when named (it measured slower on the H200)

    @classmethod
    def version(cls) -> str:
        """Hash of the pass's source file, so a changed pass shows as a new version in manifests."""
        source = inspect.getsource(sys.modules[cls.__module__])
        return hashlib.sha256(source.encode()).hexdigest()[:12]

    def apply(self, program: Program) -> dict[str, Any]:
        """Rewrite `program` (a private copy) in place; return details, including 'matches'."""
        raise NotImplementedError

    def run(self, program: Program) -> tuple[Program, PassRecord]:
        new = program.copy()
        start = time.perf_counter()
        details = self.apply(new)
        ms = (time.perf_counter() - start) * 1e3
        propagate(new)
        record = PassRecord(self.name, self.version(), self.changes_numerics, ms, int(details.pop("matches", 0)),
                            tolerance=self.tolerance, details=details)
        _diff_into(record, program, new)
        return new, record


def _diff_into(record: PassRecord, old: Program, new: Program) -> None:
    for gname in sorted(set(old.graphs) | set(new.graphs)):
        before = {n.name: n for n in old.graphs[gname].nodes} if gname in old.graphs else {}
        after = {n.name: n for n in new.graphs[gname].nodes} if gname in new.graphs else {}
        record.nodes_added += [f"{gname}:{n}" for n in after if n not in before]
        record.nodes_removed += [f"{gname}:{n}" for n in before if n not in after]
        record.nodes_rewritten += [f"{gname}:{n}" for n in after
                                   if n in before and _signature(after[n]) != _signature(before[n])]
        if gname in old.graphs:
            record.op_counts_before[gname] = op_counts(old.graphs[gname])
        if gname in new.graphs:
            record.op_counts_after[gname] = op_counts(new.graphs[gname])
    record.weights_added = sorted(new.weights.keys() - old.weights.keys())
    record.weights_removed = sorted(old.weights.keys() - new.weights.keys())
    record.weights_changed = sorted(k for k in new.weights.keys() & old.weights.keys()
                                    if new.weights[k] is not old.weights[k])
