"""tp: shard the program for N tensor-parallel ranks and insert the collectives (runs last, only via --tp N).

Every rank runs the same graphs (same ops, same local shapes); only the weights differ, so an artifact
holds one set of graphs and one weight set per rank. What each weight becomes (weight_info[name]["tp"]):

    rows      split dim 0 in N contiguous chunks: KDA q/k/v/f/g/b projections, conv weights, A_log, dt_bias
              (KDA heads split across ranks); MLA q_proj / q_b_proj, kv_b_proj, g_proj (MLA heads split);
              lm_head (vocab-parallel)                                                   column-parallel
    cols      split dim 1: KDA o_proj, MLA dense, dense-MLP and shared-expert down_proj    row-parallel
    gate_up   [gate; up] rows, each half split: dense-MLP and shared-expert gate_up_proj  column-parallel
    experts   split dim 0 (the expert axis): experts.w13, w13_interleaved, w2        expert-parallel
    experts_shared  a fuse_shared_expert w13 / w2 ([E+1, ...], weight_info shared_expert = E): the rank's
              routed chunk, then the shared expert, on every rank ([E/N + 1, ...], one shape for all ranks)
    replicate norms, q_a_proj, kv_a_proj_with_mqa (the MLA latent is shared by every head), the router
              gate and its bias, the embedding table, the MTP eh_proj
    fused     a fuse_projections weight: each part (weight_info split) by its own rule, concatenated again
    expert_map new int32 [E] per MoE layer: global expert -> this rank's index, -1 where another rank has it;
              [E+1] for a fused layer: the shared expert E -> index E/N on one rank (layer % N), -1 on the others

Graph rewrites (per graph; counts for test-tiny decode: 6 layers -> 12 all_reduce, 1 all_gather):
    x = lingc.linear(h, w_o_proj)                # row-parallel: a partial sum on every rank
 -> x = lingc.all_reduce(lingc.linear(h, w_o_proj), N)       then add_rmsnorm reads the sum, as before

    w, ids, sp, be, tot = router_align(...)      # or router_topk + moe_align
    up = moe_up_act(x, w13, sp, be, tot, ...); down = moe_down(up, w2, sp, be, tot, BM)
    y = moe_combine(down, w, shared)
 -> w, ids = router_topk(...)                    # every rank routes every token (replicated gate)
    local, sp, be, tot = lingc.ep_align(ids, expert_map, E / N, BM)    # only this rank's pairs
    up, down as before over the local experts; y = lingc.all_reduce(lingc.ep_combine(down, w, local, shared), N)
    (the shared expert's down_proj is row-parallel too; its partial joins the combine, one all_reduce per MoE)
    After fuse_shared_expert the shared expert is pair k of every token (expert E, weight 1.0): one rank per
    layer (layer % N, spreading the layers' shared experts over the ranks) computes it whole as its local expert
    E/N, the others drop that pair like any other rank's; ep_combine then has no shared_out.
    prefetch_weights' l2_prefetch_experts hints (opt-in EXPERTS) name global expert ids: they are dropped first
    (`dropped_expert_hints`); its l2_prefetch hints stay and clip to the rank's shard of their weight.

    logits = lingc.linear(x, w_lm_head)          # [B, T, V / N]
 -> logits = lingc.all_gather(lingc.linear(x, w_lm_head), -1, N)      # [B, T, V]: sampling sees every id

    A fuse_norm_linear op ([add_]rmsnorm_linear) is a linear for these rules: its weight is split as the plain
    linear's would be (q_b rows, a fused projection by parts, the lm_head by vocab with the all_gather after its
    y), the norm weight is replicated and normed / new residual stay whole rows. A row-parallel weight behind a
    norm is refused (each rank would norm a shard of the row); no Ling-3 norm feeds one. The exception is
    gated_rmsnorm_linear (KDA's o_norm -> the row-parallel o_proj): its norm is per head and a rank holds whole
    heads, so it shards as the o_proj linear it replaces (its y is the op itself; the all_reduce follows it).

State: KDA pools hold only the rank's heads (conv [S, P/N, W-1], recurrent [S, H/N, D, D], and their
staging); MLA latent pages are replicated (each head reads the whole 576-wide latent row). Views that
split a projection into heads ([B, T, H, D]) get H / N; fused splits get their per-rank sizes; relays stay
full size (they hold logits-derived and hidden-state values, the same on every rank).

Numerics change: a row-parallel product is summed from N partials (each rounded to the activation dtype,
then summed in fp32 and rounded once; lingc/ops/dist.py), and the projections run at other GEMM widths.
`verify_tp` (compile --verify) runs the N ranks in lockstep in one process (`run_lockstep`) against the
previous stage: logits within `tolerance`, greedy parity.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from lingc.config import LingConfig
from lingc.ops import OPS
from lingc.ops.dist import fold_sum
from lingc.ops.norm_linear import WEIGHT_ARG
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.fuse_align_into_moe import unfuse as unfuse_pairs
from lingc.passes.fuse_combine_norm import unfuse as unfuse_combine_norm
from lingc.passes.fuse_norm_router import unfuse as unfuse_norm_router
from lingc.passes.fuse_router_into_moe import unfuse as unfuse_routed
from lingc.passes.fuse_moe import unfuse
from lingc.passes.matchers import KEEP_META, calls, carried_meta, consumers, get_weight_node, output_getitem

aten = torch.ops.aten
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)

_RULES: list[tuple[str, str]] = [
    (r"\.attention\.(q|k|v|f|g|b|q_b|kv_b)_proj\.weight$", "rows"),
    (r"\.attention\.(q|k|v)_conv1d\.weight$", "rows"),
    (r"\.attention\.(A_log|dt_bias)$", "rows"),
    (r"^lm_head\.weight$", "rows"),
    (r"\.attention\.(o_proj|dense)\.weight$", "cols"),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", "cols"),
    (r"\.mlp\.(shared_experts\.)?gate_up_proj\.weight$", "gate_up"),
    (r"\.mlp\.experts\.(w13|w13_interleaved|w2)$", "experts"),
    (r"\.mlp\.experts\.expert_map$", "expert_map"),
    (r"norm\.weight$", "replicate"),
    (r"\.attention\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", "replicate"),
    (r"\.mlp\.gate\.(weight|expert_bias)$", "replicate"),
    (r"^model\.word_embeddings\.weight$", "replicate"),
    (r"\.eh_proj\.weight$", "replicate"),
]


class TPError(ValueError):
    """A --tp the model cannot be split by, or a program the tp pass cannot shard; the message names why."""


# ---- sizes ------------------------------------------------------------------------------------------------
def check_tp(config: LingConfig, tp: int) -> None:
    """Raise TPError naming the first dimension that `tp` does not divide (before any weight is read)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TPError(f"--tp must be a positive integer, got {tp!r}")
    c = config
    dims = [("num_attention_heads", c.num_attention_heads, "MLA heads are split across ranks"),
            ("KDA heads (num_kv_heads_for_linear_attn or num_attention_heads)", c.kda_heads,
             "KDA heads are split across ranks"),
            ("num_experts", c.num_experts, "routed experts are split across ranks"),
            ("vocab_size", c.vocab_size, "the lm_head is vocab-parallel"),
            ("moe_shared_expert_intermediate_size x num_shared_experts",
             c.moe_shared_expert_intermediate_size * c.num_shared_experts, "the shared expert is split column/row")]
    if c.first_k_dense_replace > 0:
        dims.append(("intermediate_size", c.intermediate_size, "the dense MLP is split column/row"))
    for name, value, why in dims:
        if value % tp:
            raise TPError(f"--tp {tp} does not divide {name} = {value} ({why}); use a --tp that divides it")


