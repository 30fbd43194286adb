"""lingc.ir.serialize: JSON graphs round-trip exactly, and loading resolves ops only through the allowlist.

A graph file is data: every call target is looked up by name in `allowed_ops()`, so a file naming any
other callable ('os.system', 'builtins.eval', even a real aten op like 'aten.mm') is refused with an
IRError naming the graph, node and op; so is a node used before it is defined.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lingc.ir.serialize import IRError, allowed_ops, graph_from_json, graph_to_json
from lingc.ir.text import program_text
from lingc.ops.registry import op_name
from lingc.passes.manager import PassManager
from lingc.passes.verify import random_inputs
from lingc.program import Program
from lingc.trace import PROGRAMS


def round_trip(program: Program) -> Program:
    """Every graph through graph_to_json -> JSON text -> graph_from_json; weights and info shared."""
    graphs = {name: graph_from_json(json.loads(json.dumps(graph_to_json(g))), name)
              for name, g in program.graphs.items()}
    return Program(program.config, graphs, program.weights, program.weight_info, program.options)


def decode_nodes(program: Program) -> list[dict]:
    """The decode graph as JSON node entries (a fresh copy the test may corrupt)."""
    return copy.deepcopy(graph_to_json(program.graphs["decode"]))


def find(nodes: list[dict], name: str) -> int:
    return next(i for i, n in enumerate(nodes) if n["name"] == name)


@pytest.fixture(scope="module")
def compiled(tiny_program: Program) -> Program:
    """The fp32 tiny program after every pass: its nodes carry pdl / dtype / layout meta too."""
    return PassManager(["all"]).run(tiny_program).program


# ---- round trip ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["traced", "compiled"])
def test_round_trip_preserves_text_and_json(stage, request):
    program = request.getfixturevalue("tiny_program" if stage == "traced" else "compiled")
    loaded = round_trip(program)
    assert program_text(loaded) == program_text(program)
    assert set(loaded.graphs) == set(program.graphs)
    split = {"draft", "verify", "extend"} | set(PROGRAMS) - {"nextn"}               # after partition
    split |= {"step_greedy", "draft_greedy", "verify_greedy", "extend_greedy"}      # specialize_greedy's copies
    assert set(program.graphs) == (split if stage == "compiled" else set(PROGRAMS))
    for name in program.graphs:
        assert graph_to_json(loaded.graphs[name]) == graph_to_json(program.graphs[name])


@pytest.mark.parametrize("name", PROGRAMS)
def test_round_trip_outputs_are_bit_exact(tiny_program, name):
    loaded = round_trip(tiny_program)
    inputs_a = random_inputs(tiny_program, name)
    inputs_b = {k: v.clone() for k, v in inputs_a.items()}
    outs_a, outs_b = tiny_program.run(name, inputs_a), loaded.run(name, inputs_b)
    if name in ("step", "nextn"):                     # engine steps: results in relays and pools, output None
        assert list(outs_a) == list(outs_b) == [None]
    else:                                             # logits, hidden
        assert len(outs_a) == len(outs_b) == 2
        for i, (a, b) in enumerate(zip(outs_a, outs_b)):
            assert torch.equal(a, b), f"{name} output[{i}] changed in the round trip"
    for key in inputs_a:
        assert torch.equal(inputs_a[key], inputs_b[key]), f"{name} state {key} changed in the round trip"


def test_json_is_plain_data(tiny_program):
    """No pickles or code: node entries hold names, JSON scalars and {'node'|'dtype'|'float': ...} objects."""
    nodes = graph_to_json(tiny_program.graphs["decode"])
    text = json.dumps(nodes)
    assert "torch.ops" not in text and "<" not in text                        # no reprs of Python objects
    up = nodes[find(nodes, "L1_mlp_moe_up")]
    assert up["op"] == "call_function" and up["target"] == "lingc.moe_up"
    assert up["args"][0] == {"node": "L1_mlp_view"} and up["args"][-2:] == [4, 16]
    head = nodes[find(nodes, "lm_head_linear")]
    assert head["args"][2] == {"dtype": "float32"}
    assert head["meta"]["lingc.tensor"] == {"shape": [1, 1, 512], "dtype": "float32"}


def test_non_default_overloads_are_named_once():
    """Regression: op_name used OpOverload.name(), which already ends in the overload, so the IR
    called aten.squeeze.dim 'aten.squeeze.dim.dim' (and split.Tensor 'aten.split.Tensor.Tensor')."""
    assert op_name(torch.ops.aten.squeeze.dim) == "aten.squeeze.dim"
    assert op_name(torch.ops.aten.split.Tensor) == "aten.split.Tensor"
    assert op_name(torch.ops.aten.view.default) == "aten.view"
    assert op_name(torch.ops.lingc.moe_up.default) == "lingc.moe_up"
    assert {"aten.squeeze.dim", "aten.select.int", "aten.slice.Tensor", "getitem"} <= set(allowed_ops())
    assert not any(name.count(".") > 2 for name in allowed_ops())


# ---- refused files ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["aten.mm", "builtins.eval", "os.system", "torch.ops.lingc.linear", "linear"])
def test_op_outside_allowlist_is_refused(tiny_program, op):
    nodes = decode_nodes(tiny_program)
    nodes[find(nodes, "L1_mlp_moe_up")]["target"] = op
    with pytest.raises(IRError, match=rf"graph 'decode', node 'L1_mlp_moe_up': unknown op '{op}' "
                                      r"\(not in the lingc allowlist\)"):
        graph_from_json(nodes, "decode")


def test_forward_reference_is_refused(tiny_program):
    """Move a node above the node it reads."""
    nodes = decode_nodes(tiny_program)
    act = nodes.pop(find(nodes, "L1_mlp_silu_and_mul"))
    nodes.insert(find(nodes, "L1_mlp_moe_up"), act)
    with pytest.raises(IRError, match="graph 'decode', node 'L1_mlp_silu_and_mul': uses 'L1_mlp_moe_up' "
                                      "before it is defined"):
        graph_from_json(nodes, "decode")


def test_deleted_definition_is_refused(tiny_program):
    """Thunder's check_trace test: delete one line and expect the error that names it."""
    nodes = decode_nodes(tiny_program)
    del nodes[find(nodes, "L1_mlp_moe_up")]
    with pytest.raises(IRError, match="node 'L1_mlp_silu_and_mul': uses 'L1_mlp_moe_up' before it is defined"):
        graph_from_json(nodes, "decode")


