"""fuse_projections: linears that read the same input with the same weight and output dtypes become one linear.

Before (a KDA layer: six projections of the normed hidden state x [B, T, h]; P = H * D):
    L0_attention_q_proj_linear = lingc.linear(L0_input_layernorm_rmsnorm, w_L0_attention_q_proj_weight)   # [B, T, P]
    ...                                                             # k, v, f [B, T, P], b [B, T, H], g [B, T, P]
After:
    w_L0_attention_fused_qkvfbg_weight = weight['model.layers.0.attention.fused_qkvfbg.weight']   # [5P + H, h]
    L0_attention_fused_qkvfbg_linear = lingc.linear(L0_input_layernorm_rmsnorm, w_L0_attention_fused_qkvfbg_weight)
    L0_attention_fused_qkvfbg_split = aten.split_with_sizes(L0_attention_fused_qkvfbg_linear, [P, P, P, P, H, P], -1)
    L0_attention_q_proj_linear = getitem(L0_attention_fused_qkvfbg_split, 0)                     # a view, [B, T, P]
    ...
The weights are concatenated along N at compile time, in graph order, into a new program weight named
after the fused ones (weight_info: fused_from, split); weights no graph reads any more are dropped. The
old linear nodes become the getitems (names kept), so their readers are untouched. Checkpoints load as
before: the loader never sees a fused weight.

The rule is exact: same input node, same weight dtype, same out_dtype argument (and the same NEXTN
stage). So the fp32 router (out_dtype fp32) never joins the bf16 shared-expert gate_up that reads the
same x, nor does it after bf16_router (its out_dtype still differs). Only first-level projections fuse:
MLA's q_b reads q_a's normed output, so q_a (or q) / kv_a / g fuse and q_b stays.

Numerics: every output column is its own dot product, so in exact arithmetic nothing changes; but a
GEMM's reduction order may depend on N and on a column's place in its tile (CPU MKL: an fp32 column
block that does not start on a tile boundary; oneDNN bf16 at some K / N; cuBLAS / Triton configs are
chosen per shape). It is bit-exact on test-tiny, yet not in general, so the pass declares a numerics
change with a tolerance and --verify checks logits and greedy parity.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import calls, carried_meta, drop_unused_weights, get_weight_node

aten = torch.ops.aten


def _out_dtype(lin: fx.Node) -> torch.dtype | None:
    return lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("out_dtype")


def _groups(program: Program, graph: fx.Graph) -> list[list[fx.Node]]:
    """Linears (graph order) sharing input node, weight dtype, out_dtype and stage, over two or more weights."""
    groups: dict[tuple, list[fx.Node]] = {}
    for lin in calls(graph, "linear"):
        weight = lin.args[1]
        if weight.op != "get_attr" or program.weights[weight.target].dim() != 2:
            continue
        key = (lin.args[0], program.weights[weight.target].dtype, _out_dtype(lin), lin.meta.get("lingc.stage"))
        groups.setdefault(key, []).append(lin)
    return [g for g in groups.values() if len({lin.args[1].target for lin in g}) > 1]


def fused_weight_name(names: list[str]) -> str:
    """'<common module>.fused_<tags>.weight', e.g. model.layers.0.attention.fused_qkvfbg.weight."""
    modules = [n.removesuffix(".weight").split(".") for n in names]
    common = 0
    while all(len(m) > common + 1 and m[common] == modules[0][common] for m in modules):
        common += 1
    tags = [re.sub(r"_proj(_with_mqa)?$", "", "_".join(m[common:])) for m in modules]
    tag = "".join(tags) if all(len(t) == 1 for t in tags) else "_".join(tags)
    return ".".join(modules[0][:common] + [f"fused_{tag}", "weight"])


def _fused_weight(program: Program, names: list[str]) -> str:
    """The name of the concatenation of `names` (rows, in order), added to the program if it is new."""
    name = fused_weight_name(names)
    base, n = name, 1
    while name in program.weights and program.weight_info.get(name, {}).get("fused_from") != names:
        n += 1                                                   # another concatenation got this name first
        name = base.removesuffix(".weight") + f"_{n}.weight"
    if name not in program.weights:
        program.weights[name] = torch.cat([program.weights[w] for w in names], dim=0).contiguous()
        program.weight_info[name] = {"fused_from": list(names),
                                     "split": [int(program.weights[w].shape[0]) for w in names]}
    return name


def _node_prefix(weight: str) -> str:
    """Node-name form of a weight's module: model.layers.0.attention.fused_qkvfbg.weight ->
    L0_attention_fused_qkvfbg."""
    return weight.removesuffix(".weight").replace("model.layers.", "L").replace(".", "_")


def _fuse(program: Program, graph: fx.Graph, group: list[fx.Node]) -> fx.Node:
    """One linear over the concatenated weight, split into views; the old linears become the getitems."""
    names = list(dict.fromkeys(lin.args[1].target for lin in group))          # distinct, in graph order
    fused_name = _fused_weight(program, names)
    sizes = program.weight_info[fused_name]["split"]
    first_weight = next(n for n in graph.nodes if n.op == "get_attr" and n.target in names)
    w_node = get_weight_node(graph, fused_name, before=first_weight)      # one per graph (draft: MTP layer 4x)
    prefix = _node_prefix(fused_name)
    x, out_dtype = group[0].args[0], _out_dtype(group[0])
    with graph.inserting_before(group[0]):
        fused = graph.call_function(OPS.linear, (x, w_node) + ((out_dtype,) if out_dtype is not None else ()))
        split = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
    meta = {"lingc.scope": ".".join(fused_name.split(".")[:-2])}
    meta |= carried_meta(group[0], ("lingc.stage", "lingc.dtype"))
    for node in (fused, split):
        node.meta = dict(meta)
    split.meta.pop("lingc.dtype", None)
    fused._rename(prefix + "_linear")
    split._rename(prefix + "_split")
    for lin in group:
        lin.target, lin.args, lin.kwargs = operator.getitem, (split, names.index(lin.args[1].target)), {}
        lin.meta.pop("lingc.dtype", None)
    return fused


class FuseProjections(Pass):
    name = "fuse_projections"
    summary = "same-input linears -> one linear over N-concatenated weights, then views"
    after = ("partition", "bf16_router")        # group by the final weight dtypes
    changes_numerics = True
    # max |delta| on logits, x (1 + |logit|). Reduction-order noise: test-tiny measures ~2e-6 in fp32 (prefill's
    # 32-row GEMM; decode-sized rows happen to match) and 0 in bf16 on CPU; the bound leaves room for a kernel
    # that flips the last bit of a bf16 projection output, far below bf16_router's 0.05
    tolerance = 0.01

    def apply(self, program: Program) -> dict[str, Any]:
        fused_nodes: list[str] = []
        linears_before = linears_after = 0
        for gname, graph in program.graphs.items():
            linears_before += len(calls(graph, "linear"))
            for group in _groups(program, graph):
                fused_nodes.append(f"{gname}:{_fuse(program, graph, group).name} <- {len(group)}")
            linears_after += len(calls(graph, "linear"))
        dropped = drop_unused_weights(program)
        return {"matches": len(fused_nodes), "fused": fused_nodes, "linears_before": linears_before,
                "linears_after": linears_after, "weights_dropped": dropped}
