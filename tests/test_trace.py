"""lingc.trace: every step program equals the eager reference model bit for bit on CPU, and its graph is clean IR.

The eager side calls `model.step` / `model.mtp_step` directly; the traced side runs the Program's graph
on copies of the same inputs and state. Outputs and every state tensor the step updates must be
torch.equal, in fp32 and in bf16 (the graph runs the same op references in the same order).
Letters: T tokens of the step, h hidden, V vocabulary.
"""

from __future__ import annotations

import operator

import pytest
import torch

import lingc
from lingc.ir.serialize import ATEN_ALLOWED
from lingc.model import LingForCausalLM
from lingc.ops import OPS
from lingc.presets import preset
from lingc.program import Program, TensorMeta
from lingc.state import ModelState
from lingc.trace import PROGRAMS, TraceOptions, example_inputs, state_input_name, trace

SEED = 0


@pytest.fixture(params=["fp32", "bf16"])
def traced(request: pytest.FixtureRequest) -> tuple[LingForCausalLM, Program]:
    """(reference model, its traced Program) in the parametrized dtype."""
    if request.param == "fp32":
        return request.getfixturevalue("tiny_model_fp32"), request.getfixturevalue("tiny_program")
    return request.getfixturevalue("tiny_model_bf16"), request.getfixturevalue("tiny_program_bf16")


# ---- helpers ---------------------------------------------------------------------------------------------

def target_state(model: LingForCausalLM, options: TraceOptions) -> ModelState:
    c = model.config
    return ModelState.new(c, options.batch, options.max_len, model.dtype, "cpu", range(c.num_hidden_layers))


def mtp_state(model: LingForCausalLM, options: TraceOptions) -> ModelState:
    c = model.config
    L = c.num_hidden_layers
    return ModelState.new(c, options.batch, options.max_len, model.dtype, "cpu", range(L, L + 1))


def state_inputs(state: ModelState) -> dict[str, torch.Tensor]:
    return {state_input_name(k): v for k, v in state.tensors.items()}


def positions(start: int, T: int) -> torch.Tensor:
    return torch.arange(start, start + T).view(1, T)                            # [1, T]


def prompt_ids(model: LingForCausalLM, T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, model.config.vocab_size, (1, T), generator=g)       # [1, T]


@torch.no_grad()
def prefilled(model: LingForCausalLM, options: TraceOptions) -> tuple[torch.Tensor, torch.Tensor, ModelState]:
    """(prompt ids [1, T], target hidden [1, T, h], target state) after an eager prefill of one chunk."""
    ids = prompt_ids(model, options.prefill_tokens)
    state = target_state(model, options)
    _, hidden = model.step(ids, positions(0, ids.shape[1]), state)
    return ids, hidden, state


def assert_bits_equal(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{label}: got {list(got.shape)} {got.dtype}, want {list(want.shape)} {want.dtype}"
    if not torch.equal(got, want):
        delta = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{label}: not bit-identical (max |delta| {delta:.3g})")


def assert_states_equal(got: ModelState, want: ModelState) -> None:
    assert got.tensors.keys() == want.tensors.keys()
    for key in want.tensors:
        assert_bits_equal(f"state {key}", got.tensors[key], want.tensors[key])


def run_both(model: LingForCausalLM, program: Program, name: str, plain: dict[str, torch.Tensor],
             state: ModelState) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], ModelState, ModelState]:
    """(eager outputs, graph outputs, eager state after, graph state after) from the same inputs and state."""
    eager_state, graph_state = state.clone(), state.clone()
    with torch.no_grad():
        if name in ("prefill", "decode", "verify"):
            eager = model.step(plain["input_ids"], plain["positions"], eager_state)
        else:
            eager = model.mtp_step(plain["next_ids"], plain["hidden"], plain["positions"], eager_state)
    graph = program.run(name, {**plain, **state_inputs(graph_state)})
    return eager, graph, eager_state, graph_state


# ---- numerics: each program vs the eager model -----------------------------------------------------------

def test_prefill_matches_eager(traced, tiny_options):
    model, program = traced
    T = tiny_options.prefill_tokens
    plain = {"input_ids": prompt_ids(model, T), "positions": positions(0, T)}
    state = target_state(model, tiny_options)
    eager, graph, eager_state, graph_state = run_both(model, program, "prefill", plain, state)
    assert_bits_equal("logits", graph[0], eager[0])
    assert_bits_equal("hidden", graph[1], eager[1])
    assert all(t.any() for t in eager_state.tensors.values()), "prefill should write every state tensor"
    assert_states_equal(graph_state, eager_state)