def weight_rule(program: Program, name: str) -> dict[str, Any]:
    """How weight `name` is split across ranks: {"rule": ...} (fused weights: {"rule": "fused", "parts": [...]})."""
    info = program.weight_info.get(name, {})
    if "shared_expert" in info:                    # fuse_shared_expert: routed experts [0, E), the shared one E
        return {"rule": "experts_shared", "num_routed": int(info["shared_expert"])}
    if "shared_owner" in info:                     # the expert map of a fused layer
        return {"rule": "expert_map", "shared_owner": int(info["shared_owner"])}
    if "fused_from" in info:
        parts = [weight_rule(program, p)["rule"] for p in info["fused_from"]]
        bad = [p for p, r in zip(info["fused_from"], parts) if r not in ("rows", "replicate", "gate_up")]
        if bad:
            raise TPError(f"tp: fused weight {name} joins {bad}, which are not split by rows; cannot shard it")
        return {"rule": "fused", "parts": parts, "split": list(info["split"])}
    for pattern, rule in _RULES:
        if re.search(pattern, name):
            return {"rule": rule}
    raise TPError(f"tp: no sharding rule for weight {name!r} (add one to passes/tp.py)")


def _chunk(t: torch.Tensor, dim: int, rank: int, tp: int, name: str) -> torch.Tensor:
    if t.shape[dim] % tp:
        raise TPError(f"tp: weight {name} has {t.shape[dim]} along dim {dim}, which --tp {tp} does not divide")
    return t.chunk(tp, dim)[rank]


