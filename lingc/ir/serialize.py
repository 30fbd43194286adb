"""Graphs to and from JSON. Ops resolve only through an allowlist: torch.ops.lingc.* plus a few aten view ops.

Loading a graph never imports, evaluates or unpickles anything: every call target is looked up by
name in `allowed_ops()`, every argument is a JSON value, a node reference or a dtype name.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.ops.registry import op_name
from lingc.program import TensorMeta, dtype_from_name, dtype_name

aten = torch.ops.aten
# shape / layout ops the model's forward uses between lingc ops; none of them computes anything
ATEN_ALLOWED = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.split_with_sizes.default,
                aten.split.Tensor, aten.unsqueeze.default, aten.squeeze.dim, aten.cat.default, aten.add.Tensor,
                aten.sub.Tensor,
                aten.slice.Tensor, aten.select.int, aten.permute.default, aten.transpose.int, aten.expand.default,
                aten.clone.default)
META_KEYS = ("lingc.scope", "lingc.stage", "lingc.input", "lingc.pdl", "lingc.dtype", "lingc.layout", "lingc.relay",
             "lingc.capture", "lingc.launch")


class IRError(ValueError):
    """A graph file lingc refuses to load; the message names the graph, node and what is wrong."""


def allowed_ops() -> dict[str, Any]:
    """Name -> callable, for every op a graph file may name."""
    table: dict[str, Any] = {op_name(op): op for op in OPS.values()}
    table.update({op_name(op): op for op in ATEN_ALLOWED})
    table["getitem"] = operator.getitem
    return table


def _enc(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    if isinstance(a, (list, tuple)):
        return [_enc(x) for x in a]
    if isinstance(a, float) and not math.isfinite(a):
        return {"float": repr(a)}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise IRError(f"cannot serialise argument {a!r} of type {type(a).__name__}")


def _dec(a: Any, env: dict[str, fx.Node], where: str) -> Any:
    if isinstance(a, list):
        return [_dec(x, env, where) for x in a]
    if isinstance(a, dict):
        if "node" in a:
            if a["node"] not in env:
                raise IRError(f"{where}: uses '{a['node']}' before it is defined")
            return env[a["node"]]
        try:
            if "dtype" in a:
                return dtype_from_name(a["dtype"])
            if "float" in a:
                return float(a["float"])
        except (ValueError, TypeError) as e:    # a bad dtype name or float text: say where
            raise IRError(f"{where}: {e}") from None
        raise IRError(f"{where}: unknown argument object {a}")
    return a


def _meta_enc(node: fx.Node) -> dict[str, Any]:
    out = {k: node.meta[k] for k in META_KEYS if k in node.meta}
    t = node.meta.get("lingc.tensor")
    if t is not None:
        out["lingc.tensor"] = t.to_json() if isinstance(t, TensorMeta) else [x.to_json() if x else None for x in t]
    return out


def _meta_dec(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in d.items() if k != "lingc.tensor"}
    t = d.get("lingc.tensor")
    if isinstance(t, dict):
        out["lingc.tensor"] = TensorMeta.from_json(t)
    elif isinstance(t, list):
        out["lingc.tensor"] = [TensorMeta.from_json(x) if x else None for x in t]
    return out


def graph_to_json(graph: fx.Graph) -> list[dict[str, Any]]:
    nodes = []
    for n in graph.nodes:
        entry: dict[str, Any] = {"name": n.name, "op": n.op}
        if n.op in ("placeholder", "get_attr"):
            entry["target"] = n.target
        elif n.op == "call_function":
            entry["target"] = op_name(n.target)
            entry["args"] = _enc(list(n.args))
            entry["kwargs"] = {k: _enc(v) for k, v in n.kwargs.items()}
        elif n.op == "output":
            entry["args"] = _enc(list(n.args))
        else:
            raise IRError(f"node {n.name}: op kind {n.op!r} is not part of the lingc IR")
        entry["meta"] = _meta_enc(n)
        nodes.append(entry)
    return nodes


def graph_from_json(nodes: list[dict[str, Any]], name: str = "graph") -> fx.Graph:
    """Rebuild an fx.Graph; unknown ops, node kinds or forward references are IRErrors."""
    table = allowed_ops()
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for i, entry in enumerate(nodes):
        node_name = entry.get("name", f"#{i}")
        where = f"graph '{name}', node '{node_name}'"
        kind = entry.get("op")
        if kind == "placeholder":
            node = graph.placeholder(str(entry["target"]))
        elif kind == "get_attr":
            node = graph.get_attr(str(entry["target"]))
        elif kind == "call_function":
            target = entry.get("target")
            if target not in table:
                raise IRError(f"{where}: unknown op '{target}' (not in the lingc allowlist)")
            args = tuple(_dec(entry.get("args", []), env, where))
            kwargs = {k: _dec(v, env, where) for k, v in entry.get("kwargs", {}).items()}
            # named at creation: call_function would first reserve an automatic name ('getitem'), which a later
            # node of that name could then not have (a getitem that keeps a fused node's name, fuse_relay / fuse_kda)
            node = graph.create_node("call_function", table[target], args, kwargs, name=node_name)
        elif kind == "output":
            args = _dec(entry.get("args", []), env, where)
            out = args[0]
            node = graph.output(tuple(out) if isinstance(out, list) else out)
        else:
            raise IRError(f"{where}: unknown node kind {kind!r}")
        if kind != "output":
            node._rename(node_name)
            if node.name != node_name:
                raise IRError(f"{where}: duplicate node name")
            env[node_name] = node
        try:
            node.meta = _meta_dec(entry.get("meta", {}))
        except (ValueError, TypeError, KeyError) as e:
            raise IRError(f"{where}: bad meta ({type(e).__name__}: {e})") from None
    return graph
