"""fuse_kda: one launch for a KDA layer's decode or verify mixer, one for its prefill convs, one for its commits.

At batch 1 a KDA layer's small kernels cost mostly launches (Ling-3.0-tiny: 18 KDA layers). Four rewrites,
in every graph (B batch, T tokens, H heads, D head dim, P = H * D):

1. decode / step / prefill: the three in-place convs feeding one recurrence -> kda_conv_qkv (in decode and step,
the first half of rewrite 4).
Before:
    L0_attention_q_conv1d_kda_conv = lingc.kda_conv(L0_attention_q_proj_linear, w_L0_attention_q_conv1d_weight,
                                                    state_layers_0_conv_q, slots)                # [B, T, P]
    L0_attention_view = aten.view(L0_attention_q_conv1d_kda_conv, [B, T, H, D])
    ...                                                                                           # k, v likewise
    L0_attention_kda_recurrent = lingc.kda_recurrent(L0_attention_view, L0_attention_view_1, L0_attention_view_2, ...)
After:
    L0_attention_kda_conv_qkv = lingc.kda_conv_qkv(L0_attention_q_proj_linear, L0_attention_k_proj_linear,
        L0_attention_v_proj_linear, w_L0_attention_q_conv1d_weight, w_..._k_conv1d_weight, w_..._v_conv1d_weight,
        state_layers_0_conv_q, state_layers_0_conv_k, state_layers_0_conv_v, slots)             # (q, k, v)
    L0_attention_q_conv1d_kda_conv = getitem(L0_attention_kda_conv_qkv, 0)          # k 1, v 2; names kept
    L0_attention_view = aten.view(L0_attention_q_conv1d_kda_conv, [B, T, H, D])      # readers untouched
The fused op sits where the last conv was (the k and v projections come after the q conv in traced order);
the earlier convs' getitems and the views reading them move down after it.

2. verify: the three staged convs whose outputs only the staged recurrence reads -> kda_fused_verify.
Before:
    L0_attention_q_conv1d_kda_conv_staged = lingc.kda_conv_staged(L0_attention_q_proj_linear,
        w_L0_attention_q_conv1d_weight, state_layers_0_conv_q, slots, staging_layers_0_conv_q)   # [B, T, P]
    L0_attention_view = aten.view(L0_attention_q_conv1d_kda_conv_staged, [B, T, H, D])
    ...                                                                                           # k, v likewise
    L0_attention_kda_recurrent_staged = lingc.kda_recurrent_staged(L0_attention_view, L0_attention_view_1,
        L0_attention_view_2, L0_attention_view_3, L0_attention_b_proj_linear, w_L0_attention_A_log,
        w_L0_attention_dt_bias, state_layers_0_recurrent, slots, staging_layers_0_recurrent, -5.0)   # [B, T, H, D]
After:
    L0_attention_kda_fused_verify = lingc.kda_fused_verify(L0_attention_q_proj_linear, L0_attention_k_proj_linear,
        L0_attention_v_proj_linear, L0_attention_view_3, L0_attention_b_proj_linear, w_..._q_conv1d_weight,
        w_..._k_conv1d_weight, w_..._v_conv1d_weight, state_layers_0_conv_q, state_layers_0_conv_k,
        state_layers_0_conv_v, w_L0_attention_A_log, w_L0_attention_dt_bias, state_layers_0_recurrent, slots,
        staging_layers_0_conv_q, staging_layers_0_conv_k, staging_layers_0_conv_v, staging_layers_0_recurrent, -5.0)

3. verify (after acceptance): a run of consecutive kda_commit of one layer with the same slots and accept_len
(at most 4: conv_q, conv_k, conv_v, recurrent) -> kda_commit_multi, where the last of them was (with
FuseKda.commit_pairs = 8, the default, two layers' runs -> one kda_commit_multi of 8 pairs; 4 keeps one layer; up to
80, COMMIT_MULTI_PAIRS, puts more layers in one launch).
Before:
    verify_kda_commit = lingc.kda_commit(state_layers_0_conv_q, slots, staging_layers_0_conv_q, accept_len)
    ...                                                                      # conv_k, conv_v, recurrent
After:
    verify_L0_kda_commit_multi = lingc.kda_commit_multi(slots, accept_len, [state_layers_0_conv_q, ...,
        state_layers_0_recurrent], [staging_layers_0_conv_q, ..., staging_layers_0_recurrent])

4. decode / step: a kda_conv_qkv whose outputs (through getitem and view) only one kda_recurrent reads -> one
kda_fused_decode where the recurrence was (rewrite 1 made the kda_conv_qkv).
Before:
    L0_attention_kda_conv_qkv = lingc.kda_conv_qkv(L0_attention_q_proj_linear, ..., slots)    # as rewrite 1 left it
    L0_attention_q_conv1d_kda_conv = getitem(L0_attention_kda_conv_qkv, 0)                      # k 1, v 2
    L0_attention_view = aten.view(L0_attention_q_conv1d_kda_conv, [B, T, H, D])
    ...
    L0_attention_kda_recurrent = lingc.kda_recurrent(L0_attention_view, L0_attention_view_1, L0_attention_view_2,
        L0_attention_view_3, L0_attention_b_proj_linear, w_L0_attention_A_log, w_L0_attention_dt_bias,
        state_layers_0_recurrent, slots, -5.0)                                                    # [B, T, H, D]
After:
    L0_attention_kda_fused_decode = lingc.kda_fused_decode(L0_attention_q_proj_linear, L0_attention_k_proj_linear,
        L0_attention_v_proj_linear, L0_attention_view_3, L0_attention_b_proj_linear, w_..._q_conv1d_weight,
        w_..._k_conv1d_weight, w_..._v_conv1d_weight, state_layers_0_conv_q, state_layers_0_conv_k,
        state_layers_0_conv_v, w_L0_attention_A_log, w_L0_attention_dt_bias, state_layers_0_recurrent, slots, -5.0)
The getitems, the views and the kda_conv_qkv go; the recurrence's readers (the gated norm) read the fused op.

A fused op runs its members at one place, so a group fuses only if nothing between a member and that place
writes what the member reads or writes, or reads what it writes (pools and stagings compared through views).
Each fused op's reference is the composite it replaces (lingc/ops/kda.py) and its kernel runs the replaced
kernels' arithmetic (kernels/kda.py): numerics unchanged, bit for bit. Runs after partition (so each of
draft / verify / extend is matched on its own) and after fuse_projections (q, k, v are then column views of
one projection; the kernels take strides); pdl runs after it and chains kda_fused_decode -> gated_rmsnorm,
kda_fused_verify -> gated_rmsnorm and, in prefill, kda_conv_qkv -> kda_chunk -> gated_rmsnorm.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from lingc.knobs import env_flag
from lingc.ops import OPS
from lingc.ops.kda import COMMIT_MULTI_PAIRS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import base_buffer as _base, calls, carried_meta, is_free, written_buffers as _writes

# rewrite 4 (decode's kda_conv_qkv + kda_recurrent -> kda_fused_decode); LINGC_KDA_FUSED_DECODE=0 keeps the two
# launches (an A/B knob for bench/device_step.py: the one launch measured slower alone on the H200, kernels/kda.py)
FUSED_DECODE = env_flag("LINGC_KDA_FUSED_DECODE", True)

aten = torch.ops.aten
HEAD_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
LAYER_COMMITS = 4                    # a KDA layer's commits: conv_q, conv_k, conv_v, recurrent


# ---- what a node reads and writes ------------------------------------------------------------------------

def _reads(node: fx.Node) -> set[fx.Node]:
    return {_base(i) for i in node.all_input_nodes}


def _can_delay(graph: fx.Graph, members: list[fx.Node], to: fx.Node) -> bool:
    """Running each member just before `to` instead of in its place gives the same values."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for member in members:
        touched, written = _reads(member) | _writes(member), _writes(member)
        for other in nodes[order[member] + 1:order[to]]:
            if _writes(other) & touched or _reads(other) & written:
                return False
    return True


