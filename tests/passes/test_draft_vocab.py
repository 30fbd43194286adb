"""draft_vocab (opt-in): the MTP draft over a hot token subset.

On test-tiny (V = 512) with every other id as the map: which lm_head GEMVs read the hot rows (the 4 draft forwards
and extend's, in the general graphs and the greedy copies), the new weights (lm_head's rows of the sorted map, the
map, its inverse), the map back from index to token (greedy) and the widened distribution (sampled), losslessness
(a greedy request's tokens equal plain decoding's and the run without the pass, extend's proposal d1 is a hot
token; a sampled request whose filter keeps one token gets greedy decoding's tokens through the general graphs; and,
against the target distribution itself, chain_accept with a draft distribution that is zero off the map emits
tokens distributed as the target's), a second run, and the errors: no map, a bad map, --tp, a bad file.
"""

from __future__ import annotations

import json

import pytest
import torch

from lingc.ops import OPS
from lingc.passes.draft_vocab import (HOT_WEIGHT, INVERSE_MAP, OPTION, TOKEN_MAP, DraftVocab, DraftVocabError,
                                      check_token_map)
from lingc.passes.manager import PassManager
from lingc.program import Program
from lingc.runtime.engine import Engine, Request, SamplingParams

HOT = list(range(510, -1, -2))                  # every even id, given out of order (the pass sorts it)


def _with_map(program: Program, ids) -> Program:
    p = program.copy()
    p.options[OPTION] = ids
    return p


@pytest.fixture(scope="module")
def compiled(tiny_program: Program) -> tuple[Program, Program]:
    """(all passes, all passes + draft_vocab) of the fp32 test-tiny program."""
    base = PassManager(["all"]).run(tiny_program).program
    hot = PassManager(["all", "draft_vocab"]).run(_with_map(tiny_program, HOT))
    return base, hot.program


def _lm_head_readers(program: Program, graph: str) -> dict[str, int]:
    out = {"lm_head.weight": 0, HOT_WEIGHT: 0}
    for node in program.graphs[graph].nodes:
        for a in node.args:
            if getattr(a, "op", None) == "get_attr" and a.target in out:
                out[a.target] += 1
    return out


def test_only_the_mtp_stages_read_the_hot_rows(compiled):
    _, program = compiled
    for graph, forwards in (("draft", 4), ("draft_greedy", 4), ("extend", 1), ("extend_greedy", 1)):
        assert _lm_head_readers(program, graph) == {"lm_head.weight": 0, HOT_WEIGHT: forwards}, graph
    for graph in ("verify", "verify_greedy", "step", "step_greedy", "mtp_decode", "decode"):
        assert _lm_head_readers(program, graph)[HOT_WEIGHT] == 0, graph
        assert _lm_head_readers(program, graph)["lm_head.weight"] >= 1, graph


def test_weights_and_the_map_back(compiled):
    base, program = compiled
    index = torch.tensor(sorted(HOT))
    assert torch.equal(program.weights[HOT_WEIGHT], base.weights["lm_head.weight"][index])
    assert torch.equal(program.weights[TOKEN_MAP], index.view(-1, 1))
    assert program.options[OPTION]["size"] == len(HOT)                 # the list itself is not kept in options
    inverse = program.weights[INVERSE_MAP]
    assert inverse.dtype == torch.int32 and inverse.shape == (512,)
    assert torch.equal(inverse[index], torch.arange(len(HOT), dtype=torch.int32))
    assert int((inverse >= 0).sum()) == len(HOT)                       # -1 everywhere else
    for graph, draws in (("draft_greedy", 4), ("extend_greedy", 1)):
        samples = [n for n in program.graphs[graph].nodes if n.target is OPS.greedy_sample]
        assert len(samples) == draws
        for s in samples:
            (token,) = s.users                                           # embedding(index, map) -> the token
            assert token.target is OPS.embedding and token.args[1].target == TOKEN_MAP
    for graph, draws in (("draft", 4), ("extend", 1)):                  # sampled: q over the map, widened to V
        dists = [n for n in program.graphs[graph].nodes if n.target is OPS.filtered_probs]
        assert len(dists) == draws
        for d in dists:
            (full,) = d.users
            assert full.target is OPS.vocab_expand and full.args[1].target == INVERSE_MAP
            assert d.meta["lingc.tensor"].shape[-1] == len(HOT) and full.meta["lingc.tensor"].shape[-1] == 512
            assert any(u.target is OPS.sample_tokens for u in full.users)


def test_greedy_tokens_are_lossless_and_proposals_are_hot(compiled):
    base, program = compiled
    prompt = [11, 22, 33, 44, 55, 66, 77]
    runs = {}
    for name, prog, spec in (("hot", program, "nextn"), ("base", base, "nextn"), ("plain", base, "none")):
        engine = Engine(prog, spec=spec)
        runs[name] = engine.generate(Request(prompt, 24, ignore_eos=True))
        if name == "hot":
            d1 = int(engine.relay["draft_first"][0])
    assert runs["hot"].tokens == runs["base"].tokens == runs["plain"].tokens
    assert runs["hot"].graphs == ("draft_greedy", "verify_greedy", "extend_greedy")
    assert d1 in HOT                                                     # extend_greedy's proposal is a hot token


def test_the_kernels_run_the_new_launches(compiled):
    """On the Triton backend the widened distribution is the vocab_expand kernel (tests/kernels/test_sample.py checks
    its values) and the map back an embedding kernel: no reference op is left in the MTP stages."""
    from lingc.runtime.executor import Executor
    exe = Executor(compiled[1], "cpu", backend="triton")
    for graph, draws in (("draft", 4), ("extend", 1), ("draft_greedy", 4), ("extend_greedy", 1)):
        counts = exe.kernel_counts(graph)
        if graph.endswith("_greedy"):
            assert counts.get("triton:embedding", 0) >= draws, counts
        else:
            assert counts.get("triton:vocab_expand") == draws, counts
        assert not [k for k in counts if k.startswith("lingc.")], counts


