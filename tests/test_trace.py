"""lingc.trace: every step program equals the eager reference model bit for bit on CPU, and its graph is clean IR.

Host-fed programs (prefill, decode, mtp_prefill, mtp_decode): the eager side calls `model.step` /
`model.mtp_step` on a ModelState laid out like the traced pools (request slot 1 of 2, its pages in
shuffled order); the traced side runs the Program's graph on copies of the same inputs and pools.
Engine steps read everything from relay buffers indexed by slot: `step` is checked against a hand-run of
model.step + sampling, `nextn` against `lingc.steps.nextn_step` and, greedy, against plain decoding
written out by hand (draft chain, one decode step per chain token, acceptance, KDA commit, extend).
Outputs, relays and every pool must be torch.equal, in fp32 and in bf16 (the graph runs the same op
references in the same order, and decode-sized ops compute row by row, so a chain gives decode's bits).
Letters: T tokens of the step, K draft tokens, h hidden, V vocabulary.
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
from lingc.state import ModelState, pools, staging_buffers
from lingc.steps import nextn_step, relay_specs
from lingc.trace import PROGRAMS, TraceOptions, example_inputs, state_input_name, state_key, trace

SEED = 0
SLOT = 1                      # the request's slot; slot 0 holds another request that no step may touch
HOST_FED = ("prefill", "decode", "mtp_prefill", "mtp_decode")


@pytest.fixture(params=["fp32", "bf16"])
def traced(request: pytest.FixtureRequest) -> tuple[LingForCausalLM, Program]:
    """(reference model, its traced Program) in the parametrized dtype."""
    if request.param == "fp32":
        return request.getfixturevalue("tiny_model_fp32"), request.getfixturevalue("tiny_program")
    return request.getfixturevalue("tiny_model_bf16"), request.getfixturevalue("tiny_program_bf16")


# ---- helpers ---------------------------------------------------------------------------------------------

def target_layers(model: LingForCausalLM) -> range:
    return range(model.config.num_hidden_layers)


def mtp_layers(model: LingForCausalLM) -> range:
    L = model.config.num_hidden_layers
    return range(L, L + 1)


def paged_state(model: LingForCausalLM, options: TraceOptions, layers: range | None = None) -> ModelState:
    """Zero pools shaped like the traced inputs (options.request_slots slots, options.pages pages), the request
    in slot SLOT and the page table in a shuffled order (the last page is the harmless one)."""
    g = torch.Generator().manual_seed(SEED)
    table = torch.randperm(options.pages - 1, generator=g).view(options.request_slots, options.pages_per_request)
    tensors = pools(model.config, options.request_slots, options.pages, options.page_size, model.dtype, "cpu", layers)
    return ModelState(tensors, torch.tensor([SLOT], dtype=torch.int32), table.to(torch.int32), options.page_size)


def state_inputs(state: ModelState) -> dict[str, torch.Tensor]:
    """Graph inputs for a state: slots, page table, pools and (nextn) staging buffers, by placeholder name."""
    out = {"slots": state.slots, "page_table": state.page_table}
    out.update({state_input_name(k): v for k, v in state.tensors.items()})
    out.update({"staging_" + k.replace(".", "_"): v for k, v in state.staging.items()})
    return out


def positions(start: int, T: int) -> torch.Tensor:
    return torch.arange(start, start + T).view(1, T)                            # [1, T]


def prompt_ids(model: LingForCausalLM, T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, model.config.vocab_size, (1, T), generator=g)       # [1, T]


@torch.no_grad()
def prefilled(model: LingForCausalLM, options: TraceOptions, with_mtp: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, ModelState]:
    """(ids [1, T + 1], target hidden [1, T, h], state) after an eager prefill of the first T = prefill_tokens ids;
    the state has the target's pools (and with_mtp, the MTP layer's too)."""
    T = options.prefill_tokens
    ids = prompt_ids(model, T + 1)
    state = paged_state(model, options, None if with_mtp else target_layers(model))
    _, hidden = model.step(ids[:, :T], positions(0, T), state)
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


def assert_only_the_slot_written(state: ModelState, options: TraceOptions) -> None:
    """Every pool holds data for slot SLOT (its KDA rows, its pages) and nothing anywhere else."""
    mine = state.page_table[SLOT].long()
    others = torch.ones(options.pages, dtype=torch.bool)
    others[mine] = False
    for key, pool in state.tensors.items():
        if key.endswith("kv_pages"):
            assert pool[mine].any(), f"{key}: the request's pages were not written"
            assert not pool[others].any(), f"{key}: pages of another slot (or the harmless page) were written"
        else:
            assert pool[SLOT].any(), f"{key}: the request's slot was not written"
            assert not pool[1 - SLOT].any(), f"{key}: another slot was written"


def run_both(model: LingForCausalLM, program: Program, name: str, plain: dict[str, torch.Tensor],
             state: ModelState) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], ModelState, ModelState]:
    """(eager outputs, graph outputs, eager state after, graph state after) from the same inputs and state."""
    eager_state, graph_state = state.clone(), state.clone()
    with torch.no_grad():
        if name in ("prefill", "decode"):
            eager = model.step(plain["input_ids"], plain["positions"], eager_state)
        else:
            eager = model.mtp_step(plain["next_ids"], plain["hidden"], plain["positions"], eager_state)
    graph = program.run(name, {**plain, **state_inputs(graph_state)})
    return eager, graph, eager_state, graph_state


def relay_buffers(model: LingForCausalLM, options: TraceOptions, **values) -> dict[str, torch.Tensor]:
    """Relay buffers by short name (seq_len, root, ...): slot SLOT holds `values` (others zero, top_p 1),
    slot 0 holds arbitrary values of another request that must survive every step."""
    g = torch.Generator().manual_seed(SEED + 1)
    out = {}
    for r in relay_specs(model.config, options.draft_tokens, model.dtype):
        buf = torch.zeros(options.request_slots, *r.shape, dtype=r.dtype)
        buf[1 - SLOT] = (torch.rand(r.shape, generator=g) * 100).to(r.dtype)   # the other request
        buf[SLOT] = values.get(r.name, 1.0 if r.name == "top_p" else 0)
        out[r.name] = buf
    return out


def relay_inputs(relay: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"relay_" + k: v for k, v in relay.items()}


def assert_relays(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """got == want on slot SLOT (the keys of want) and got == before on every other slot and relay."""
    for name, buf in got.items():
        if name in want:
            assert_bits_equal(f"relay {name}[{SLOT}]", buf[SLOT], want[name].to(buf.dtype).view(buf[SLOT].shape))
        else:
            assert_bits_equal(f"relay {name}[{SLOT}] (unchanged)", buf[SLOT], before[name][SLOT])
        assert_bits_equal(f"relay {name}[other slot]", buf[1 - SLOT], before[name][1 - SLOT])


def sample(logits: torch.Tensor, relay: dict[str, torch.Tensor], counter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [1, 1], probs [1, 1, V]) from logits [1, 1, V] with slot SLOT's sampling parameters and uniform
    number `counter`: temperature 0 is the argmax."""
    s = torch.tensor([SLOT])
    temperature = relay["temperature"][s]
    probs = OPS.filtered_probs(logits, temperature, relay["top_k"][s], relay["top_p"][s])
    if temperature.item() == 0:
        return logits.argmax(-1), probs
    return OPS.sample_tokens(probs, OPS.uniform(relay["seed"][s], torch.tensor([counter]), 1)), probs


