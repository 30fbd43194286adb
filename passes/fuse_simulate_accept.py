"""fuse_simulate_accept: verify's accept op and the simulate_accept knob after it -> one op, one launch fewer (two in
the greedy copies, whose uniform only the knob reads).

Every verify graph ends its acceptance with simulate_accept (the benchmark knob `--simulate-accept-len`; with the
knob off, mean 0, it passes accept_len through), a ~1 us launch on every verify step whether or not anyone
benchmarks; in the greedy copies it also keeps the uniform launch alive, whose one value it reads.

Before (verify_greedy, K = 5 drafts):
    verify_uniform = lingc.uniform(seed, counter, 8, 5)                                  # [B, 8]
    verify_greedy_accept = lingc.greedy_accept(verify_slice, logits)                     # (accept_len, tokens)
    verify_getitem = getitem(verify_greedy_accept, 0)
    verify_select = aten.select(verify_uniform, 1, 7)
    verify_simulate_accept = lingc.simulate_accept(verify_getitem, mean, verify_select, 6)
After:
    verify_greedy_accept_simulated = lingc.greedy_accept_simulated(verify_slice, logits, mean, seed, counter, 12, 6)
    verify_simulate_accept = getitem(verify_greedy_accept_simulated, 0)
    verify_getitem_1 = getitem(verify_greedy_accept_simulated, 1)                        # tokens, as before
The general graph's chain_accept (which reads the uniforms' first K + 1 columns itself) becomes
chain_accept_simulated(..., u, mean, verify_select, 6): the uniform stays, the knob goes into chain_accept's launch.

Matched: a simulate_accept whose accept_len is output 0 of a greedy_accept or chain_accept read by nothing else,
and whose uniform is a select of a column of a lingc.uniform; for greedy_accept that uniform must be read by the
select only and the select by the knob only (else the layer is left alone). The fused op goes where the knob was
(every argument is defined by then) and the tokens' getitem moves after it, so nothing that reads the accept op's
tokens may come before the knob.

Numerics unchanged: the ops' references are the compositions (lingc/ops/spec.py); the kernel is chain_accept's
stage 2 with simulate_accept's arithmetic (and, greedy, the uniform kernel's hash) on the same values, shared code
(kernels/sample.py `_simulated`, `_uniform_value`): the same integers (tests/kernels/test_accept_simulated.py).
Order: after specialize_greedy (it makes greedy_accept), partition and fuse_relay (until it merges verify's relay
writes into one scatter at the graph's end, one of them reads the tokens before the knob: details['skipped'] says
so); before pdl.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from lingc.ops import OPS
from lingc.program import Program
from lingc.passes.base import Pass
from lingc.passes.matchers import carried_meta

SELECT = torch.ops.aten.select.int


TOKENS_READ_EARLY = "the tokens are read before the knob (a relay write not yet merged: run fuse_relay first)"


def _match(sim: fx.Node, skipped: list[str] | None = None) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """(accept op, its output-0 getitem, the select, the uniform) when `sim` matches (module docstring); a near
    miss on the order appends its reason to `skipped`."""
    accept_len, _, u_sel, _ = sim.args
    if not (isinstance(accept_len, fx.Node) and accept_len.target is operator.getitem and accept_len.args[1] == 0
            and len(accept_len.users) == 1):
        return None
    acc = accept_len.args[0]
    if acc.target not in (OPS.greedy_accept, OPS.chain_accept):
        return None
    if not (isinstance(u_sel, fx.Node) and u_sel.target is SELECT and u_sel.args[1] in (1, -1)
            and u_sel.args[0].target is OPS.uniform):
        return None
    uniform = u_sel.args[0]
    if acc.target is OPS.greedy_accept and (len(uniform.users) != 1 or len(u_sel.users) != 1):
        return None
    order = {n: i for i, n in enumerate(sim.graph.nodes)}
    if any(order[r] < order[sim] for item in acc.users if item is not accept_len for r in item.users):
        if skipped is not None:                     # the fused op goes where the knob is: it cannot feed them
            skipped.append(f"{sim.name}: {TOKENS_READ_EARLY}")
        return None
    return acc, accept_len, u_sel, uniform


def _fuse(graph: fx.Graph, sim: fx.Node, acc: fx.Node, accept_len: fx.Node, u_sel: fx.Node,
          uniform: fx.Node) -> fx.Node:
    _, mean, _, max_accept = sim.args
    greedy = acc.target is OPS.greedy_accept
    if greedy:
        seed, counter, n, offset = (*uniform.args, uniform.kwargs.get("offset", 0))[:4]
        col = u_sel.args[2] if u_sel.args[2] >= 0 else u_sel.args[2] + n
        target, args = OPS.greedy_accept_simulated, (*acc.args, mean, seed, counter, offset + col, max_accept)
    else:
        target, args = OPS.chain_accept_simulated, (*acc.args, mean, u_sel, max_accept)
    with graph.inserting_before(sim):
        fused = graph.call_function(target, args)
    fused.meta = carried_meta(acc)
    fused._rename(acc.name + "_simulated")
    sim.target, sim.args, sim.kwargs = operator.getitem, (fused, 0), {}
    for item in list(acc.users):                               # tokens (output 1) read the fused op now
        if item is not accept_len:
            item.args = (fused, item.args[1])
            fused.append(item)                                 # after it (their readers all come after the knob)
    graph.erase_node(accept_len)
    graph.erase_node(acc)
    if greedy:                                                  # the uniform only the knob read goes too
        graph.erase_node(u_sel)
        graph.erase_node(uniform)
    return fused


class FuseSimulateAccept(Pass):
    name = "fuse_simulate_accept"
    summary = "verify's greedy_accept / chain_accept + simulate_accept (+ the greedy copy's uniform) -> one op"
    after = ("partition", "specialize_greedy", "fuse_relay", "fuse_emit")
    changes_numerics = False

    def apply(self, program: Program) -> dict[str, Any]:
        fused: list[str] = []
        skipped: list[str] = []
        for gname, graph in program.graphs.items():
            for sim in [n for n in graph.nodes if n.op == "call_function" and n.target is OPS.simulate_accept]:
                found = _match(sim, skipped)
                if found is not None:
                    fused.append(f"{gname}:{_fuse(graph, sim, *found).name}")
        return {"matches": len(fused), "fused": fused, "skipped": skipped}
