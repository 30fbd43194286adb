"""fuse_shared_expert: fold each MoE layer's shared expert into the routed-expert kernels as expert E.

Before (per MoE layer; N tokens, E experts, k per token, I expert width, h hidden; after fuse_moe_align and
fuse_swiglu):
    L1_mlp_router_align = lingc.router_align(L1_mlp_gate_linear, w_L1_mlp_gate_expert_bias, 4, 2, 4, 2.5, 16, 16)
    L1_mlp_getitem = getitem(L1_mlp_router_align, 0)                                             # f32[N, k]
    L1_mlp_shared_experts_gate_up_proj_linear = lingc.linear(L1_mlp_view, w_..._gate_up_proj_weight)   # [N, 2I]
    L1_mlp_shared_experts_silu_and_mul = lingc.silu_and_mul(L1_mlp_shared_experts_gate_up_proj_linear, 0.0)
    L1_mlp_shared_experts_down_proj_linear = lingc.linear(L1_mlp_shared_experts_silu_and_mul, w_..._down_proj_weight)
    L1_mlp_moe_up_act = lingc.moe_up_act(L1_mlp_view, w_L1_mlp_experts_w13_interleaved, sp, be, tot, 4, 16, 0.0)
    L1_mlp_moe_down = lingc.moe_down(L1_mlp_moe_up_act, w_L1_mlp_experts_w2, sp, be, tot, 16)     # [N*k, h]
    L1_mlp_moe_combine = lingc.moe_combine(L1_mlp_moe_down, L1_mlp_getitem, L1_mlp_shared_experts_down_proj_linear)
After:
    L1_mlp_router_align = lingc.router_align(L1_mlp_gate_linear, w_..._expert_bias, 4, 2, 4, 2.5, 17, 16, 1)
    L1_mlp_getitem = getitem(L1_mlp_router_align, 0)                  # f32[N, k+1]: column k = expert E, weight 1.0
    L1_mlp_moe_up_act = lingc.moe_up_act(L1_mlp_view, w_L1_mlp_experts_w13_interleaved_with_shared, sp, be, tot,
                                         5, 16, 0.0)                  # w13 [E+1, 2I, h], [N*(k+1), I]
    L1_mlp_moe_down = lingc.moe_down(L1_mlp_moe_up_act, w_L1_mlp_experts_w2_with_shared, sp, be, tot, 16)
    L1_mlp_moe_combine = lingc.moe_combine(L1_mlp_moe_down, L1_mlp_getitem)       # no shared_out: one fp32 sum
The routing op gets `fused_shared` = 1 (router_topk's 7th argument, router_align's 9th; moe_align's expert count
becomes E+1), so each token has k+1 pairs and the shared expert is expert E (lingc/ops/moe.py). Three launches
per MoE layer go (shared gate_up GEMM, silu_and_mul, shared down GEMM); the grouped GEMMs do one more block.
This is SGLang's shared-experts fusion (sgl-project/sglang PR 4918, `num_fused_shared_experts`; after
vllm-project/vllm PR 15502); here the routed weights already carry routed_scaling_factor, so the shared pair's
weight is exactly 1.0 (the shared expert is added unscaled: shared/docs/architecture.md section 6).

Weights: w13 and w2 get the shared expert appended as expert E, at compile time, one layer at a time on the
routed weights' device, in the layout the up-GEMM reads (plain [gate; up] rows for moe_up, gate/up interleaved
for moe_up_act); the routed and shared weights no graph reads any more are dropped right after each layer.
weight_info of a new weight: `shared_expert` = E (the tp pass reads it) and `concat_of` = [routed, shared].

A layer fuses only if, in every graph, the shared expert has the routed experts' shape
(moe_shared_expert_intermediate_size * num_shared_experts == moe_intermediate_size) and SwiGLU clamp
(config.shared_limit(layer) == config.expert_limit(layer)), and only the MoE chain reads the router, the align
and the shared expert's values; otherwise the layer is left alone and details['skipped'] says why.

Numerics change: the shared expert's GEMMs run as grouped-GEMM rows instead of a dense linear (another reduction
order on some backends), and the combine adds its output inside the fp32 sum instead of after a rounding of the
routed sum. Test-tiny: fp32 logits bit-exact on CPU, bf16 within 5e-3 x (1 + |logit|).

Launch hint: the moe_up_act node gets node.meta["lingc.launch"] = {"shared_last": true} (docs/ir.md), with which its
Triton launcher computes the shared expert's tile before the PDL wait (kernels/moe.py SHARED_EARLY); the torch
reference never sees it and it changes no value. fuse_align_into_moe keeps it on the pair-grid op; tp drops it.

Order: after fuse_swiglu and fuse_moe_align (it handles either layout and either router form; declaring the
order keeps those passes from seeing the extra argument), before pdl.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.fuse_swiglu import interleave_w13
from lingc.passes.matchers import calls, get_weight_node, weight_users


@dataclass
class MoeLayer:
    """The nodes of one MoE layer in one graph, matched from its moe_combine."""

    router: fx.Node                  # router_topk or router_align
    align: fx.Node | None            # moe_align (router_topk form) or None (router_align aligns itself)
    up: fx.Node                      # moe_up or moe_up_act
    down: fx.Node                    # moe_down
    combine: fx.Node                 # moe_combine(down, weights, shared_out)
    shared: tuple[fx.Node, fx.Node, fx.Node]       # gate_up linear, silu_and_mul, down linear


def _readers(node: fx.Node) -> dict[int, set[fx.Node]] | None:
    """Output index -> nodes reading that output (through its getitems); None if the tuple is read whole."""
    out: dict[int, set[fx.Node]] = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        out.setdefault(user.args[1], set()).update(user.users)
    return out


def _source(node: fx.Node) -> fx.Node | None:
    return node.args[0] if node.op == "call_function" and node.target is operator.getitem else None


def _limit_and_up(down: fx.Node) -> tuple[fx.Node, float] | str:
    """(up-GEMM node, routed SwiGLU limit) feeding a moe_down, or why not."""
    act = down.args[0]
    if act.target is OPS.moe_up_act:
        return act, act.args[7]
    if act.target is OPS.silu_and_mul and act.args[0].target is OPS.moe_up and set(act.args[0].users) == {act}:
        return act.args[0], act.args[1]
    return f"{down.name} does not read moe_up_act or silu_and_mul(moe_up)"


def _match_routing(combine: fx.Node, up: fx.Node, down: fx.Node) -> tuple[fx.Node, fx.Node | None] | str:
    """(router, moe_align or None) whose blocks the GEMMs read and whose weights the combine reads, or why not."""
    blocks = down.args[2:5]
    if tuple(up.args[2:5]) != tuple(blocks):
        return f"{up.name} and {down.name} read different expert blocks"
    src = _source(blocks[0])
    if src is None or src.target not in (OPS.moe_align, OPS.router_align):
        return f"the expert blocks of {down.name} come from neither moe_align nor router_align"
    align = src if src.target is OPS.moe_align else None
    router = src if align is None else _source(align.args[0])
    if router is None or router.target not in (OPS.router_topk, OPS.router_align):
        return f"{src.name} does not align a router's ids"
    if _source(combine.args[1]) is not router or combine.args[1].args[1] != 0:
        return f"{combine.name} does not read the weights of {router.name}"
    router_reads, align_reads = _readers(router), _readers(align) if align is not None else {}
    if router_reads is None or align_reads is None:
        return f"a routing tuple ({router.name}) is read whole"
    if router_reads.get(0, set()) != {combine}:
        return f"the routing weights of {router.name} have readers besides {combine.name}"
    if not router_reads.get(1, set()) <= ({align} if align is not None else set()):
        return f"the expert ids of {router.name} have readers besides the MoE align"
    block_reads = align_reads if align is not None else {i - 2: r for i, r in router_reads.items() if i >= 2}
    if not set().union(*block_reads.values()) <= {up, down}:
        return f"the expert blocks of {src.name} have readers besides the grouped GEMMs"
    return router, align


def _match_shared(combine: fx.Node, x: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | str:
    """(gate_up linear, silu_and_mul, down linear) of the shared expert the combine adds, reading x, or why not."""
    down = combine.args[2]
    act = down.args[0] if down.target is OPS.linear else None
    gate_up = act.args[0] if act is not None and act.target is OPS.silu_and_mul else None
    if gate_up is None or gate_up.target is not OPS.linear:
        return f"the shared output of {combine.name} is not linear(silu_and_mul(linear(x)))"
    for lin in (gate_up, down):
        if lin.args[1].op != "get_attr" or any(a is not None for a in lin.args[2:]) or lin.kwargs:
            return f"{lin.name} is not a plain linear over one weight (fused projection or out_dtype)"
    if gate_up.args[0] is not x:
        return f"{gate_up.name} does not read the routed experts' input {x.name}"
    if set(gate_up.users) != {act} or set(act.users) != {down} or set(down.users) != {combine}:
        return f"the shared expert's values ({gate_up.name}, ...) have readers besides the shared expert"
    return gate_up, act, down


def _layer(scope: str) -> str:
    m = re.search(r"layers\.(\d+)", scope)
    return m.group(1) if m else "?"


def _check_weights(program: Program, m: MoeLayer, routed_limit: float, scope: str) -> str | None:
    """Why the shared expert cannot be expert E of this layer's w13 / w2 (shape, dtype, clamp), or None."""
    w13, w2 = (program.weights[n.args[1].target] for n in (m.up, m.down))
    gate_up, down = (program.weights[n.args[1].target] for n in (m.shared[0], m.shared[2]))
    layer, shared_limit = _layer(scope), m.shared[1].args[1]
    if w13.dim() != 3 or w2.dim() != 3 or gate_up.shape != w13.shape[1:] or down.shape != w2.shape[1:]:
        return (f"shared expert gate_up {list(gate_up.shape)} / down {list(down.shape)} is not one routed expert "
                f"of w13 {list(w13.shape)} / w2 {list(w2.shape)} (moe_shared_expert_intermediate_size x "
                "num_shared_experts != moe_intermediate_size)")
    aligned = m.align.args[1] if m.align is not None else m.router.args[6]
    if aligned != w13.shape[0]:
        return f"the align counts {aligned} experts, w13 holds {w13.shape[0]}"
    if gate_up.dtype != w13.dtype or down.dtype != w2.dtype:
        return f"shared expert dtype {gate_up.dtype} differs from the routed experts' {w13.dtype}"
    if shared_limit != routed_limit:
        return (f"shared SwiGLU limit {shared_limit} (config.shared_limit({layer})) != routed limit {routed_limit} "
                f"(config.expert_limit({layer})): one grouped GEMM applies one clamp")
    return None