# ---- numerics: the host-fed programs vs the eager model ----------------------------------------------------

def test_prefill_matches_eager(traced, tiny_options):
    model, program = traced
    T = tiny_options.prefill_tokens
    plain = {"input_ids": prompt_ids(model, T), "positions": positions(0, T)}
    state = paged_state(model, tiny_options, target_layers(model))
    eager, graph, eager_state, graph_state = run_both(model, program, "prefill", plain, state)
    assert_bits_equal("logits", graph[0], eager[0])
    assert_bits_equal("hidden", graph[1], eager[1])
    assert_only_the_slot_written(eager_state, tiny_options)       # prefill writes every state tensor, of its slot
    assert_states_equal(graph_state, eager_state)
    with torch.no_grad():                                          # the paged layout is invisible in the numbers
        simple = model.step(plain["input_ids"], plain["positions"],
                            ModelState.new(model.config, 1, tiny_options.max_len, model.dtype, "cpu",
                                           target_layers(model)))
    assert_bits_equal("logits (one page per request)", simple[0], eager[0])


def test_decode_matches_eager(traced, tiny_options):
    model, program = traced
    ids, _, state = prefilled(model, tiny_options)
    pos = tiny_options.prefill_tokens                                          # the next position after the prompt
    plain = {"input_ids": ids[:, pos:pos + 1], "positions": positions(pos, 1)}
    eager, graph, eager_state, graph_state = run_both(model, program, "decode", plain, state)
    assert graph[0].shape == (1, 1, model.config.vocab_size)
    assert_bits_equal("logits", graph[0], eager[0])
    assert_bits_equal("hidden", graph[1], eager[1])
    assert_states_equal(graph_state, eager_state)