def _independent(members: list[fx.Node]) -> bool:
    """No member writes what another touches: one launch runs them all at once, in no order."""
    return not any(_writes(a) & _reads(b) for a in members for b in members if a is not b)


def _conv_of(head_view: Any, op: object) -> fx.Node | None:
    """The `op` node (a conv, or a getitem of kda_conv_qkv) whose [B, T, P] output `head_view` views as
    [B, T, H, D], or None."""
    if not isinstance(head_view, fx.Node) or head_view.target not in HEAD_VIEWS:
        return None
    conv = head_view.args[0]
    return conv if isinstance(conv, fx.Node) and conv.target is op and not conv.kwargs else None


def _renamed(node: fx.Node, old: str, new: str) -> str:
    return node.name.replace(old, new) if old in node.name else f"{node.name}_{new}"


# ---- 1. decode: three in-place convs -> kda_conv_qkv ------------------------------------------------------

def _fuse_convs(graph: fx.Graph, rec: fx.Node) -> fx.Node | None:
    """kda_conv_qkv for the q/k/v convs that rec (kda_recurrent or kda_chunk) reads, or None if they can't fuse."""
    convs = [_conv_of(a, OPS.kda_conv) for a in rec.args[:3]]
    if any(c is None for c in convs) or len(set(convs)) != 3 or len({c.args[2] for c in convs}) != 3 \
            or any(c.args[3] is not convs[0].args[3] for c in convs):
        return None                                   # not three convs over distinct pools with one slots
    order = {n: i for i, n in enumerate(graph.nodes)}
    in_order = sorted(convs, key=order.__getitem__)
    last = in_order[-1]
    moved = set(in_order[:-1])                        # earlier convs become getitems after the fused op
    between = [n for n in graph.nodes if order[in_order[0]] < order[n] < order[last]]
    for n in between:
        if set(n.all_input_nodes) & moved:
            moved.add(n)
    readers = moved - set(convs)
    if any(not is_free(n) for n in readers) or any(set(c.all_input_nodes) & (moved | set(convs)) for c in convs) \
            or not _independent(convs) or not _can_delay(graph, convs, last):
        return None                                   # a kernel reads a conv early, or the move is unsafe
    with graph.inserting_before(last):
        fused = graph.call_function(OPS.kda_conv_qkv, (*(c.args[0] for c in convs), *(c.args[1] for c in convs),
                                                       *(c.args[2] for c in convs), convs[0].args[3]))
    fused.meta = carried_meta(rec)
    fused._rename(_renamed(rec, rec.target.name().split("::")[1], "kda_conv_qkv"))
    for i, conv in enumerate(convs):
        conv.target, conv.args, conv.kwargs = operator.getitem, (fused, i), {}
        conv.meta.pop("lingc.pdl", None)
    anchor = fused
    for n in sorted(moved, key=order.__getitem__):    # the earlier getitems and their views, in order
        anchor.append(n)
        anchor = n
    return fused