def test_decode_matches_eager(traced, tiny_options):
    model, program = traced
    ids, _, state = prefilled(model, tiny_options)
    pos = tiny_options.prefill_tokens                                          # the next position after the prompt
    plain = {"input_ids": ids[:, :1], "positions": positions(pos, 1)}
    eager, graph, eager_state, graph_state = run_both(model, program, "decode", plain, state)
    assert graph[0].shape == (1, 1, model.config.vocab_size)
    assert_bits_equal("logits", graph[0], eager[0])
    assert_bits_equal("hidden", graph[1], eager[1])
    assert_states_equal(graph_state, eager_state)


def test_verify_matches_eager(traced, tiny_options):
    model, program = traced
    ids, _, state = prefilled(model, tiny_options)
    T = tiny_options.draft_tokens
    plain = {"input_ids": ids[:, :T].flip(1), "positions": positions(tiny_options.prefill_tokens, T)}
    eager, graph, eager_state, graph_state = run_both(model, program, "verify", plain, state)
    assert graph[0].shape == (1, T, model.config.vocab_size)
    assert_bits_equal("logits", graph[0], eager[0])
    assert_bits_equal("hidden", graph[1], eager[1])
    assert_states_equal(graph_state, eager_state)


def test_extend_matches_eager(traced, tiny_options):
    model, program = traced
    ids, hidden, _ = prefilled(model, tiny_options)
    T = tiny_options.extend_tokens
    # MTP at position t reads the target's hidden at t and the token at t + 1
    plain = {"next_ids": ids[:, 1:T + 1], "hidden": hidden[:, :T], "positions": positions(0, T)}
    eager, graph, eager_state, graph_state = run_both(model, program, "extend", plain, mtp_state(model, tiny_options))
    assert_bits_equal("logits", graph[0], eager[0])
    assert_bits_equal("mtp_hidden", graph[1], eager[1])
    assert all(t.any() for t in eager_state.tensors.values()), "extend should write the MTP cache"
    assert_states_equal(graph_state, eager_state)


@torch.no_grad()
def test_draft_matches_hand_written_chain(traced, tiny_options):
    """draft = draft_tokens - 2 greedy MTP forwards, one position apart (the first draft token comes from extend)."""
    model, program = traced
    ids, hidden, _ = prefilled(model, tiny_options)
    T = tiny_options.extend_tokens
    state = mtp_state(model, tiny_options)
    _, mtp_hidden = model.mtp_step(ids[:, 1:T + 1], hidden[:, :T], positions(0, T), state)   # fill the MTP cache
    start = {"next_ids": ids[:, T + 1:T + 2], "hidden": mtp_hidden[:, -1:], "positions": positions(T, 1)}

    eager_state, graph_state = state.clone(), state.clone()
    next_ids, h, pos = start["next_ids"], start["hidden"], start["positions"]
    draft_ids, draft_logits = [], []
    for _ in range(tiny_options.draft_tokens - 2):
        logits, h = model.mtp_step(next_ids, h, pos, eager_state)
        next_ids = logits.argmax(-1)                                           # [1, 1]
        pos = pos + 1
        draft_ids.append(next_ids)
        draft_logits.append(logits)
    want_ids, want_logits = torch.cat(draft_ids, dim=1), torch.cat(draft_logits, dim=1)

    got_ids, got_logits = program.run("draft", {**start, **state_inputs(graph_state)})
    steps = tiny_options.draft_steps
    assert got_ids.shape == (1, steps - 1) and got_logits.shape == (1, steps - 1, model.config.vocab_size)
    assert_bits_equal("draft_ids", got_ids, want_ids)
    assert_bits_equal("draft_logits", got_logits, want_logits)
    assert_states_equal(graph_state, eager_state)


# ---- the shape of the graphs -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", PROGRAMS)
def test_graph_calls_only_allowlisted_ops(tiny_program, name):
    allowed = set(OPS.values()) | set(ATEN_ALLOWED) | {operator.getitem}
    graph = tiny_program.graphs[name]
    kinds = {n.op for n in graph.nodes}
    assert kinds <= {"placeholder", "get_attr", "call_function", "output"}, kinds
    bad = [f"{n.name}: {n.target}" for n in graph.nodes if n.op == "call_function" and n.target not in allowed]
    assert not bad, f"graph {name!r} calls ops outside the lingc allowlist: {bad}"
    assert any(n.target is OPS.linear for n in graph.nodes)


def test_weights_are_get_attr_nodes_named_like_parameters(tiny_model_fp32, tiny_program):
    params = dict(tiny_model_fp32.named_parameters())
    used = set()
    for name, graph in tiny_program.graphs.items():
        for node in graph.nodes:
            if node.op != "get_attr":
                continue
            assert node.target in params, f"{name}:{node.name} reads {node.target!r}, not a model parameter"
            assert node.name == "w_" + node.target.replace(".", "_").replace("model_layers_", "L")
            assert node.meta["lingc.tensor"] == TensorMeta(tuple(params[node.target].shape), params[node.target].dtype)
            used.add(node.target)
    assert tiny_program.weights.keys() == used                                 # the program keeps only weights it reads
    assert all(tiny_program.weights[k] is params[k] for k in used)             # shared with the model, not copied
    assert "model.layers.3.mlp.experts.w13" in used and "lm_head.weight" in used