def test_mtp_prefill_matches_eager(traced, tiny_options):
    model, program = traced
    ids, hidden, _ = prefilled(model, tiny_options)
    T = tiny_options.prefill_tokens
    # MTP at position t reads the target's hidden at t and the token at t + 1
    plain = {"next_ids": ids[:, 1:T + 1], "hidden": hidden, "positions": positions(0, T)}
    state = paged_state(model, tiny_options, mtp_layers(model))
    eager, graph, eager_state, graph_state = run_both(model, program, "mtp_prefill", plain, state)
    assert graph[0].shape == (1, T, model.config.vocab_size)
    assert_bits_equal("logits", graph[0], eager[0])
    assert_bits_equal("mtp_hidden", graph[1], eager[1])
    assert_only_the_slot_written(eager_state, tiny_options)       # the MTP layer's latent cache
    assert_states_equal(graph_state, eager_state)


@torch.no_grad()
def test_mtp_decode_matches_eager(traced, tiny_options):
    model, program = traced
    ids, hidden, _ = prefilled(model, tiny_options)
    T = tiny_options.prefill_tokens
    state = paged_state(model, tiny_options, mtp_layers(model))
    model.mtp_step(ids[:, 1:T], hidden[:, :T - 1], positions(0, T - 1), state)       # the cache up to T - 2
    plain = {"next_ids": ids[:, T:T + 1], "hidden": hidden[:, T - 1:], "positions": positions(T - 1, 1)}
    eager, graph, eager_state, graph_state = run_both(model, program, "mtp_decode", plain, state)
    assert graph[0].shape == (1, 1, model.config.vocab_size)
    assert_bits_equal("logits", graph[0], eager[0])
    assert_bits_equal("mtp_hidden", graph[1], eager[1])
    assert_states_equal(graph_state, eager_state)


# ---- numerics: the engine steps ----------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@torch.no_grad()
def test_step_matches_hand_run(traced, tiny_options, temperature):
    """Three `step` graphs in a row (each reads the root and seq_len the last one wrote) vs model.step on the
    root at position seq_len, then the sampled token published in out_tokens / out_len, root, seq_len + 1 and
    rng_counter + 1."""
    model, program = traced
    ids, _, state = prefilled(model, tiny_options)
    seq, root, counter = tiny_options.prefill_tokens, int(ids[0, -1]), 5
    relay = relay_buffers(model, tiny_options, seq_len=seq, root=root, temperature=temperature, top_k=50,
                          top_p=0.9, seed=17, rng_counter=counter)
    graph_state, eager_state = state.clone(), state.clone()
    for _ in range(3):
        before = {k: v.clone() for k, v in relay.items()}
        assert program.run("step", {**relay_inputs(relay), **state_inputs(graph_state)}) == [None]
        logits, _ = model.step(torch.tensor([[root]]), positions(seq, 1), eager_state)
        token, _ = sample(logits, before, counter)
        root, seq, counter = int(token), seq + 1, counter + 1
        out = before["out_tokens"][SLOT].clone()
        out[0] = root
        assert_relays(relay, {"out_tokens": out, "out_len": torch.tensor(1), "root": torch.tensor(root),
                              "seq_len": torch.tensor(seq), "rng_counter": torch.tensor(counter)}, before)
        assert_states_equal(graph_state, eager_state)