@pytest.mark.parametrize("kind", ["call_module", "call_method", "exec"])
def test_unknown_node_kind_is_refused(tiny_program, kind):
    nodes = decode_nodes(tiny_program)
    nodes[find(nodes, "L1_mlp_moe_up")]["op"] = kind
    with pytest.raises(IRError, match=f"node 'L1_mlp_moe_up': unknown node kind '{kind}'"):
        graph_from_json(nodes, "decode")


def test_unknown_argument_object_is_refused(tiny_program):
    nodes = decode_nodes(tiny_program)
    nodes[find(nodes, "L1_mlp_moe_up")]["args"][-1] = {"pickle": "gASVAAAAAAAAAAB9lC4="}
    with pytest.raises(IRError, match="node 'L1_mlp_moe_up': unknown argument object"):
        graph_from_json(nodes, "decode")


def test_bad_dtype_or_float_names_the_node(tiny_program):
    """Regression: an unknown dtype name (in an argument or in meta) or bad float text escaped as a bare
    ValueError without graph or node, and the artifact loader, which wraps only IRError, let it through."""
    nodes = decode_nodes(tiny_program)
    nodes[find(nodes, "lm_head_linear")]["args"][2] = {"dtype": "float128"}
    with pytest.raises(IRError, match="graph 'decode', node 'lm_head_linear': unknown dtype 'float128'"):
        graph_from_json(nodes, "decode")
    nodes = decode_nodes(tiny_program)
    nodes[find(nodes, "L1_mlp_moe_up")]["args"][-1] = {"float": "lots"}
    with pytest.raises(IRError, match="node 'L1_mlp_moe_up': could not convert string to float"):
        graph_from_json(nodes, "decode")
    nodes = decode_nodes(tiny_program)
    nodes[find(nodes, "L1_mlp_moe_up")]["meta"]["lingc.tensor"]["dtype"] = "float8"
    with pytest.raises(IRError, match=r"node 'L1_mlp_moe_up': bad meta \(ValueError: unknown dtype 'float8'"):
        graph_from_json(nodes, "decode")


def test_non_finite_floats_round_trip(tiny_program):
    nodes = decode_nodes(tiny_program)
    nodes[find(nodes, "L4_mlp_silu_and_mul")]["args"][1] = {"float": "inf"}
    graph = graph_from_json(nodes, "decode")
    act = next(n for n in graph.nodes if n.name == "L4_mlp_silu_and_mul")
    assert act.args[1] == float("inf")
    assert graph_to_json(graph)[find(nodes, "L4_mlp_silu_and_mul")]["args"][1] == {"float": "inf"}


def test_duplicate_node_name_is_refused(tiny_program):
    nodes = decode_nodes(tiny_program)
    up = nodes[find(nodes, "L1_mlp_moe_up")]
    nodes.insert(find(nodes, "L1_mlp_moe_up") + 1, dict(up))
    with pytest.raises(IRError, match="node 'L1_mlp_moe_up': duplicate node name"):
        graph_from_json(nodes, "decode")


def test_unserialisable_argument_is_an_error(tiny_program):
    program = tiny_program.copy()
    up = next(n for n in program.graphs["decode"].nodes if n.name == "L1_mlp_moe_up")
    up.args = (*up.args[:-1], object())
    with pytest.raises(IRError, match="cannot serialise argument .* of type object"):
        graph_to_json(program.graphs["decode"])
