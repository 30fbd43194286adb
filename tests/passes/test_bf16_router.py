"""bf16_router: the MoE router gates and lm_head run in bf16. Numerics change, within the declared tolerance.

Matches are the router linears (a linear feeding router_topk) and the lm_head linears; only those weights
become bf16 and only those nodes get meta lingc.dtype = 'bf16'. --verify must pass with the pass's
tolerance and greedy tokens must not change on the fp32 test-tiny model, while the logits do change.
"""

from __future__ import annotations

import pytest
import torch

from lingc.ir.text import program_text
from lingc.ops import OPS
from lingc.passes.base import PassRecord
from lingc.passes.bf16_router import LM_HEAD, Bf16Router
from lingc.passes.matchers import consumers
from lingc.passes.verify import compare_stages, random_inputs
from lingc.program import Program
from lingc.runtime.engine import Engine, Request
from lingc.runtime.executor import Executor
from lingc.trace import PROGRAMS, TraceOptions, trace

ROUTER_WEIGHTS = [f"model.layers.{i}.mlp.gate.weight" for i in (1, 2, 3, 4, 5, 6)]   # layer 6: the MTP layer


def is_match(node) -> bool:
    """A router linear (feeds router_topk) or an lm_head linear."""
    return node.target is OPS.linear and (any(c.target is OPS.router_topk for c in consumers(node))
                                          or node.args[1].target == LM_HEAD)


@pytest.fixture(scope="module")
def lowered(tiny_program: Program) -> tuple[Program, PassRecord]:
    return Bf16Router().run(tiny_program)


# (routers, lm_heads) per graph: the target has 5 MoE layers, the MTP layer 1; nextn runs 4 draft MTP forwards,
# the target (verify) and the MTP again (extend)
MATCHES = {"prefill": (5, 1), "decode": (5, 1), "step": (5, 1), "mtp_prefill": (1, 1), "mtp_decode": (1, 1),
           "nextn": (4 + 5 + 1, 4 + 1 + 1)}


@pytest.mark.parametrize("graph", PROGRAMS)
def test_matches_router_and_lm_head_linears(tiny_program, lowered, graph):
    after, _ = lowered
    nodes = list(tiny_program.graphs[graph].nodes)
    routers = sum(1 for n in nodes if n.target is OPS.router_topk)
    heads = sum(1 for n in nodes if n.target is OPS.linear and n.args[1].target == LM_HEAD)
    assert (routers, heads) == MATCHES[graph]
    marked = [n.name for n in after.graphs[graph].nodes if n.meta.get("lingc.dtype") == "bf16"]
    assert marked == [n.name for n in nodes if is_match(n)] and len(marked) == routers + heads
    assert not any("lingc.dtype" in n.meta for n in after.graphs[graph].nodes if not is_match(n))


def test_record(lowered):
    after, record = lowered
    assert record.name == "bf16_router" and record.changes_numerics and record.tolerance == Bf16Router.tolerance
    assert record.matches == sum(r + h for r, h in MATCHES.values()) == 3 * (5 + 1) + 2 * (1 + 1) + (10 + 6) == 38
    assert record.details["weights_lowered"] == sorted(ROUTER_WEIGHTS + [LM_HEAD])
    assert record.weights_changed == sorted(ROUTER_WEIGHTS + [LM_HEAD])
    assert record.weights_added == record.weights_removed == [] and record.nodes_added == record.nodes_removed == []
    assert "decode:L1_mlp_gate_linear" in record.nodes_rewritten and "decode:lm_head_linear" in record.nodes_rewritten