# ---- 2. verify: staged convs + staged recurrence -> kda_fused_verify --------------------------------------

def _fuse_verify(graph: fx.Graph, rec: fx.Node) -> fx.Node | None:
    """kda_fused_verify in place of rec (kda_recurrent_staged) and the staged convs only it reads, or None."""
    if rec.kwargs or len(rec.args) != 11:
        return None
    q, k, v, f, b, A_log, dt_bias, state_pool, slots, staging, lower_bound = rec.args
    views = [q, k, v]
    convs = [_conv_of(a, OPS.kda_conv_staged) for a in views]
    if any(c is None for c in convs) or len(set(convs)) != 3 or len(set(views)) != 3:
        return None
    heads = f.meta["lingc.tensor"].shape
    if any(c.args[3] is not slots or len(c.users) != 1 or len(view.users) != 1
           or view.meta["lingc.tensor"].shape != heads for c, view in zip(convs, views)) \
            or len({c.args[0].meta["lingc.tensor"].dtype for c in convs}) != 1:
        return None                                   # a conv output read elsewhere, or not f's head layout
    if not _independent(convs + [rec]) or not _can_delay(graph, convs, rec):
        return None
    args = (*(c.args[0] for c in convs), f, b, *(c.args[1] for c in convs), *(c.args[2] for c in convs), A_log,
            dt_bias, state_pool, slots, *(c.args[4] for c in convs), staging, lower_bound)
    with graph.inserting_before(rec):
        fused = graph.call_function(OPS.kda_fused_verify, args)
    fused.meta = carried_meta(rec)
    rec.replace_all_uses_with(fused)
    graph.erase_node(rec)
    for n in views + convs:
        graph.erase_node(n)
    fused._rename(_renamed(rec, "kda_recurrent_staged", "kda_fused_verify"))
    return fused