@torch.no_grad()
def nextn_ready(model: LingForCausalLM, options: TraceOptions, temperature: float, simulate: float = 0.0
                ) -> tuple[ModelState, dict[str, torch.Tensor]]:
    """(state, relays) of a request ready for its first NEXTN round, as the engine leaves it: the prompt through
    the target and the MTP layer, the first token (root) sampled, d1 and its distribution from the MTP's last
    position, the MTP hidden there. The state has zeroed staging buffers."""
    ids, hidden, state = prefilled(model, options, with_mtp=True)
    T = options.prefill_tokens
    relay = relay_buffers(model, options, seq_len=T + 1, temperature=temperature, top_k=50, top_p=0.9, seed=17,
                          simulate_accept=simulate)
    logits, hidden_last = model.step(ids[:, T:T + 1], positions(T, 1), state)   # the prompt's last token
    root, _ = sample(logits, relay, 0)
    hidden = torch.cat([hidden, hidden_last], dim=1)                         # [1, T + 1, h]
    next_ids = torch.cat([ids[:, 1:T + 1], root], dim=1)
    mtp_logits, z = model.mtp_step(next_ids, hidden, positions(0, T + 1), state)
    d1, probs = sample(mtp_logits[:, -1:], relay, 1)
    relay["root"][SLOT] = int(root)
    relay["draft_first"][SLOT] = int(d1)
    relay["draft_first_probs"][SLOT] = probs.view(-1)
    relay["mtp_hidden"][SLOT] = z[0, -1]
    relay["rng_counter"][SLOT] = 2
    state.staging = staging_buffers(model.config, 1, options.draft_tokens, model.dtype)
    return state, relay


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@torch.no_grad()
def test_nextn_matches_nextn_step(traced, tiny_options, temperature):
    """Two NEXTN rounds: the traced `nextn` graph vs lingc.steps.nextn_step run eagerly, every relay, pool and
    staging buffer bit for bit."""
    model, program = traced
    state, relay = nextn_ready(model, tiny_options, temperature)
    graph_state, graph_relay = state.clone(), {k: v.clone() for k, v in relay.items()}
    for _ in range(2):
        assert program.run("nextn", {**relay_inputs(graph_relay), **state_inputs(graph_state)}) == [None]
        nextn_step(model, state.slots, relay, state, tiny_options.draft_tokens)
        for name in relay:
            assert_bits_equal(f"relay {name}", graph_relay[name], relay[name])
        assert_states_equal(graph_state, state)
        for key in state.staging:
            assert_bits_equal(f"staging {key}", graph_state.staging[key], state.staging[key])
    assert 2 <= int(relay["seq_len"][SLOT]) - tiny_options.prefill_tokens - 1 <= 2 * tiny_options.draft_tokens