def test_placeholders_carry_input_roles(tiny_program, tiny_model_fp32):
    L = tiny_model_fp32.config.num_hidden_layers
    roles = {name: [n.meta["lingc.input"] for n in tiny_program.inputs(name)] for name in PROGRAMS}
    target_state_roles = [f"state:{k}" for k in target_state(tiny_model_fp32, TraceOptions()).tensors]
    for name in ("prefill", "decode", "verify"):
        assert roles[name] == ["input_ids", "positions", *target_state_roles]
    for name in ("extend", "draft"):
        assert roles[name] == ["next_ids", "hidden", "positions", f"state:layers.{L}.kv_cache"]
    for node in tiny_program.inputs("decode"):                                 # names follow the roles
        role = node.meta["lingc.input"]
        assert node.name == (state_input_name(role.removeprefix("state:")) if role.startswith("state:") else role)


def test_example_inputs_fit_the_placeholders(tiny_model_fp32, tiny_program, tiny_options):
    for name in PROGRAMS:
        inputs = example_inputs(tiny_model_fp32, name, tiny_options)
        placeholders = tiny_program.inputs(name)
        assert list(inputs) == [n.name for n in placeholders]
        for node in placeholders:
            meta, value = node.meta["lingc.tensor"], inputs[node.name]
            assert (tuple(value.shape), value.dtype) == (meta.shape, meta.dtype), node.name


def test_state_input_name():
    assert state_input_name("layers.3.kv_cache") == "state_layers_3_kv_cache"
    assert state_input_name("layers.12.conv_q") == "state_layers_12_conv_q"


def test_node_names_derive_from_module_scope(tiny_program):
    names = {n.name for n in tiny_program.graphs["decode"].nodes}
    for expected in ("L1_mlp_moe_up", "L1_mlp_router_topk", "L0_attention_kda_recurrent", "L3_attention_mla_attention",
                     "L1_mlp_shared_experts_silu_and_mul", "lm_head_linear", "norm_rmsnorm", "model_embedding"):
        assert expected in names, f"no node named {expected!r} in decode"
    assert "L0_attention_kda_chunk" in {n.name for n in tiny_program.graphs["prefill"].nodes}   # T > 16
    for node in tiny_program.graphs["decode"].nodes:
        scope = node.meta.get("lingc.scope", "")
        if node.op == "call_function" and scope.startswith("model.layers."):
            layer, rest = scope.removeprefix("model.layers.").partition(".")[::2]
            prefix = f"L{layer}_" + rest.replace(".", "_")
            assert node.name.startswith(prefix), f"{node.name} (scope {scope}) should start with {prefix}"


def test_program_options_record_the_trace(tiny_program, tiny_program_bf16, tiny_options):
    assert tiny_program.options == {"batch": 1, "prefill_tokens": tiny_options.prefill_tokens,
                                    "max_len": tiny_options.max_len, "draft_tokens": tiny_options.draft_tokens,
                                    "extend_tokens": tiny_options.extend_tokens, "dtype": "float32"}
    assert tiny_program_bf16.options["dtype"] == "bfloat16"
    assert set(tiny_program.graphs) == set(PROGRAMS)


# ---- errors ----------------------------------------------------------------------------------------------

def test_unknown_program_names_the_known_ones(tiny_model_fp32):
    with pytest.raises(ValueError, match=r"unknown program\(s\) \['decoder'\]; known: \['prefill', 'decode', "
                                         r"'verify', 'extend', 'draft'\]"):
        trace(tiny_model_fp32, ["prefill", "decoder"])


def test_mtp_program_without_mtp_layer_is_an_error():
    c = preset("test-tiny")
    L = c.num_hidden_layers
    config = preset("test-tiny", num_nextn_predict_layers=0,
                    expert_swiglu_limit_list=c.expert_swiglu_limit_list[:L],
                    share_expert_swiglu_limit_list=c.share_expert_swiglu_limit_list[:L])
    model = LingForCausalLM(config, torch.float32)                             # uninitialised: tracing reads no weight
    for name in ("extend", "draft"):
        with pytest.raises(ValueError, match="need an MTP layer.*num_nextn_predict_layers = 0"):
            trace(model, ["decode", name])
    program = lingc.trace(model, ["decode"], TraceOptions(max_len=8))           # the target programs still trace
    assert set(program.graphs) == {"decode"}
