"""Graph helpers shared by the passes: find ops, follow producers through view ops, move and erase nodes."""

from __future__ import annotations

import operator
from typing import Iterator

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program

aten = torch.ops.aten
# ops that launch no kernel: a chain of kernels stays a chain across them
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.split_with_sizes.default,
            aten.split.Tensor, aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int,
            aten.permute.default, aten.transpose.int, aten.expand.default}
# the node.meta a rewrite carries from the node it replaces to the new one (docs/ir.md "node.meta keys"); the other
# keys (shapes, dtypes, pdl chains, launch hints) are recomputed or re-derived by the passes that own them
KEEP_META = ("lingc.scope", "lingc.stage")
KEEP_META_CAPTURE = (*KEEP_META, "lingc.capture")   # also capture_metadata's group, for rewrites after that pass


def is_free(node: fx.Node) -> bool:
    """True for nodes that cost no kernel launch: inputs, weights, views, tuple element reads."""
    return node.op in ("placeholder", "get_attr") or node.target in VIEW_OPS or node.target is operator.getitem


def written_inputs(node: fx.Node) -> set[fx.Node]:
    """Inputs an op updates in place: the arguments its schema marks as written, every tensor of a written list
    (scatter_rows_multi's tables)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return set()
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    named = dict(zip([a.name for a in schema.arguments], node.args)) | dict(node.kwargs)
    out: set[fx.Node] = set()
    for key, value in named.items():
        if key in written:
            out |= {v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)}
    return out


def base_buffer(node):
    """The buffer a value reads, looking through views (a pool or cache seen through views is that buffer)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEW_OPS:
        node = node.args[0]
    return node


def written_buffers(node: fx.Node) -> set:
    """The buffers an op updates in place: its written inputs (written_inputs), looked through views."""
    return {base_buffer(v) for v in written_inputs(node)}


def calls(graph: fx.Graph, op_short: str) -> list[fx.Node]:
    """Every call of torch.ops.lingc.<op_short> in graph order."""
    target = OPS[op_short]
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def getitems(node: fx.Node) -> dict[int, list[fx.Node]]:
    """Output index -> the getitem nodes reading it (a multi-output op's readers)."""
    out: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.target is operator.getitem:
            out.setdefault(user.args[1], []).append(user)
    return out


def align_readers(src: fx.Node, first: int) -> tuple[fx.Node, fx.Node] | str:
    """(moe_up_act, moe_down) when exactly those two read the align outputs of `src` (its getitems first .. first + 2:
    sorted_pairs, block_expert, total; first = 2 for router_align, 0 for moe_align), or why not."""
    reads = getitems(src)
    aligned = [g for i in range(first, first + 3) for g in reads.get(i, [])]
    readers = list(dict.fromkeys(u for g in aligned for u in g.users))
    ups = [r for r in readers if r.target is OPS.moe_up_act]
    downs = [r for r in readers if r.target is OPS.moe_down]
    if len(ups) != 1 or len(downs) != 1 or len(readers) != 2:
        return f"{src.name}: its blocks are read by {sorted(str(r.target) for r in readers)}, not one moe_up_act " \
               "and one moe_down"
    return ups[0], downs[0]


def output_getitem(graph: fx.Graph, node: fx.Node, index: int, name: str,
                   keep: tuple[str, ...] = KEEP_META) -> fx.Node:
    """A getitem of output `index` of multi-output `node`: the first existing one, else one made right after `node`,
    named `name` (made unique in the graph: auto getitem_N names clash on reload), with node's `keep` meta and, where
    node's lingc.tensor lists its outputs, that output's."""
    found = getitems(node).get(index)
    if found:
        return found[0]
    with graph.inserting_after(node):
        item = graph.call_function(operator.getitem, (node, index))
    item.meta = carried_meta(node, keep)
    outputs = node.meta.get("lingc.tensor")
    if isinstance(outputs, (list, tuple)) and index < len(outputs):
        item.meta["lingc.tensor"] = outputs[index]
    item._rename(name)
    return item


def producer(node: fx.Node) -> fx.Node:
    """The kernel node that made `node`'s value, looking through views and getitems."""
    while node.op == "call_function" and is_free(node):
        node = node.args[0]
    return node


def consumers(node: fx.Node) -> Iterator[fx.Node]:
    """Kernel nodes that read `node`'s value, looking through views and getitems."""
    for user in node.users:
        if user.op == "call_function" and is_free(user):
            yield from consumers(user)
        else:
            yield user


def weight_users(program: Program, name: str) -> int:
    return sum(1 for g in program.graphs.values() for n in g.nodes if n.op == "get_attr" and n.target == name)


def get_weight_node(graph: fx.Graph, name: str, before: fx.Node) -> fx.Node:
    """The get_attr node of weight `name` in graph, created before `before` if the graph has none."""
    for n in graph.nodes:
        if n.op == "get_attr" and n.target == name:
            return n
    with graph.inserting_before(before):
        node = graph.get_attr(name)
    node._rename("w_" + name.replace(".", "_").replace("model_layers_", "L"))
    return node


def drop_unused_weights(program: Program) -> list[str]:
    """Erase get_attr nodes nobody reads and weights no graph reads; returns the dropped weight names."""
    for graph in program.graphs.values():
        for n in list(graph.nodes):
            if n.op == "get_attr" and not n.users:
                graph.erase_node(n)
    dropped = [k for k in program.weights if weight_users(program, k) == 0]
    for k in dropped:
        del program.weights[k]
        program.weight_info.pop(k, None)
    return dropped


def carried_meta(node: fx.Node, keys: tuple[str, ...] = KEEP_META) -> dict:
    """The entries of node.meta under `keys` (those it has): what a rewrite copies onto the node replacing it."""
    return {k: node.meta[k] for k in keys if k in node.meta}


def add_rmsnorm_reader(node: fx.Node) -> tuple[fx.Node | None, fx.Node, fx.Node] | None:
    """(view or None, add_rmsnorm, the add's other argument) when `node`'s only reader is an add_rmsnorm, directly or
    through one view that only the add_rmsnorm reads (either argument of the add: it is commutative bit for bit)."""
    def only_user(n: fx.Node) -> fx.Node | None:
        users = list(n.users)
        return users[0] if len(users) == 1 else None

    user = only_user(node)
    view = None
    if user is not None and user.target is aten.view.default and user.args[0] is node:
        view, user = user, only_user(user)
    if user is None or user.target is not OPS.add_rmsnorm:
        return None
    src = view if view is not None else node
    a, b = user.args[0], user.args[1]
    if a is src and b is not src:
        return view, user, b
    if b is src and a is not src:
        return view, user, a
    return None


def replace_add_rmsnorm(graph: fx.Graph, norm: fx.Node, fused: fx.Node, tag: str, *gone: fx.Node | None) -> fx.Node:
    """`fused` (inserted before the add_rmsnorm `norm`, returning its (normed, new residual)) takes its place: the
    norm's scope / stage meta, its name with add_rmsnorm -> <tag>_add_rmsnorm, its readers. Then `norm` and `gone`
    (what only the norm read: the fused producer, a view of it; None entries skipped) are erased, in that order."""
    fused.meta = carried_meta(norm)
    fused._rename(norm.name.replace("add_rmsnorm", f"{tag}_add_rmsnorm") if "add_rmsnorm" in norm.name
                  else f"{norm.name}_{tag}")
    norm.replace_all_uses_with(fused)
    graph.erase_node(norm)
    for node in gone:
        if node is not None:
            graph.erase_node(node)
    return fused
