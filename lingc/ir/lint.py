"""Checks a Program after every pass: well-formed graphs, allowlisted ops, weights present and typed, no dead ops.

Like Thunder's check_trace: a pass that leaves the IR broken fails here, named, not later at run time.
"""

from __future__ import annotations

import torch.fx as fx

from lingc.ir.serialize import allowed_ops
from lingc.ops.registry import HINTS, op_name
from lingc.program import Program, TensorMeta


class LintError(ValueError):
    """The IR is malformed; the message names the graph and node."""


def _has_side_effects(node: fx.Node) -> bool:
    """A mutable schema, or a hint op (lingc.ops.registry HINTS: kept though nothing reads it)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable) or op_name(node.target).removeprefix("lingc.") in HINTS


def lint(program: Program) -> None:
    """Raise LintError on the first problem found."""
    allowed = set(allowed_ops())
    for name, graph in program.graphs.items():
        try:
            graph.lint()
        except Exception as e:  # fx raises RuntimeError / AssertionError with its own message
            first = str(e).strip().splitlines()[0][:500]      # fx appends the whole graph; keep its verdict
            raise LintError(f"graph '{name}': {first}") from None
        outputs = [n for n in graph.nodes if n.op == "output"]
        if len(outputs) != 1:
            raise LintError(f"graph '{name}': has {len(outputs)} output nodes, want 1")
        for node in graph.nodes:
            where = f"graph '{name}', node '{node.name}'"
            if node.op == "placeholder" and "lingc.input" not in node.meta:
                raise LintError(f"{where}: input has no 'lingc.input' role")
            if node.op == "get_attr":
                if node.target not in program.weights:
                    raise LintError(f"{where}: reads weight '{node.target}', which the program does not have")
                w, m = program.weights[node.target], node.meta.get("lingc.tensor")
                if not isinstance(m, TensorMeta) or (tuple(w.shape), w.dtype) != (m.shape, m.dtype):
                    raise LintError(f"{where}: meta {m} does not match weight {list(w.shape)} {w.dtype}")
            if node.op == "call_function":
                if op_name(node.target) not in allowed:
                    raise LintError(f"{where}: op '{op_name(node.target)}' is not in the lingc allowlist")
                if not node.users and not _has_side_effects(node):
                    raise LintError(f"{where}: result unused and the op has no side effects (dead code)")
                if "lingc.tensor" not in node.meta and not _has_side_effects(node):
                    raise LintError(f"{where}: no 'lingc.tensor' meta (run lingc.ir.shapes.propagate)")