@pytest.mark.parametrize("simulate", [0.0, 3.0], ids=["accepted", "simulated-3"])
@torch.no_grad()
def test_nextn_greedy_is_plain_decoding_by_hand(traced, tiny_options, simulate):
    """Two greedy rounds of the `nextn` graph vs plain decoding written out by hand:
      draft   K - 1 MTP decode steps from (d1, mtp_hidden) at seq_len, seq_len + 1, ...: d2..dK (argmax)
      verify  one target decode step per chain token [root, d1..dK]; drafts are accepted while each equals the
              argmax after the token before it; accept_len = accepted + 1 tokens are emitted (the last one
              the target's argmax); the KDA pools keep the state after the accept_len-th token
              (simulate: accept_len forced to 3, the benchmark knob)
      extend  MTP over the chain with the target's hidden states; its row accept_len - 1 gives the next d1
              (one-hot distribution) and mtp_hidden; rng_counter advances by 2K + 3.
    Every relay and pool bit for bit."""
    model, program = traced
    K, c = tiny_options.draft_steps, model.config
    state, relay = nextn_ready(model, tiny_options, 0.0, simulate)
    graph_state = state.clone()
    hand = ModelState(state.tensors, state.slots, state.page_table, state.page_size)   # no staging: plain decode
    kda_keys = [k for k in hand.tensors if not k.endswith("kv_pages")]
    for _ in range(2):
        before = {k: v.clone() for k, v in relay.items()}
        assert program.run("nextn", {**relay_inputs(relay), **state_inputs(graph_state)}) == [None]

        seq, root, counter = int(before["seq_len"][SLOT]), int(before["root"][SLOT]), int(before["rng_counter"][SLOT])
        token, h, drafts = torch.tensor([[int(before["draft_first"][SLOT])]]), before["mtp_hidden"][SLOT].view(1, 1, -1), []
        drafts.append(int(token))
        for i in range(K - 1):                                                   # draft
            logits, h = model.mtp_step(token, h, positions(seq + i, 1), hand)
            token = logits.argmax(-1)
            drafts.append(int(token))
        chain, argmax, hidden, after = [root] + drafts, [], [], []
        for i, t in enumerate(chain):                                            # verify, one decode step each
            logits, hs = model.step(torch.tensor([[t]]), positions(seq + i, 1), hand)
            argmax.append(int(logits.argmax(-1)))
            hidden.append(hs)
            after.append({k: hand.tensors[k].clone() for k in kda_keys})
        accepted = 0
        while accepted < K and drafts[accepted] == argmax[accepted]:
            accepted += 1
        tokens = drafts[:accepted] + [argmax[accepted]] + drafts[accepted + 1:] + [0] * (accepted < K)
        n = int(simulate) if simulate else accepted + 1
        for k in kda_keys:                                                       # the commit
            hand.tensors[k].copy_(after[n - 1][k])
        z = []
        for i in range(K + 1):                                                   # extend, one MTP step each
            logits_i, z_i = model.mtp_step(torch.tensor([[tokens[i]]]), hidden[i], positions(seq + i, 1), hand)
            if i == n - 1:
                first_logits = logits_i
            z.append(z_i)
        out = before["out_tokens"][SLOT].clone()
        out[:K + 1] = torch.tensor(tokens)                                       # published, n of them valid
        assert_relays(relay, {
            "out_tokens": out, "out_len": torch.tensor(n), "root": torch.tensor(tokens[n - 1]),
            "seq_len": torch.tensor(seq + n), "rng_counter": torch.tensor(counter + 2 * K + 3),
            "draft_first": first_logits.argmax(-1), "mtp_hidden": z[n - 1],
            "draft_first_probs": torch.nn.functional.one_hot(first_logits.argmax(-1), c.vocab_size).float()}, before)
        assert_states_equal(graph_state, hand)
    if simulate:
        assert int(relay["seq_len"][SLOT]) == tiny_options.prefill_tokens + 1 + 2 * int(simulate)


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


def test_engine_steps_return_nothing_and_write_relays(tiny_program):
    """step and nextn are device-fed: their results live in relay buffers and pools, the graph returns None."""
    for name in ("step", "nextn"):
        graph = tiny_program.graphs[name]
        output = next(n for n in graph.nodes if n.op == "output")
        assert output.args[0] == [None], name
        emits = [n for n in graph.nodes if n.target is OPS.emit_tokens]
        assert len(emits) == 1 and emits[0].args[0].name == "relay_out_tokens", name


def test_nextn_nodes_are_tagged_by_stage(tiny_program):
    """Every nextn kernel carries lingc.stage, in draft -> verify -> extend order; the KDA layers run staged
    in verify (state.staging), and their commit follows the acceptance."""
    graph = tiny_program.graphs["nextn"]
    calls = [n for n in graph.nodes if n.op == "call_function"]
    stages = [n.meta.get("lingc.stage") for n in calls]
    assert stages == sorted(stages, key=["draft", "verify", "extend"].index)      # raises on a missing tag
    assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == ["draft", "verify", "extend"]
    by_op = lambda op: [n for n in calls if n.target is op]  # noqa: E731
    assert not by_op(OPS.kda_conv) and not by_op(OPS.kda_recurrent) and not by_op(OPS.kda_chunk)
    assert len(by_op(OPS.kda_conv_staged)) == 9 and len(by_op(OPS.kda_recurrent_staged)) == 3
    assert {n.meta["lingc.stage"] for n in by_op(OPS.kda_conv_staged) + by_op(OPS.kda_commit)} == {"verify"}
    order = {n: i for i, n in enumerate(calls)}
    (accept,) = by_op(OPS.chain_accept)
    assert len(by_op(OPS.kda_commit)) == 12 and all(order[n] > order[accept] for n in by_op(OPS.kda_commit))
    assert not any("lingc.stage" in n.meta for n in tiny_program.graphs["step"].nodes)


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