def shard_weight(t: torch.Tensor, spec: dict[str, Any], rank: int, tp: int, name: str = "") -> torch.Tensor:
    """This rank's piece of weight t under `spec` (weight_rule)."""
    rule = spec["rule"]
    if rule == "replicate":
        return t
    if rule in ("rows", "experts"):
        out = _chunk(t, 0, rank, tp, name)
    elif rule == "experts_shared":
        routed = spec["num_routed"]
        out = torch.cat([_chunk(t[:routed], 0, rank, tp, name), t[routed:]])
    elif rule == "cols":
        out = _chunk(t, 1, rank, tp, name)
    elif rule == "gate_up":
        gate, up = t.chunk(2, 0)
        out = torch.cat([_chunk(gate, 0, rank, tp, name), _chunk(up, 0, rank, tp, name)])
    elif rule == "fused":
        parts = t.split(spec["split"], 0)
        out = torch.cat([shard_weight(p, {"rule": r}, rank, tp, name) for p, r in zip(parts, spec["parts"])])
    else:
        raise TPError(f"tp: weight {name} has rule {rule!r}, which shard_weight cannot apply")
    return out.contiguous().clone()


def local_split(spec: dict[str, Any], tp: int) -> list[int]:
    """Per-rank split sizes of a fused weight."""
    return [s if r == "replicate" else s // tp for s, r in zip(spec["split"], spec["parts"])]


def input_shard_dim(role: str) -> int | None:
    """The dim a graph input is split along on each rank (KDA pools and their staging), None if replicated."""
    m = re.fullmatch(r"(state|staging):layers\.\d+\.(conv_[qkv]|recurrent)", role)
    if not m:
        return None
    return 1 if m.group(1) == "state" else 2


def expert_map(num_experts: int, rank: int, tp: int, shared_owner: int | None = None) -> torch.Tensor:
    """int32 [E]: global expert -> local index on `rank` (contiguous blocks of E / tp), -1 elsewhere.

    With shared_owner (a fuse_shared_expert layer) [E+1]: the shared expert E -> E / tp on that rank, else -1.
    """
    local = num_experts // tp
    ids = torch.arange(num_experts)
    routed = torch.where(ids // local == rank, ids % local, -1).to(torch.int32)
    if shared_owner is None:
        return routed
    return torch.cat([routed, torch.tensor([local if rank == shared_owner else -1], dtype=torch.int32)])


def shared_owner(weight: str, tp: int) -> int:
    """The rank that computes a fused layer's shared expert: layer % tp (the layers spread over the ranks)."""
    m = re.search(r"layers\.(\d+)\.", weight)
    return int(m.group(1)) % tp if m else 0


# ---- graph rewrites ---------------------------------------------------------------------------------------
def _meta_from(node: fx.Node, *sources: fx.Node) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in sources:
        out.update(carried_meta(s))
    return out


def _getitem_of(node: fx.Node, index: int) -> fx.Node | None:
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index), None)


def _linear_products(graph: fx.Graph) -> list[tuple[fx.Node, str, fx.Node | None]]:
    """(op, weight name, the node holding its product y) for every linear, and for every fuse_norm_linear op, whose
    weight is sharded by the same rules (its y is getitem 0, None if nothing reads it; the norm weight is
    replicated, the norm's outputs are full rows on every rank)."""
    out = [(lin, lin.args[1].target, lin) for lin in calls(graph, "linear")]
    for op, index in WEIGHT_ARG.items():
        out += [(node, node.args[index].target, node if op == "gated_rmsnorm_linear" else _getitem_of(node, 0))
                for node in calls(graph, op)]
    return out


def _insert_collective(graph: fx.Graph, node: fx.Node, op: Any, args: tuple, suffix: str) -> fx.Node:
    """op(node, *args) right after node; every other reader of node reads it instead. The one place
    collectives enter a graph (a later fused all-reduce + add + norm replaces what this makes)."""
    with graph.inserting_after(node):
        new = graph.call_function(op, (node, *args))
    node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
    new.meta = {**_meta_from(new, node), "lingc.tensor": node.meta.get("lingc.tensor")}   # the global shape
    new._rename(f"{node.name}_{suffix}")
    return new