# ---- 3. a layer's commits -> kda_commit_multi -------------------------------------------------------------

def _layer(pool: fx.Node) -> fx.Node | str:
    """'layers.<i>' for a state pool input (state:layers.<i>.<name>); the node itself when it is not one."""
    m = re.fullmatch(r"state:(layers\.\d+)\..+", pool.meta.get("lingc.input", "")) if pool.op == "placeholder" else None
    return m.group(1) if m else pool


def _commit_groups(graph: fx.Graph, max_pairs: int) -> list[list[fx.Node]]:
    """Runs of kda_commit (only free nodes between) of one slots and accept_len, at most max_pairs; of one layer
    while max_pairs <= LAYER_COMMITS, else across layers (two layers' commits in one launch at 8)."""
    groups: list[list[fx.Node]] = [[]]
    key = None
    for node in graph.nodes:
        if node.target is OPS.kda_commit and not node.kwargs and not node.users:
            pool, slots, _, accept_len = node.args
            new_key = (slots, accept_len, _layer(pool) if max_pairs <= LAYER_COMMITS else None)
            if new_key != key or len(groups[-1]) == max_pairs or pool in {c.args[0] for c in groups[-1]}:
                groups.append([])
            groups[-1].append(node)
            key = new_key
        elif not is_free(node):
            groups.append([])                         # a kernel between commits ends the run
            key = None
    return [g for g in groups if len(g) > 1]


def _fuse_commits(graph: fx.Graph, group: list[fx.Node]) -> fx.Node | None:
    last = group[-1]
    if not _independent(group) or not _can_delay(graph, group[:-1], last):
        return None
    slots, accept_len = last.args[1], last.args[3]
    with graph.inserting_before(last):
        fused = graph.call_function(OPS.kda_commit_multi, (slots, accept_len, [c.args[0] for c in group],
                                                           [c.args[2] for c in group]))
    fused.meta = carried_meta(group[0])
    layer, prefix = _layer(group[0].args[0]), group[0].name.split("_kda_commit")[0]     # prefix: 'verify'
    name = f"{prefix}_L{layer.split('.')[1]}_kda_commit_multi" if isinstance(layer, str) \
        else _renamed(group[0], "kda_commit", "kda_commit_multi")
    for c in group:
        graph.erase_node(c)
    fused._rename(name)
    return fused


# ---- 4. decode: kda_conv_qkv + recurrence -> kda_fused_decode --------------------------------------------