def test_only_router_and_lm_head_weights_become_bf16(tiny_program, lowered):
    after, _ = lowered
    assert after.weights.keys() == tiny_program.weights.keys()
    for name, w in after.weights.items():
        old = tiny_program.weights[name]
        if name in ROUTER_WEIGHTS or name == LM_HEAD:
            assert old.dtype == torch.float32 and w.dtype == torch.bfloat16, name
            assert torch.equal(w, old.to(torch.bfloat16))
        else:
            assert w is old, f"{name} should be untouched (shared with the input program)"
    assert after.weights["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32   # the bias stays fp32


def test_logits_stay_fp32(lowered):
    after, _ = lowered
    head = next(n for n in after.graphs["decode"].nodes if n.name == "lm_head_linear")
    gate = next(n for n in after.graphs["decode"].nodes if n.name == "L1_mlp_gate_linear")
    assert head.meta["lingc.tensor"].dtype == torch.float32 and gate.meta["lingc.tensor"].dtype == torch.float32
    assert head.args[1].meta["lingc.tensor"].dtype == torch.bfloat16


def test_verify_passes_with_the_declared_tolerance(tiny_program, lowered):
    after, _ = lowered
    report = compare_stages(tiny_program, after, exact=False, tolerance=Bf16Router.tolerance)
    assert report["ok"], {g: r["problems"] for g, r in report["graphs"].items()}
    assert set(report["graphs"]) == set(PROGRAMS)
    deltas = {g: r["max_abs_delta"] for g, r in report["graphs"].items()}
    assert all(0 < d < Bf16Router.tolerance for d in deltas.values()), deltas


def test_numerics_do_change(tiny_program, lowered):
    """Not a no-op: the same inputs give different logits, so an exact check must fail."""
    after, _ = lowered
    inputs = random_inputs(tiny_program, "decode")
    before_logits = tiny_program.run("decode", {k: v.clone() for k, v in inputs.items()})[0]
    after_logits = after.run("decode", {k: v.clone() for k, v in inputs.items()})[0]
    assert not torch.equal(before_logits, after_logits)
    report = compare_stages(tiny_program, after, exact=True, tolerance=None)
    assert not report["ok"] and "output[0]: not bit-identical" in report["graphs"]["decode"]["problems"][0]


def teacher_forced_logits(program: Program, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [len - 1, V] at every position of `tokens`: one prefill chunk, then one decode step per token, run
    by the runtime's executor over its persistent buffers (request slot 0, pages in order)."""
    exe = Executor(program)
    table = exe.input("prefill", "page_table")
    table.copy_(torch.arange(table.numel()).view(table.shape))

    def run(graph: str, start: int, n: int) -> torch.Tensor:
        exe.input(graph, "input_ids").copy_(tokens[None, start:start + n])
        exe.input(graph, "positions").copy_(torch.arange(start, start + n)[None])
        return exe.run(graph)[0][0].clone()

    chunk = program.options["prefill_tokens"]
    return torch.cat([run("prefill", 0, chunk)] + [run("decode", t, 1) for t in range(chunk, len(tokens) - 1)])


@pytest.fixture(scope="module")
def long_programs(tiny_model_fp32) -> tuple[Program, Program]:
    """(fp32 program, after bf16_router) with room for a 35 + 13 token request in the engine (which keeps
    2 x draft_tokens of margin below max_len: 64 - 12 >= 48)."""
    before = trace(tiny_model_fp32, ["prefill", "decode", "step"], TraceOptions(max_len=64, prefill_tokens=32))
    return before, Bf16Router().run(before)[0]


def test_greedy_parity(tiny_model_fp32, long_programs):
    """Along the reference's greedy sequence (35-token prompt + 13 tokens), the lowered program picks the same
    token everywhere except at near-ties: where the reference's margin between its token and the new pick
    is within the declared tolerance (the --verify rule). Free-running generation (the engine's plain decode,
    sampling greedy in the `step` graph) agrees up to such a tie.

    The random test-tiny model's logits are flat (std ~0.2, median top-2 gap ~0.04), so near-ties do occur."""
    tiny_program, after = long_programs
    tol = Bf16Router.tolerance
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, tiny_program.config.vocab_size, (35,), generator=g)
    want = tiny_model_fp32.generate(prompt[None], 13, max_len=48)[0]
    tokens = torch.cat([prompt, want])                                          # [48] = max_len
    ref, new = teacher_forced_logits(tiny_program, tokens), teacher_forced_logits(after, tokens)   # [47, V]
    assert torch.equal(ref.argmax(-1)[34:], want)                               # the fp32 program is the reference
    assert ((new - ref).abs() <= tol * (1 + ref.abs())).all()
    old_pick, new_pick = ref.argmax(-1, keepdim=True), new.argmax(-1, keepdim=True)
    margins = (ref.gather(-1, old_pick) - ref.gather(-1, new_pick)).squeeze(-1)   # 0 where the picks agree
    flips = (margins > 0).nonzero().flatten().tolist()
    assert all(margins[p] <= tol for p in flips), {p: float(margins[p]) for p in flips}
    assert len(flips) <= 2, f"near-ties should be rare; picks changed at {len(flips)}/{len(margins)} positions: {flips}"

    first_flip = min([p - 34 for p in flips if p >= 34] + [len(want)])       # index into the generated tokens
    got = Engine(after, spec="none").generate(Request(prompt.tolist(), len(want), ignore_eos=True)).tokens
    assert len(got) == len(want) and got[:first_flip] == want[:first_flip].tolist()
    reference = Engine(tiny_program, spec="none").generate(Request(prompt.tolist(), len(want), ignore_eos=True))
    assert reference.tokens == want.tolist()                                  # the fp32 engine is the reference


def test_input_program_is_not_edited(tiny_program):
    text = program_text(tiny_program)
    Bf16Router().run(tiny_program)
    assert program_text(tiny_program) == text
    assert tiny_program.weights[LM_HEAD].dtype == torch.float32


def test_second_run_lowers_nothing(lowered):
    after, _ = lowered
    again, record = Bf16Router().run(after)
    assert record.details["weights_lowered"] == [] and record.weights_changed == []
    assert program_text(again) == program_text(after)
