"""Print a step graph as readable Python: one line per op, shape/dtype and pass annotations in comments.

Every stage the PassManager keeps is this text, so a pass-by-pass diff is a plain text diff.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from lingc.ops.registry import op_name
from lingc.program import Program, TensorMeta


def _fmt_meta(meta: object) -> str:
    if isinstance(meta, TensorMeta):
        return meta.short()
    if isinstance(meta, list):
        return "(" + ", ".join(_fmt_meta(m) for m in meta) + ")"
    return "-"


def _fmt_arg(a: object) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return str(a)
    if isinstance(a, float):
        return repr(a)
    return repr(a)


def annotations(node: fx.Node) -> str:
    """The pass annotations of a node, for its comment: pdl chain, compute dtype, layout, launch hints."""
    notes = []
    pdl = node.meta.get("lingc.pdl")
    if pdl:
        notes.append(f"pdl={pdl['chain']} {pdl['index'] + 1}/{pdl['length']}"
                     + (" early" if pdl["early_launch"] else ""))
    if "lingc.dtype" in node.meta:
        notes.append(f"dtype={node.meta['lingc.dtype']}")
    if "lingc.capture" in node.meta:
        notes.append(f"capture={node.meta['lingc.capture']}")
    if "lingc.stage" in node.meta and node.op == "call_function" and node.meta.get("lingc.scope") == "relay":
        notes.append(f"relay ({node.meta['lingc.stage']})")
    if "lingc.layout" in node.meta:
        notes.append(f"layout={node.meta['lingc.layout']}")
    hints = node.meta.get("lingc.launch")
    if isinstance(hints, dict) and hints:                 # Triton-launcher hints (docs/ir.md): the ones set, by name
        notes.append("launch=" + ",".join(sorted(k if v is True else f"{k}:{v}" for k, v in hints.items()
                                                 if v is not False)))
    return ("  " + " ".join(notes)) if notes else ""


def graph_text(name: str, graph: fx.Graph, weight_info: dict | None = None) -> str:
    """`def name(inputs):` then weights, ops and the return, one per line."""
    weight_info = weight_info or {}
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    lines = [f"def {name}("]
    lines += [f"    {n.name}: {_fmt_meta(n.meta.get('lingc.tensor'))}," for n in inputs]
    lines.append("):")
    for n in graph.nodes:
        if n.op == "get_attr":
            info = weight_info.get(n.target, {})
            extra = "".join(f" {k}={v}" for k, v in sorted(info.items()))
            lines.append(f"    {n.name} = weight['{n.target}']  # {_fmt_meta(n.meta.get('lingc.tensor'))}{extra}")
        elif n.op == "call_function":
            args = [_fmt_arg(a) for a in n.args] + [f"{k}={_fmt_arg(v)}" for k, v in n.kwargs.items()]
            lines.append(f"    {n.name} = {op_name(n.target)}({', '.join(args)})"
                         f"  # {_fmt_meta(n.meta.get('lingc.tensor'))}{annotations(n)}")
        elif n.op == "output":
            lines.append(f"    return {_fmt_arg(n.args[0])}")
    return "\n".join(lines) + "\n"


def program_text(program: Program, header: str = "") -> str:
    """All graphs of a program, in a fixed order, under an optional provenance header."""
    parts = [header.rstrip() + "\n"] if header else []
    for name in sorted(program.graphs):
        parts.append(graph_text(name, program.graphs[name], program.weight_info))
    return "\n".join(parts)
