"""fuse_emit: a verify graph's publish tail in one op: emit_tokens, the next root's pick_position and the seq_len add.

Before (verify_greedy, test-tiny; verify likewise):
    emit_tokens(relay_out_tokens, relay_out_len, slots, tokens, accept_len)
    verify_pick_position = lingc.pick_position(tokens, accept_len, -1)     # [B, 1]: the last accepted token
    verify_add = aten.add.Tensor(seq, accept_len)                          # [B]: the next seq_len
After:
    verify_emit_accepted = lingc.emit_accepted(relay_out_tokens, relay_out_len, slots, tokens, accept_len, seq)
    verify_pick_position = getitem(verify_emit_accepted, 0); verify_add = getitem(verify_emit_accepted, 1)
Launches: 3 -> 1 (the add was a torch kernel). On the H200 the three took 0.70 + 1.79 + 1.95 us of greedy verify's
exposed time (bench/results/launches-kda-tma-h200-20261204.json). Measured on an H100 (2026-12-05, one process, three
baselines; bench/results/step-ab-emit-h100-20261205.json): greedy verify 3-5 us faster with it in every pairing,
emit_accepted 0.90 us exposed (launches-h100-20261205.json); greedy parity held on the GPU.

Rules (per emit_tokens with a count): the pick must read the emit's tokens at its count with offset -1; the add
(alpha 1) must add the count to an integer tensor of the count's shape; both must exist (verify's tail always has
them). The fused op runs where the earliest of the three ran, so its inputs must be defined there, and nothing from
there to the last of the three may write the tokens, the count or seq, or read or write out_tokens / out_len (the
emit moves, never past a use of its buffers). Integer copies and the same add: numerics unchanged (the op's
reference is the composition).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import KEEP_META_CAPTURE, base_buffer, calls, carried_meta, written_buffers



def _int_vector(node: Any, like: fx.Node) -> bool:
    meta, want = getattr(node, "meta", {}).get("lingc.tensor"), like.meta.get("lingc.tensor")
    return (isinstance(node, fx.Node) and meta is not None and want is not None
            and not meta.dtype.is_floating_point and meta.dtype != torch.bool
            and tuple(meta.shape) == tuple(want.shape))


def _pick_of(tokens: fx.Node, count: fx.Node) -> fx.Node | None:
    """The `pick_position(tokens, count, -1)` reading the emit's tokens at its count, if any."""
    for user in tokens.users:
        if user.target is OPS.pick_position and user.args[:2] == (tokens, count) and not user.kwargs \
                and (user.args[2] if len(user.args) > 2 else 0) == -1:
            return user
    return None


def _add_of(count: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the add, its other operand) of an `aten.add.Tensor(seq, count)` / `(count, seq)` without alpha."""
    for user in count.users:
        if user.target is torch.ops.aten.add.Tensor and len(user.args) == 2 and not user.kwargs:
            other = user.args[0] if user.args[1] is count else user.args[1]
            if other is not count and _int_vector(other, count):
                return user, other
    return None


def _movable(graph: fx.Graph, first: fx.Node, last: fx.Node, inputs: list[fx.Node], mutated: list[fx.Node],
             replaced: set[fx.Node]) -> bool:
    """Whether the fused op may run at `first` for the replaced nodes up to `last` (module docstring's rules)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    if any(order[i] >= order[first] for i in inputs):
        return False
    watched = {base_buffer(i) for i in inputs}
    touched = {base_buffer(m) for m in mutated}
    for node in list(graph.nodes)[order[first]:order[last] + 1]:
        if node in replaced:
            continue
        writes = written_buffers(node)
        reads = {base_buffer(i) for i in node.all_input_nodes}
        if writes & watched or (writes | reads) & touched:
            return False
    return True


class FuseEmit(Pass):
    name = "fuse_emit"
    summary = "a verify's emit_tokens + the next root's pick_position + the seq_len add -> one emit_accepted"
    after = ("partition", "specialize_greedy")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused = []
        for gname, graph in program.graphs.items():
            for emit in calls(graph, "emit_tokens"):
                if len(emit.args) < 5 or emit.args[4] is None or emit.kwargs:
                    continue
                out_tokens, out_len, slots, tokens, count = emit.args[:5]
                pick, found = _pick_of(tokens, count), _add_of(count)
                if pick is None or found is None:
                    continue
                add, seq = found
                group = [emit, pick, add]
                order = {n: i for i, n in enumerate(graph.nodes)}
                first, last = min(group, key=order.get), max(group, key=order.get)
                if not _movable(graph, first, last, [slots, tokens, count, seq], [out_tokens, out_len], set(group)):
                    continue
                with graph.inserting_before(first):
                    new = graph.call_function(OPS.emit_accepted, (out_tokens, out_len, slots, tokens, count, seq))
                new.meta = carried_meta(emit, KEEP_META_CAPTURE)
                new._rename(emit.name.replace("emit_tokens", "emit_accepted"))
                for k, old in enumerate((pick, add)):   # the old node becomes the getitem (same name, same place)
                    old.target, old.args, old.kwargs = operator.getitem, (new, k), {}
                graph.erase_node(emit)
                fused.append(f"{gname}:{new.name}")
        return {"matches": len(fused), "fused": fused}