def test_placeholders_carry_input_roles(tiny_program, tiny_model_fp32, tiny_options):
    c = tiny_model_fp32.config
    L = c.num_hidden_layers
    roles = {name: [n.meta["lingc.input"] for n in tiny_program.inputs(name)] for name in PROGRAMS}
    target_pools = [f"state:{k}" for k in pools(c, 1, 1, 1, torch.float32, layers=range(L))]
    index = ["slots", "page_table"]
    for name in ("prefill", "decode"):
        assert roles[name] == ["input_ids", "positions", *index, *target_pools]
    for name in ("mtp_prefill", "mtp_decode"):
        assert roles[name] == ["next_ids", "hidden", "positions", *index, f"state:layers.{L}.kv_pages"]
    relays = [f"relay:{r.name}" for r in relay_specs(c, tiny_options.draft_tokens, torch.float32)]
    step_relays = [r for r in relays if r.removeprefix("relay:") not in
                   ("simulate_accept", "draft_first", "draft_first_probs", "mtp_hidden")]   # NEXTN only
    assert roles["step"] == [*index, *step_relays, *target_pools]
    staging = [f"staging:{k}" for k in staging_buffers(c, 1, 1, torch.float32)]
    assert roles["nextn"] == [*index, *relays, *target_pools, f"state:layers.{L}.kv_pages", *staging]
    for name in ("decode", "nextn"):                                          # names follow the roles
        for node in tiny_program.inputs(name):
            kind, _, key = node.meta["lingc.input"].partition(":")
            want = {"state": lambda: state_input_name(key), "staging": lambda: "staging_" + key.replace(".", "_"),
                    "relay": lambda: "relay_" + key}.get(kind, lambda: kind)()
            assert node.name == want