def _rewrite_moe(program: Program, graph: fx.Graph, combine: fx.Node, tp: int) -> fx.Node:
    """moe_combine and its align -> ep_align + ep_combine (the module docstring); returns the ep_combine."""
    down = combine.args[0]
    if down.target is operator.getitem and down.args[0].target is OPS.moe_down_routed:
        down = unfuse_routed(graph, down.args[0], int(program.weights[down.args[0].args[1].target].shape[0]))
    if down.target is OPS.moe_down_pairs:          # fuse_align_into_moe: back to moe_align + the aligned GEMMs
        down = unfuse_pairs(graph, down, int(program.weights[down.args[1].target].shape[0]))
    if down.target is not OPS.moe_down:
        raise TPError(f"tp: {combine.name} does not read a moe_down; cannot shard this MoE layer")
    ups = [n for n in down.all_input_nodes if n.target in (OPS.moe_up, OPS.moe_up_act, OPS.silu_and_mul)]
    up = ups[0] if ups else None
    if up is not None and up.target is OPS.silu_and_mul:
        up = up.args[0]
    if up is None or up.target not in (OPS.moe_up, OPS.moe_up_act):
        raise TPError(f"tp: {combine.name}: no moe_up before its moe_down")
    sp_node = down.args[2]
    src = sp_node.args[0] if sp_node.target is operator.getitem else None
    if src is None or src.target not in (OPS.moe_align, OPS.router_align):
        raise TPError(f"tp: {combine.name}: its expert blocks come from neither moe_align nor router_align")
    offset = 0 if src.target is OPS.moe_align else 2                     # router_align: (w, ids, sp, be, tot)
    w13 = program.weights[up.args[1].target]
    E = int(w13.shape[0])
    routed = int(program.weight_info.get(up.args[1].target, {}).get("shared_expert", E))   # fuse_shared_expert: E-1
    block_m = src.args[2] if src.target is OPS.moe_align else src.args[7]
    if src.target is OPS.moe_align:
        ids = src.args[0]
    else:
        ids = output_getitem(graph, src, 1, f"{src.name}_ids", KEEP_META)
    map_name = up.args[1].target.rsplit(".", 1)[0] + ".expert_map"
    owner = shared_owner(map_name, tp) if routed < E else None
    if map_name not in program.weights:
        program.weights[map_name] = expert_map(routed, 0, tp, owner).to(program.weights[up.args[1].target].device)
        if owner is not None:
            program.weight_info[map_name] = {"shared_owner": owner}
    map_node = get_weight_node(graph, map_name, before=up.args[1])
    with graph.inserting_before(up):
        ep = graph.call_function(OPS.ep_align, (ids, map_node, routed // tp + E - routed, block_m))
        outs = [graph.call_function(operator.getitem, (ep, i)) for i in range(4)]
    ep.meta = _meta_from(ep, src)
    ep._rename(src.name.replace("router_align", "ep_align").replace("moe_align", "ep_align")
               if re.search("router_align|moe_align", src.name) else src.name + "_ep_align")
    for o, field in zip(outs, ("local_ids", "sorted_pairs", "block_expert", "total")):
        o.meta = _meta_from(o, src)
        o._rename(f"{ep.name}_{field}")
    for n in (up, down):
        n.args = (*n.args[:2], outs[1], outs[2], outs[3], *n.args[5:])
        n.meta.pop("lingc.launch", None)   # shared_last: a rank's local stack and pairs follow ep_align's layout
    weights, shared = combine.args[1], combine.args[2:3]              # no shared_out after fuse_shared_expert
    with graph.inserting_before(combine):
        new = graph.call_function(OPS.ep_combine, (down, weights, outs[0], *shared))
    new.meta = {**_meta_from(new, combine), "lingc.tensor": combine.meta.get("lingc.tensor"),
                **({"lingc.pdl": combine.meta["lingc.pdl"]} if "lingc.pdl" in combine.meta else {})}
    combine.replace_all_uses_with(new)
    graph.erase_node(combine)
    new._rename(combine.name.replace("moe_combine", "ep_combine"))
    # the global align is dead now: drop it (router_align goes back to router_topk)
    for i in range(3):
        g = _getitem_of(src, offset + i)
        if g is not None and not g.users:
            graph.erase_node(g)
    if src.target is OPS.moe_align and not src.users:
        graph.erase_node(src)
    elif src.target is OPS.router_align and all(u.args[1] < 2 for u in src.users):
        with graph.inserting_before(src):
            topk = graph.call_function(OPS.router_topk, (*src.args[:6], *src.args[8:]))    # + fused_shared
        topk.meta = {**_meta_from(topk, src),
                     **({"lingc.pdl": src.meta["lingc.pdl"]} if "lingc.pdl" in src.meta else {})}
        for u in list(src.users):
            u.args = (topk, u.args[1])          # list(): re-pointing edits src.users
        name = src.name
        graph.erase_node(src)
        topk._rename(name.replace("router_align", "router_topk"))
    return new


def _fix_shapes(program: Program, graph: fx.Graph, tp: int) -> list[str]:
    """Walk the graph on fake tensors; a head view of a sharded value ([B, T, P/N] -> [B, T, H, D]) gets H/N.

    The rule: the first target dim after the prefix the view shares with its input is divided by the
    factor the input shrank by (a -1 there needs nothing). Any other shape error names the node.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    device = next((w.device for w in program.weights.values()), torch.device("cpu"))   # inputs live with weights
    env: dict[fx.Node, Any] = {}
    fixed: list[str] = []
    with mode:
        for node in graph.nodes:
            if node.op == "placeholder":
                m = node.meta["lingc.tensor"]
                env[node] = torch.empty(m.shape, dtype=m.dtype, device=device)
                continue
            if node.op == "get_attr":
                env[node] = mode.from_tensor(program.weights[node.target])
                continue
            if node.op != "call_function":
                continue
            old_meta = (node.args[0].meta.get("lingc.tensor") if node.args and isinstance(node.args[0], fx.Node)
                        else None)
            if node.target in VIEW_OPS and old_meta is not None:
                old_in = tuple(old_meta.shape)
                new_in = tuple(env[node.args[0]].shape)
                old_n, new_n = _numel(old_in), _numel(new_in)
                if old_n != new_n:
                    if old_n % new_n:
                        raise TPError(f"tp: view {node.name}: input shrank from {list(old_in)} to {list(new_in)}")
                    node.args = (node.args[0], _shrink_view(list(node.args[1]), old_in, old_n // new_n, node),
                                 *node.args[2:])
                    fixed.append(node.name)
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            try:
                env[node] = node.target(*args, **kwargs) if node.target is not operator.getitem \
                    else operator.getitem(*args)
            except Exception as e:  # a shape the sharding broke: say where
                raise TPError(f"tp: node {node.name} ({node.target}) fails on the sharded shapes: "
                              f"{str(e).splitlines()[0][:300]}") from None
    return fixed


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shrink_view(target: list[int], old_in: tuple[int, ...], factor: int, node: fx.Node) -> list[int]:
    i = 0
    while i < min(len(target), len(old_in)) and target[i] == old_in[i]:
        i += 1
    for j in range(i, len(target)):
        if target[j] == -1:
            return target                       # inferred: nothing to change
        if target[j] % factor == 0:
            return target[:j] + [target[j] // factor] + target[j + 1:]
        break
    raise TPError(f"tp: cannot shrink view {node.name} {target} of {list(old_in)} by {factor}")


class TensorParallel(Pass):
    """The `tp` pass; see the module docstring. Constructed with the degree: `TensorParallel(4)`."""

    name = "tp"
    summary = ("shard for N ranks: column/row-parallel projections, expert-parallel MoE, vocab-parallel lm_head, "
               "KDA/MLA heads split; inserts all_reduce / all_gather (only via --tp N, after every other pass)")
    changes_numerics = True
    # max |delta| of logits x (1 + |logit|): row-parallel partials are rounded to the activation dtype before
    # the fp32 sum (bf16: ~2^-8 relative on each layer's output); test-tiny logits move <= 1.6e-2 in bf16 (TP4
    # prefill), <= 4e-7 in fp32 with an fp32 lm_head
    tolerance = 0.05

    def __init__(self, tp: int | None = None):
        self.tp = tp
        self.rank_weights: list[dict[str, torch.Tensor]] | None = None

    def apply(self, program: Program) -> dict[str, Any]:
        tp = self.tp if self.tp is not None else program.options.get("tp")
        if tp is None:
            raise TPError("the tp pass needs a degree: run it through `lingc compile --tp N`")
        check_tp(program.config, tp)
        if program.options.get("tp", 1) not in (1, tp):
            raise TPError(f"tp: the program is already sharded for {program.options['tp']} ranks")
        full = dict(program.weights)
        specs = {name: weight_rule(program, name) for name in full}
        all_reduce: dict[str, int] = {}
        all_gather: dict[str, int] = {}
        ep_layers: list[str] = []
        views: dict[str, int] = {}
        dropped_hints = 0
        for gname, graph in program.graphs.items():
            # 1. MoE -> expert parallel (fuse_moe's, fuse_combine_norm's and fuse_norm_router's ops are split back
            # first: the rewrite needs the separate combine and router)
            for hint in calls(graph, "l2_prefetch_experts"):   # global expert ids: a rank holds a slice of them
                graph.erase_node(hint)
                dropped_hints += 1
            for fused in calls(graph, "moe_fused"):
                unfuse(graph, fused)
            for fused in calls(graph, "combine_add_rmsnorm"):
                unfuse_combine_norm(graph, fused)
            for fused in calls(graph, "add_rmsnorm_router"):   # the rewrite reads the router's align
                unfuse_norm_router(graph, fused)
            for combine in calls(graph, "moe_combine"):
                ep_layers.append(f"{gname}:{_rewrite_moe(program, graph, combine, tp).name}")
            # 2. collectives after row-parallel products, MoE combines and the lm_head
            n_ar = n_ag = 0
            for lin, w, y in _linear_products(graph):
                rule = specs.get(w, {}).get("rule")
                if rule == "cols" and lin is not y:
                    raise TPError(f"tp: {lin.name} runs a norm in front of the row-parallel {w}: each rank would "
                                  f"norm a shard of the row; compile without fuse_norm_linear")
                if y is None:
                    continue
                if rule == "cols" and not all(c.target is OPS.ep_combine for c in consumers(y)):
                    _insert_collective(graph, y, OPS.all_reduce, (tp,), "all_reduce")
                    n_ar += 1
                elif w == "lm_head.weight":
                    _insert_collective(graph, y, OPS.all_gather, (-1, tp), "all_gather")
                    n_ag += 1
            for comb in calls(graph, "ep_combine"):
                _insert_collective(graph, comb, OPS.all_reduce, (tp,), "all_reduce")
                n_ar += 1
            all_reduce[gname], all_gather[gname] = n_ar, n_ag
            # 3. fused projections split at per-rank sizes
            for _, w, y in _linear_products(graph):
                spec = specs.get(w, {})
                if spec.get("rule") != "fused" or y is None:
                    continue
                for u in list(y.users):
                    if u.target is aten.split_with_sizes.default:
                        u.args = (u.args[0], local_split(spec, tp), *u.args[2:])
            # 4. KDA pools and staging hold this rank's heads
            for node in graph.nodes:
                dim = input_shard_dim(node.meta.get("lingc.input", "")) if node.op == "placeholder" else None
                if dim is not None:
                    m = node.meta["lingc.tensor"]
                    shape = list(m.shape)
                    if shape[dim] % tp:
                        raise TPError(f"tp: input {node.name} has {shape[dim]} along dim {dim}, not divisible by {tp}")
                    shape[dim] //= tp
                    node.meta["lingc.tensor"] = type(m)(tuple(shape), m.dtype)
        # 5. weights: rank 0's in the program, every rank's in rank_weights
        for name in program.weights:
            specs.setdefault(name, weight_rule(program, name))
        self.rank_weights = []
        for r in range(tp):
            ws = {}
            for name, spec in specs.items():
                if spec["rule"] == "expert_map":
                    owner = spec.get("shared_owner")
                    ws[name] = expert_map(int(program.weights[name].shape[0]) - (owner is not None), r, tp,
                                          owner).to(program.weights[name].device)
                else:
                    ws[name] = shard_weight(full[name], spec, r, tp, name)
            self.rank_weights.append(ws)
        program.weights.clear()
        program.weights.update(self.rank_weights[0])
        for name, spec in specs.items():
            program.weight_info.setdefault(name, {})["tp"] = spec
        # 6. head views at the per-rank head counts
        for gname, graph in program.graphs.items():
            views[gname] = len(_fix_shapes(program, graph, tp))
        program.options["tp"] = tp
        rules: dict[str, int] = {}
        for spec in specs.values():
            rules[spec["rule"]] = rules.get(spec["rule"], 0) + 1
        return {"matches": sum(all_reduce.values()) + sum(all_gather.values()) + len(ep_layers), "tp": tp,
                "all_reduce": all_reduce, "all_gather": all_gather, "ep_layers": ep_layers,
                "weight_rules": rules, "views_resized": views, "dropped_expert_hints": dropped_hints}


# ---- N ranks in one process -------------------------------------------------------------------------------
def rank_programs(program: Program, rank_weights: list[dict[str, torch.Tensor]]) -> list[Program]:
    """One Program per rank: the same graphs (copied) over each rank's weights."""
    out = []
    for ws in rank_weights:
        p = program.copy()
        p.weights = dict(ws)
        out.append(p)
    return out


def shard_program(program: Program, tp: int) -> list[Program]:
    """The tp pass on `program` (not edited), as one Program per rank."""
    p = TensorParallel(tp)
    new, _ = p.run(program)
    return rank_programs(new, p.rank_weights)


def shard_inputs(inputs: dict[str, torch.Tensor], program: Program, graph: str, rank: int,
                 tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s copies of a graph's full-size inputs: KDA pools / staging sliced, the rest cloned."""
    out = {}
    for node in program.inputs(graph):
        t = inputs[node.name]
        dim = input_shard_dim(node.meta["lingc.input"])
        out[node.name] = (t.chunk(tp, dim)[rank] if dim is not None else t).clone()
    return out


@torch.no_grad()
def run_lockstep(programs: list[Program], graph: str, inputs: list[dict[str, torch.Tensor]],
                 call: Callable[[Any], Callable] | None = None) -> list[Any]:
    """Run graph `graph` of N rank programs in one process, node by node in lockstep: each collective sees
    every rank's operand (all_reduce: fp32 sum in rank order, as the gloo path computes it; all_gather: cat).
    inputs[r] feeds rank r's placeholders (state updated in place); returns each rank's outputs. `call` maps a
    node's target to what runs it (default: the target itself, i.e. the reference ops; e.g. a Triton launcher)."""
    tp = len(programs)
    node_lists = [list(p.graphs[graph].nodes) for p in programs]
    envs: list[dict[str, Any]] = [{} for _ in programs]
    outputs: list[Any] = [None] * tp
    for nodes in zip(*node_lists):
        node = nodes[0]
        if node.op == "placeholder":
            for r in range(tp):
                envs[r][node.name] = inputs[r][node.name]
        elif node.op == "get_attr":
            for r in range(tp):
                envs[r][node.name] = programs[r].weights[node.target]
        elif node.op == "output":
            for r in range(tp):
                outputs[r] = fx.node.map_arg(nodes[r].args[0], lambda n, r=r: envs[r][n.name])
        elif node.target in (OPS.all_reduce, OPS.all_gather):
            parts = [envs[r][nodes[r].args[0].name] for r in range(tp)]
            if node.target is OPS.all_reduce:
                value = fold_sum(parts, parts[0].dtype)
            else:
                value = torch.cat(parts, dim=node.args[1])
            for r in range(tp):
                envs[r][node.name] = value.clone()
        elif node.target is OPS.all_reduce_add_rmsnorm:             # fuse_all_reduce_norm: the sum, then each
            parts = [envs[r][nodes[r].args[1].name] for r in range(tp)]   # rank's add + norm on it
            value = fold_sum(parts, parts[0].dtype)
            norm = call(OPS.add_rmsnorm) if call else OPS.add_rmsnorm
            for r in range(tp):
                residual, _, weight, eps, _ = fx.node.map_arg(nodes[r].args, lambda a, r=r: envs[r][a.name])
                envs[r][node.name] = norm(residual, value.clone(), weight, eps)
        else:
            for r in range(tp):
                n = nodes[r]
                args = fx.node.map_arg(n.args, lambda a, r=r: envs[r][a.name])
                kwargs = fx.node.map_arg(n.kwargs, lambda a, r=r: envs[r][a.name])
                envs[r][node.name] = (call(n.target) if call else n.target)(*args, **kwargs)
    return outputs


def gather_state(rank_inputs: list[dict[str, torch.Tensor]], program: Program, graph: str) -> dict[str, torch.Tensor]:
    """The full-size view of the ranks' (updated) inputs: sharded pools concatenated, the rest from rank 0."""
    out = {}
    for node in program.inputs(graph):
        dim = input_shard_dim(node.meta["lingc.input"])
        parts = [ri[node.name] for ri in rank_inputs]
        out[node.name] = torch.cat(parts, dim=dim) if dim is not None else parts[0]
    return out


def verify_tp(before: Program, ranks: list[Program], tolerance: float) -> dict[str, Any]:
    """--verify for the tp stage: every graph of `before` against the N ranks run in lockstep, on the same
    seeded random inputs (passes.verify). Logits within tolerance x (1 + |logit|) and greedy parity; integer
    outputs equal; the ranks' outputs identical to each other; states reported (max |delta|), not gated."""
    from lingc.passes.verify import _compare, _run, random_inputs
    tp = len(ranks)
    report: dict[str, Any] = {"exact": False, "tolerance": tolerance, "graphs": {}, "ok": True, "tp": tp}
    for graph in sorted(ranks[0].graphs):
        if graph not in before.graphs:
            continue
        inputs = random_inputs(before, [graph])
        ref_out, ref_in = _run(before, [graph], {k: v.clone() for k, v in inputs.items()})
        rank_in = [shard_inputs(inputs, ranks[0], graph, r, tp) for r in range(tp)]
        outs = run_lockstep(ranks, graph, rank_in)
        problems: list[str] = []
        flat = [[v for v in (o if isinstance(o, (tuple, list)) else [o]) if v is not None] for o in outs]
        for r in range(1, tp):
            if any(not torch.equal(a, b) for a, b in zip(flat[0], flat[r])):
                problems.append(f"rank {r}'s outputs differ from rank 0's")
        worst = 0.0
        checked = [(f"output[{i}]", x, y) for i, (x, y) in enumerate(zip(ref_out, flat[0]))]
        got_in = gather_state(rank_in, ranks[0], graph)
        checked += [(k, ref_in[k], got_in[k]) for k in sorted(got_in) if k in ref_in]
        for label, x, y in checked:
            d, p = _compare(label, x, y, False, tolerance, before.config.vocab_size)
            worst, problems = max(worst, d), problems + p
        report["graphs"][graph] = {"max_abs_delta": worst, "problems": problems}
        report["ok"] &= not problems
    return report


def run_tp_stage(result: Any, tp: int, verify: bool = False) -> list[dict[str, torch.Tensor]]:
    """Run the tp pass after every other pass on a CompileResult (compile --tp N), then fuse_all_reduce_norm on the
    all_reduces it inserted: each linted, optionally verified, snapshotted as a stage. Returns every rank's weights
    (rank 0's are the program's; the fusion leaves weights alone)."""
    from lingc.passes.fuse_all_reduce_norm import FuseAllReduceNorm
    from lingc.passes.manager import VerifyError

    p = TensorParallel(tp)
    before = result.program
    new, record = _linted(p.run(before), "tp")
    if verify:
        record.verify = verify_tp(before, rank_programs(new, p.rank_weights), p.tolerance)
        if not record.verify["ok"]:
            bad = {g: r["problems"] for g, r in record.verify["graphs"].items() if r["problems"]}
            raise VerifyError(f"--verify failed after pass 'tp': {bad}")
    _append_stage(result, "tp", new, record, f"numerics changed, {tp} ranks")

    before = result.program
    new, record = _linted(FuseAllReduceNorm().run(before), "fuse_all_reduce_norm")
    if verify:
        record.verify = verify_unchanged_in_lockstep(before, new, p.rank_weights)
        if not record.verify["ok"]:
            raise VerifyError(f"--verify failed after pass 'fuse_all_reduce_norm': {record.verify['graphs']}")
    _append_stage(result, "fuse_all_reduce_norm", new, record, "numerics unchanged")
    return p.rank_weights


def _linted(run: tuple[Program, Any], name: str) -> tuple[Program, Any]:
    from lingc.ir.lint import LintError, lint
    try:
        lint(run[0])
    except LintError as e:
        raise LintError(f"after pass '{name}': {e}") from None
    return run


def _append_stage(result: Any, name: str, new: Program, record: Any, note: str) -> None:
    """Snapshot `new` as the next stage of `result` (its text with a header, as the PassManager writes them)."""
    from lingc.ir.text import program_text
    from lingc.passes.manager import Stage
    index = len(result.stages)
    header = (f"# stage {index:02d}: {name} (v{record.version}, {record.ms:.1f} ms, +{len(record.nodes_added)} "
              f"-{len(record.nodes_removed)} ~{len(record.nodes_rewritten)} nodes, {note})")
    result.stages.append(Stage(index, name, program_text(new, header), record))
    result.program = new


def verify_unchanged_in_lockstep(before: Program, after: Program,
                                 rank_weights: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """--verify for a numerics-preserving pass after tp: every graph's N ranks in lockstep before and after, on the
    same seeded (rank-sized) inputs; rank 0's outputs must be bit-identical."""
    from lingc.passes.verify import random_inputs
    old_ranks, new_ranks = rank_programs(before, rank_weights), rank_programs(after, rank_weights)
    tp = len(rank_weights)
    report: dict[str, Any] = {"exact": True, "graphs": {}, "ok": True, "tp": tp}
    for graph in sorted(after.graphs):
        inputs = random_inputs(before, [graph])                  # rank-sized already: every rank gets a copy
        outs = [run_lockstep(ranks, graph, [{k: v.clone() for k, v in inputs.items()} for _ in range(tp)])[0]
                for ranks in (old_ranks, new_ranks)]
        flat = [[v for v in (o if isinstance(o, (tuple, list)) else [o]) if v is not None] for o in outs]
        same = len(flat[0]) == len(flat[1]) and all(torch.equal(a, b) for a, b in zip(*flat))
        report["graphs"][graph] = {"problems": [] if same else ["rank 0's outputs are not bit-identical"]}
        report["ok"] &= same
    return report