def _match(program: Program, combine: fx.Node) -> MoeLayer | str:
    """The MoE layer ending in `combine` (a moe_combine with a shared_out), or why it cannot fuse."""
    down = combine.args[0]
    if down.target is not OPS.moe_down:
        return f"{combine.name} does not read a moe_down"
    found = _limit_and_up(down)
    if isinstance(found, str):
        return found
    up, routed_limit = found
    routing = _match_routing(combine, up, down)
    if isinstance(routing, str):
        return routing
    shared = _match_shared(combine, up.args[0])
    if isinstance(shared, str):
        return shared
    m = MoeLayer(routing[0], routing[1], up, down, combine, shared)
    return _check_weights(program, m, routed_limit, combine.meta.get("lingc.scope", "")) or m


def _with_shared(program: Program, routed: str, shared: str, interleaved: bool) -> str:
    """Name of routed [E, R, C] + shared [R, C] as expert E, [E+1, R, C], built on the routed weights' device."""
    name = routed + "_with_shared"
    if name not in program.weights:
        experts = program.weights[routed]
        extra = program.weights[shared].to(experts.device).unsqueeze(0)                   # [1, R, C]
        program.weights[name] = torch.cat([experts, interleave_w13(extra) if interleaved else extra]).contiguous()
        program.weight_info[name] = {**program.weight_info.get(routed, {}), "shared_expert": int(experts.shape[0]),
                                     "concat_of": [routed, shared]}
    return name