def test_example_inputs_fit_the_placeholders(tiny_model_fp32, tiny_program, tiny_options):
    """example_inputs gives every pool and relay; the trace cuts the inputs a program never touches."""
    L = tiny_model_fp32.config.num_hidden_layers
    target = {state_input_name(k) for k in pools(tiny_model_fp32.config, 1, 1, 1, torch.float32, layers=range(L))}
    nextn_only = {"relay_simulate_accept", "relay_draft_first", "relay_draft_first_probs", "relay_mtp_hidden"}
    unused = {"prefill": {"state_layers_6_kv_pages"}, "decode": {"state_layers_6_kv_pages"},
              "mtp_prefill": target, "mtp_decode": target, "step": nextn_only | {"state_layers_6_kv_pages"},
              "nextn": set()}
    for name in PROGRAMS:
        inputs = example_inputs(tiny_model_fp32, name, tiny_options)
        placeholders = [n.name for n in tiny_program.inputs(name)]
        assert [k for k in inputs if k in placeholders] == placeholders
        assert set(inputs) - set(placeholders) == unused[name], name
    for node in tiny_program.inputs(name):
            meta, value = node.meta["lingc.tensor"], inputs[node.name]
            assert (tuple(value.shape), value.dtype) == (meta.shape, meta.dtype), node.name
    inputs = example_inputs(tiny_model_fp32, "decode", tiny_options)
    assert inputs["slots"].tolist() == [0] and inputs["page_table"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert inputs["state_layers_3_kv_pages"].shape == (tiny_options.pages, tiny_options.page_size, 80)


def test_state_input_name():
    assert state_input_name("layers.3.kv_pages") == "state_layers_3_kv_pages"
    assert state_input_name("layers.12.conv_q") == "state_layers_12_conv_q"
    assert state_key("state_layers_3_kv_pages") == "layers.3.kv_pages"
    assert state_key(state_input_name("layers.12.conv_q")) == "layers.12.conv_q"
    with pytest.raises(ValueError, match="'relay_root' is not a state input name"):
        state_key("relay_root")


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
    nextn = {n.name for n in tiny_program.graphs["nextn"].nodes}               # outside modules: named by stage
    for expected in ("draft_sample_tokens", "verify_chain_accept", "verify_kda_commit", "extend_filtered_probs",
                     "L0_attention_q_conv1d_kda_conv_staged", "L0_attention_kda_recurrent_staged"):
        assert expected in nextn, f"no node named {expected!r} in nextn"


def test_program_options_record_the_trace(tiny_program, tiny_program_bf16, tiny_options):
    assert tiny_program.options == {"batch": 1, "prefill_tokens": tiny_options.prefill_tokens,
                                    "max_len": tiny_options.max_len, "page_size": tiny_options.page_size,
                                    "request_slots": tiny_options.request_slots,
                                    "draft_tokens": tiny_options.draft_tokens, "dtype": "float32"}
    assert tiny_program_bf16.options["dtype"] == "bfloat16"
    assert set(tiny_program.graphs) == set(PROGRAMS)


# ---- errors ----------------------------------------------------------------------------------------------

def test_unknown_program_names_the_known_ones(tiny_model_fp32):
    with pytest.raises(ValueError, match=r"unknown program\(s\) \['decoder'\]; known: \['prefill', 'decode', "
                                         r"'mtp_prefill', 'mtp_decode', 'step', 'nextn'\]"):
        trace(tiny_model_fp32, ["prefill", "decoder"])


def test_trace_options_are_checked():
    with pytest.raises(ValueError, match="max_len 50 must be a multiple of page_size 16"):
        TraceOptions(max_len=50)
    with pytest.raises(ValueError, match=r"request_slots 1 < batch 2"):
        TraceOptions(batch=2, request_slots=1)
    o = TraceOptions(max_len=64, page_size=16, request_slots=3, draft_tokens=5)
    assert (o.draft_steps, o.pages_per_request, o.pages) == (4, 4, 3 * 4 + 1)


def test_mtp_program_without_mtp_layer_is_an_error():
    c = preset("test-tiny")
    L = c.num_hidden_layers
    config = preset("test-tiny", num_nextn_predict_layers=0,
                    expert_swiglu_limit_list=c.expert_swiglu_limit_list[:L],
                    share_expert_swiglu_limit_list=c.share_expert_swiglu_limit_list[:L])
    model = LingForCausalLM(config, torch.float32)                             # uninitialised: tracing reads no weight
    for name in ("mtp_prefill", "mtp_decode", "nextn"):
        with pytest.raises(ValueError, match="need an MTP layer.*num_nextn_predict_layers = 0"):
            trace(model, ["decode", name])
    program = lingc.trace(model, ["decode", "step"], TraceOptions(max_len=16))   # the target programs still trace
    assert set(program.graphs) == {"decode", "step"}


def test_nextn_uniform_indices(tiny_program, tiny_options):
    """The NEXTN round's random numbers, by counter offset from rng_counter: the draft's K - 1 samples take 0 .. K - 2
    (one uniform call), the acceptance K .. 2K and simulate_accept 2K + 2 (one call of K + 3), extend's d1 2K + 1;
    K - 1 is unused (the plan of the per-sample calls this replaced, so sampled runs keep their tokens); no index
    twice, each call reading the gathered rng_counter itself (offsets ride in the op, no add launch); the counter
    then advances by 2K + 3 (test_nextn_greedy_is_plain_decoding_by_hand)."""
    K = tiny_options.draft_steps
    graph = tiny_program.graphs["nextn"]
    calls = [n for n in graph.nodes if n.target is OPS.uniform]
    ranges = [(n.args[3] if len(n.args) > 3 else 0, n.args[2]) for n in calls]          # (offset, n)
    assert ranges == [(0, K - 1), (K, K + 3), (2 * K + 1, 1)]
    for n in calls:
        counter = n.args[1]
        assert counter.target is OPS.gather_rows and counter.args[0].name == "relay_rng_counter"
    used = [o + i for o, count in ranges for i in range(count) if (o, count) != (K, K + 3) or i != K + 1]
    assert sorted(used) == [i for i in range(2 * K + 3) if i != K - 1] and len(set(used)) == len(used)
