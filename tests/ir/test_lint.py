"""lingc.ir.lint: a traced program is clean; each way of breaking a graph is a LintError naming graph and node.

Like Thunder's check_trace test: start from a good program, break one thing, expect the named error.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from lingc.ir.lint import LintError, lint
from lingc.ops import OPS
from lingc.program import Program, TensorMeta


def node(program: Program, graph: str, name: str) -> fx.Node:
    return next(n for n in program.graphs[graph].nodes if n.name == name)


@pytest.fixture
def program(tiny_program: Program) -> Program:
    """A private copy of the fp32 tiny program that a test may break."""
    return tiny_program.copy()


def test_traced_programs_are_clean(tiny_program, tiny_program_bf16):
    lint(tiny_program)
    lint(tiny_program_bf16)


def test_unknown_weight(program):
    node(program, "decode", "w_L1_mlp_experts_w13").target = "model.layers.1.mlp.experts.w13_missing"
    with pytest.raises(LintError, match="graph 'decode', node 'w_L1_mlp_experts_w13': reads weight "
                                        "'model.layers.1.mlp.experts.w13_missing', which the program does not have"):
        lint(program)


def test_weight_dropped_from_the_program(program):
    del program.weights["lm_head.weight"]
    with pytest.raises(LintError, match="node 'w_lm_head_weight': reads weight 'lm_head.weight'"):
        lint(program)


def test_weight_meta_disagrees_with_the_tensor(program):
    program.weights["lm_head.weight"] = program.weights["lm_head.weight"].to(torch.bfloat16)
    with pytest.raises(LintError, match=r"node 'w_lm_head_weight': meta .* does not match weight \[512, 128\] "
                                        r"torch.bfloat16"):
        lint(program)


def test_dead_pure_node(program):
    graph = program.graphs["decode"]
    up = node(program, "decode", "L1_mlp_moe_up")
    with graph.inserting_after(up):
        dead = graph.call_function(OPS.silu_and_mul, (up, 0.0))
    dead.name = "L1_mlp_dead_silu_and_mul"
    dead.meta = {"lingc.tensor": TensorMeta((4, 64), torch.float32)}
    with pytest.raises(LintError, match="graph 'decode', node 'L1_mlp_dead_silu_and_mul': result unused and the "
                                        r"op has no side effects \(dead code\)"):
        lint(program)


def test_unused_mutating_op_is_not_dead(tiny_program):
    """mla_cache_write returns nothing and nobody reads its result; it writes the cache, so it stays. So do the
    engine steps' relay writes, token publication and KDA commits."""
    writes = [n for n in tiny_program.graphs["decode"].nodes if n.target is OPS.mla_cache_write]
    assert len(writes) == 3 and all(not n.users for n in writes)
    nextn = tiny_program.graphs["nextn"].nodes
    for op, count in ((OPS.scatter_rows, 6), (OPS.emit_tokens, 1), (OPS.kda_commit, 12)):
        found = [n for n in nextn if n.target is op]
        assert len(found) == count and all(not n.users for n in found), op
    lint(tiny_program)


def test_missing_meta(program):
    del node(program, "nextn", "L2_mlp_moe_down").meta["lingc.tensor"]
    with pytest.raises(LintError, match="graph 'nextn', node 'L2_mlp_moe_down': no 'lingc.tensor' meta"):
        lint(program)


def test_placeholder_without_role(program):
    del node(program, "mtp_prefill", "hidden").meta["lingc.input"]
    with pytest.raises(LintError, match="graph 'mtp_prefill', node 'hidden': input has no 'lingc.input' role"):
        lint(program)


def test_op_outside_allowlist(program):
    graph = program.graphs["decode"]
    up = node(program, "decode", "L1_mlp_moe_up")
    act = node(program, "decode", "L1_mlp_silu_and_mul")
    with graph.inserting_after(up):
        relu = graph.call_function(torch.ops.aten.relu.default, (up,))
    relu.meta = dict(up.meta)
    act.replace_input_with(up, relu)
    with pytest.raises(LintError, match=f"graph 'decode', node '{relu.name}': op 'aten.relu' is not in the lingc "
                                        "allowlist"):
        lint(program)


def test_use_before_definition(program):
    """fx's own graph lint runs first: move a node above its input."""
    act = node(program, "decode", "L1_mlp_silu_and_mul")
    node(program, "decode", "L1_mlp_moe_up").prepend(act)
    with pytest.raises(LintError, match="graph 'decode': .*L1_mlp_moe_up"):
        lint(program)