def _rewrite(program: Program, graph: fx.Graph, m: MoeLayer) -> None:
    """Route k+1 pairs (the last: expert E, weight 1.0) through the grouped GEMMs; erase the shared expert."""
    gate_up, act, shared_down = m.shared
    interleaved = m.up.target is OPS.moe_up_act
    w13 = _with_shared(program, m.up.args[1].target, gate_up.args[1].target, interleaved)
    w2 = _with_shared(program, m.down.args[1].target, shared_down.args[1].target, False)
    num_experts = int(program.weights[m.up.args[1].target].shape[0])
    if m.align is not None:                                      # router_topk(..., S) + moe_align(ids, E+1, BM)
        m.router.args = (*m.router.args[:6], 1)
        m.align.args = (m.align.args[0], num_experts + 1, *m.align.args[2:])
    else:                                                        # router_align(..., E+1, BM, S)
        m.router.args = (*m.router.args[:6], num_experts + 1, m.router.args[7], 1)
    top_k = m.up.args[5]
    m.up.args = (m.up.args[0], get_weight_node(graph, w13, before=m.up.args[1]), *m.up.args[2:5], top_k + 1,
                 *m.up.args[6:])
    if interleaved:      # a launch hint: the stack's last expert is the shared one (kernels/moe.py SHARED_EARLY)
        m.up.meta["lingc.launch"] = {**m.up.meta.get("lingc.launch", {}), "shared_last": True}
    m.down.args = (m.down.args[0], get_weight_node(graph, w2, before=m.down.args[1]), *m.down.args[2:])
    m.combine.args = m.combine.args[:2]
    for node in (shared_down, act, gate_up):
        graph.erase_node(node)