def _fuse_decode(graph: fx.Graph, rec: fx.Node) -> fx.Node | None:
    """kda_fused_decode in place of rec (kda_recurrent) and the kda_conv_qkv whose outputs only it reads, or None."""
    if rec.kwargs or len(rec.args) != 10:
        return None
    q, k, v, f, b, A_log, dt_bias, state_pool, slots, lower_bound = rec.args
    views = [q, k, v]
    items = [_conv_of(a, operator.getitem) for a in views]               # the getitems the head views read
    if any(i is None for i in items) or len(set(views)) != 3:
        return None
    qkv = items[0].args[0]
    if not isinstance(qkv, fx.Node) or qkv.target is not OPS.kda_conv_qkv or qkv.kwargs \
            or [i.args for i in items] != [(qkv, 0), (qkv, 1), (qkv, 2)]:
        return None                                   # not outputs 0, 1, 2 of one kda_conv_qkv, in order
    heads = f.meta["lingc.tensor"].shape
    if qkv.args[9] is not slots or set(qkv.users) != set(items) or any(len(n.users) != 1 for n in items + views) \
            or any(view.meta["lingc.tensor"].shape != heads for view in views) \
            or len({x.meta["lingc.tensor"].dtype for x in qkv.args[:3]}) != 1:
        return None                                   # a conv output read elsewhere, or not f's head layout
    if not _independent([qkv, rec]) or not _can_delay(graph, [qkv], rec):
        return None
    args = (*qkv.args[:3], f, b, *qkv.args[3:9], A_log, dt_bias, state_pool, slots, lower_bound)
    with graph.inserting_before(rec):
        fused = graph.call_function(OPS.kda_fused_decode, args)
    fused.meta = carried_meta(rec)
    rec.replace_all_uses_with(fused)
    graph.erase_node(rec)
    for n in views + items + [qkv]:
        graph.erase_node(n)
    fused._rename(_renamed(rec, "kda_recurrent", "kda_fused_decode"))
    return fused


class FuseKda(Pass):
    name = "fuse_kda"
    summary = ("a KDA layer's 3 convs -> kda_conv_qkv; decode's kda_conv_qkv + recurrence -> kda_fused_decode; "
               "verify's convs + recurrence -> kda_fused_verify; commits -> kda_commit_multi")
    after = ("partition", "fuse_projections")
    changes_numerics = False
    # (pool, staging) pairs per kda_commit_multi: 8 puts two layers' commits in one launch (9 launches at the end of a
    # Ling-3.0-tiny verify instead of 18 at 1.9 us each exposed); LAYER_COMMITS (4) keeps one layer per launch. Same
    # bits either way. H200, one process, baselines first and last (bench/results/step-ab-h200-20261201-o.json):
    # verify 2.459 / 2.462 ms at 4 against 2.443 / 2.445 at 8. Since 2026-12-05 one launch takes up to
    # COMMIT_MULTI_PAIRS (80): 72 puts Ling-3.0-tiny's 18 layers in one, same bits; alone 15.6 us against 30.3 for
    # the 8-pair launches (kernels-meta-h200-20261205.json), but in the step greedy verify 2.1219 vs 2.1248 / 2.1267
    # ms (step-ab-h200-20261205.json, --variant 'c72:lingc.passes.fuse_kda.FuseKda.commit_pairs=72'): inside the
    # spread, so 8 stays the default
    commit_pairs = 8

    def apply(self, program: Program) -> dict[str, Any]:
        fused: dict[str, list[str]] = {"kda_conv_qkv": [], "kda_fused_decode": [], "kda_fused_verify": [],
                                       "kda_commit_multi": []}

        def record(gname: str, node: fx.Node | None) -> None:
            if node is not None:
                fused[node.target.name().split("::")[1]].append(f"{gname}:{node.name}")

        for gname, graph in program.graphs.items():
            for rec in calls(graph, "kda_recurrent_staged"):
                record(gname, _fuse_verify(graph, rec))
            for rec in calls(graph, "kda_recurrent"):                       # 1 then 4: recorded as what is left
                qkv = _fuse_convs(graph, rec)
                record(gname, (_fuse_decode(graph, rec) if FUSED_DECODE else None) or qkv)
            for rec in calls(graph, "kda_chunk"):
                record(gname, _fuse_convs(graph, rec))
            for group in _commit_groups(graph, min(self.commit_pairs, COMMIT_MULTI_PAIRS)):
                record(gname, _fuse_commits(graph, group))
        return {"matches": sum(map(len, fused.values())), **fused}