def test_sampled_request_whose_filter_keeps_one_token_gets_greedy_tokens(compiled):
    """top_k = 1 at temperature 0.9: the general graphs run (q over the map is one-hot on the best hot token, the
    target's p one-hot on its argmax), and chain_accept's accept / residual rule must then emit greedy decoding's
    tokens whether or not the draft's token was hot."""
    base, program = compiled
    prompt = [11, 22, 33, 44, 55, 66, 77]
    want = Engine(base, spec="none").generate(Request(prompt, 24, ignore_eos=True)).tokens
    got = Engine(program, spec="nextn").generate(Request(prompt, 24, SamplingParams(0.9, top_k=1, seed=5),
                                                         ignore_eos=True))
    assert got.graphs == ("draft", "verify", "extend")
    assert got.tokens == want


def test_chain_accept_with_a_draft_zero_off_the_map_emits_the_target_distribution():
    """The sampled rule with q = vocab_expand(q_hot): 200000 one-draft chains, the first emitted token's frequencies
    against the target's p (4 sigma of the binomial error); the draft alone would give q, far from p."""
    g = torch.Generator().manual_seed(0)
    B, V = 200_000, 8
    hot = torch.tensor([1, 2, 5, 6])
    inverse = torch.full((V,), -1, dtype=torch.int32)
    inverse[hot] = torch.arange(4, dtype=torch.int32)
    p = torch.tensor([0.05, 0.10, 0.30, 0.05, 0.20, 0.10, 0.15, 0.05])
    q = torch.ops.lingc.vocab_expand(torch.tensor([0.4, 0.1, 0.2, 0.3]), inverse)
    assert torch.equal(q[hot], torch.tensor([0.4, 0.1, 0.2, 0.3])) and float(q.sum()) == pytest.approx(1.0)
    draft = torch.multinomial(q, B, replacement=True, generator=g).view(B, 1)
    u = torch.rand(B, 2, generator=g)
    target = p.expand(B, 2, V)
    accept_len, tokens = torch.ops.lingc.chain_accept(draft, q.expand(B, 1, V), target, target.log(),
                                                      torch.ones(B), u)
    freq = torch.bincount(tokens[:, 0], minlength=V).double() / B
    assert (freq - p.double()).abs().max() < 4 * (0.25 / B) ** 0.5
    assert float((accept_len == 2).double().mean()) == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.01)


def test_without_specialize_greedy_only_the_general_stages_change(tiny_program):
    result = PassManager(["partition", "draft_vocab"]).run(_with_map(tiny_program, HOT))
    record = result.records[-1]
    assert record.matches == 5 and {"draft_greedy", "extend_greedy"} <= set(record.details["skipped"])
    assert _lm_head_readers(result.program, "draft") == {"lm_head.weight": 0, HOT_WEIGHT: 4}
    assert TOKEN_MAP not in result.program.weights and INVERSE_MAP in result.program.weights


def test_generate_reports_the_map_size(compiled, tmp_path):
    """`lingc generate --json` (Session.summary) says how many hot ids the draft proposes from; None without the pass
    or without speculation."""
    from types import SimpleNamespace

    from lingc.runtime.session import Session, draft_vocab_size
    base, program = compiled
    assert draft_vocab_size(SimpleNamespace(program=program)) == len(HOT)        # also /get_server_info's
    assert draft_vocab_size(SimpleNamespace(program=base)) is None and draft_vocab_size(SimpleNamespace()) is None
    for prog, spec, want in ((program, "nextn", len(HOT)), (program, "none", None), (base, "nextn", None)):
        engine = Engine(prog, spec=spec)
        result = engine.generate(Request([11, 22], 3, ignore_eos=True))
        assert Session(tmp_path, engine, None).summary([11, 22], result)["draft_vocab"] == want, (spec, want)


def test_second_run_adds_nothing(compiled):
    _, program = compiled
    again, record = DraftVocab().run(program)
    assert record.matches == 0 and set(again.weights) == set(program.weights)


def test_errors(tiny_program, tmp_path):
    with pytest.raises(DraftVocabError, match="needs a token map"):
        PassManager(["all", "draft_vocab"]).run(tiny_program)
    for ids, message in (([], "non-empty"), ([1, 2, 2, 3, 3], r"repeat, e.g. \[2, 3\]"),
                         ([0, 512], r"\[512\] are outside the vocabulary \[0, 512\)"), ([1, 2.0], "integers")):
        with pytest.raises(DraftVocabError, match=message):
            check_token_map(ids, 512)
    from lingc.compile import compile_checkpoint
    with pytest.raises(ValueError, match="does not combine with --tp"):
        compile_checkpoint("unused", tmp_path / "art", ["all"], tp=2, draft_vocab=[1, 2])
    with pytest.raises(ValueError, match="needs a token map"):
        compile_checkpoint("unused", tmp_path / "art", ["all", "draft_vocab"])


def test_cli_reads_the_map_file(tmp_path):
    from typer.testing import CliRunner

    from lingc.cli import app
    bad = tmp_path / "map.json"
    bad.write_text(json.dumps({"ids": [1, 2]}))
    result = CliRunner().invoke(app, ["compile", str(tmp_path), "-o", str(tmp_path / "art"), "--passes", "all",
                                      "--draft-vocab", str(bad)])
    assert result.exit_code != 0 and "want a JSON list of token ids, got a dict" in " ".join(result.output.split())