def _drop(program: Program, names: set[str]) -> list[str]:
    """Erase unread get_attr nodes of `names` and drop those weights no graph reads any more."""
    for graph in program.graphs.values():
        for node in list(graph.nodes):
            if node.op == "get_attr" and node.target in names and not node.users:
                graph.erase_node(node)
    dropped = sorted(n for n in names if n in program.weights and weight_users(program, n) == 0)
    for name in dropped:
        del program.weights[name]
        program.weight_info.pop(name, None)
    return dropped


class FuseSharedExpert(Pass):
    name = "fuse_shared_expert"
    summary = "shared expert -> routed expert E (weight 1.0) in the grouped MoE GEMMs; -3 launches per MoE layer"
    after = ("partition", "fuse_swiglu", "fuse_moe_align", "bf16_router", "fuse_projections")
    changes_numerics = True
    # max |delta| on logits, x (1 + |logit|): the shared expert's GEMMs in another reduction order and one rounding
    # less in the combine. Test-tiny (2 of 6 MoE layers fuse) measures 0 in fp32 (CPU: the pair-by-pair grouped
    # GEMM and the decode-sized linear happen to agree, and the shared term comes last in the sequential sum) and
    # <= 5e-3 in bf16 (the combine's one rounding flips the last bit of about a third of a layer's MoE outputs);
    # the bound leaves room for more fused layers on a real model
    tolerance = 0.02

    def apply(self, program: Program) -> dict[str, Any]:
        layers: dict[str, list[tuple[str, MoeLayer | str]]] = {}
        for gname, graph in program.graphs.items():
            for combine in calls(graph, "moe_combine"):
                if len(combine.args) > 2 and combine.args[2] is not None:
                    scope = combine.meta.get("lingc.scope", combine.name)
                    layers.setdefault(scope, []).append((gname, _match(program, combine)))
        fused, skipped, dropped = [], {}, []
        for scope, found in layers.items():              # one layer at a time: new weights built, old ones dropped
            reasons = [f"{g}: {m}" for g, m in found if isinstance(m, str)]
            if reasons:
                skipped[scope] = reasons[0]
                continue
            old = set()
            for gname, m in found:
                old |= {n.args[1].target for n in (m.up, m.down, m.shared[0], m.shared[2])}
                _rewrite(program, program.graphs[gname], m)
                fused.append(f"{gname}:{m.combine.name}")
            dropped += _drop(program, old)
        return {"matches": len(fused), "fused": fused, "layers": sorted(s for s in layers if s not in skipped),
                "skipped": skipped, "launches_removed": 3 * len(fused), "weights_dropped": dropped}
