"""lingc.ir.shapes.propagate: re-inferring every node's lingc.tensor on fake tensors reproduces the traced meta."""

from __future__ import annotations

import torch

from lingc.ir.shapes import propagate
from lingc.program import TensorMeta


def test_propagate_reproduces_traced_meta(tiny_program):
    program = tiny_program.copy()
    for graph in program.graphs.values():
        for node in graph.nodes:
            if node.op in ("call_function", "get_attr"):
                node.meta.pop("lingc.tensor", None)
    propagate(program)
    for name, graph in program.graphs.items():
        want = {n.name: n.meta.get("lingc.tensor") for n in tiny_program.graphs[name].nodes if n.op != "output"}
        got = {n.name: n.meta.get("lingc.tensor") for n in graph.nodes if n.op != "output"}
        assert got == want, name


def test_propagate_follows_a_weight_dtype_change(tiny_program):
    program = tiny_program.copy()
    program.weights["lm_head.weight"] = program.weights["lm_head.weight"].to(torch.bfloat16)
    propagate(program)
    head = next(n for n in program.graphs["decode"].nodes if n.name == "w_lm_head_weight")
    assert head.meta["lingc.tensor"] == TensorMeta((512, 128), torch.bfloat16)
    logits = next(n for n in program.graphs["decode"].nodes if n.name == "lm_head_linear")
    assert logits.meta["lingc.tensor"] == TensorMeta((1, 1, 512), torch.float32)    # out_dtype stays fp32


def test_memo_hits_give_what_a_fresh_fake_run_gives(tiny_program):
    """After every pass (memo warm: most nodes are hits, misses run on stand-in fakes) the metas equal those of a
    propagation that starts with an empty memo (every op run on the real chain of fake values)."""
    from lingc.ir import shapes
    from lingc.passes.manager import PassManager
    program = PassManager(["all"]).run(tiny_program.copy()).program
    warm = {(g, n.name): n.meta.get("lingc.tensor") for g, gr in program.graphs.items() for n in gr.nodes}
    saved = dict(shapes._MEMO)
    shapes._MEMO.clear()
    try:
        propagate(program)
    finally:
        shapes._MEMO.update(saved)
    cold = {(g, n.name): n.meta.get("lingc.tensor") for g, gr in program.graphs.items() for n in gr.nodes}
    assert warm == cold

