"""Gate 8: `lingc generate` on a compiled fp32 artifact, through typer's CliRunner.

Two artifacts from one compile (partition, fuse_swiglu, pdl; max_len 64): one from a checkpoint that got a
tokenizer.json (a WordLevel model over the 512 ids, "w0" .. "w509", "<pad>", "<eos>", whitespace
pre-tokenizer), which `compile_checkpoint` copies and hashes into the artifact, and one written without it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lingc.artifact import read_manifest, write_artifact
from lingc.cli import app
from lingc.compile import compile_checkpoint
from lingc.trace import TraceOptions

N = 24
PROMPT_IDS = "11,22,33"
PROMPT_TEXT = "w11 w22 w33"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def word_level_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(510)} | {"<pad>": 510, "<eos>": 511}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture(scope="module")
def artifacts(rt_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli_generate")
    ck = shutil.copytree(rt_ckpt, root / "ck")
    word_level_tokenizer().save(str(ck / "tokenizer.json"))
    result = compile_checkpoint(ck, root / "art_tok", ["partition", "fuse_swiglu", "pdl"], dtype="fp32",
                                options=TraceOptions(max_len=64, prefill_tokens=16))
    write_artifact(result, root / "art_plain", source=str(ck))         # the same program, no tokenizer
    return {"ck": ck, "tok": root / "art_tok", "plain": root / "art_plain"}


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def generate(runner, artifacts):
    """generate(artifact_key, *args) -> the --json summary (cached: each invocation loads the artifact)."""
    cache: dict[tuple, dict] = {}

    def run(which: str, *args: str) -> dict:
        key = (which, *args)
        if key not in cache:
            r = runner.invoke(app, ["generate", str(artifacts[which]), "--max-new-tokens", str(N), "--ignore-eos",
                                    "--json", *args])
            assert r.exit_code == 0, r.output + repr(r.exception)
            cache[key] = json.loads(r.stdout)
        return cache[key]

    return run


def test_the_artifacts(artifacts):
    files = read_manifest(artifacts["tok"]).manifest["files"]
    assert "tokenizer.json" in files
    assert "tokenizer.json" not in read_manifest(artifacts["plain"]).manifest["files"]


def test_json_summary(generate, rt_model):
    out = generate("plain", "--prompt-ids", PROMPT_IDS)
    for key in ("prompt_tokens", "tokens", "text", "finish_reason", "spec", "steps", "accept_lens",
                "mean_accept_len", "simulated_accept_len", "ttft_ms", "tpot_ms", "tok_per_s", "step_ms"):
        assert key in out, key
    want = rt_model.generate(torch.tensor([[11, 22, 33]]), N)[0].tolist()
    assert out["tokens"] == want                      # greedy NEXTN by default = the reference model
    assert out["spec"] == "nextn" and out["simulated_accept_len"] is None and out["text"] is None
    assert out["prompt_tokens"] == 3 and out["finish_reason"] == "length"
    assert out["steps"] == len(out["accept_lens"]) >= 1 and all(1 <= a <= 6 for a in out["accept_lens"])
    assert sum(out["accept_lens"]) - out["accept_lens"][-1] < N - 1 <= sum(out["accept_lens"])   # first token: prefill
    assert out["mean_accept_len"] == pytest.approx(sum(out["accept_lens"]) / out["steps"])
    assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0 and out["tok_per_s"] > 0 and out["step_ms"] > 0


def test_spec_none_equals_default(generate):
    default, plain = generate("plain", "--prompt-ids", PROMPT_IDS), generate("plain", "--prompt-ids", PROMPT_IDS,
                                                                               "--spec", "none")
    assert plain["tokens"] == default["tokens"]
    assert plain["spec"] == "none" and plain["accept_lens"] == [1] * (N - 1) and plain["steps"] == N - 1


def test_sampled_and_simulated_json(generate):
    sampled = generate("plain", "--prompt-ids", PROMPT_IDS, "--temperature", "0.8", "--seed", "5")
    assert len(sampled["tokens"]) == N and sampled["simulated_accept_len"] is None
    assert sampled["mean_accept_len"] == pytest.approx(sum(sampled["accept_lens"]) / sampled["steps"])
    sim = generate("plain", "--prompt-ids", PROMPT_IDS, "--simulate-accept-len", "3.2")
    assert sim["simulated_accept_len"] == 3.2 and sim["spec"] == "nextn"
    assert set(sim["accept_lens"]) <= {3, 4}


def test_prompt_text_with_tokenizer(generate, artifacts):
    from tokenizers import Tokenizer
    by_text = generate("tok", "--prompt", PROMPT_TEXT)
    by_ids = generate("plain", "--prompt-ids", PROMPT_IDS)
    assert by_text["prompt_tokens"] == 3 and by_text["tokens"] == by_ids["tokens"]
    tok = Tokenizer.from_file(str(artifacts["tok"] / "tokenizer.json"))
    assert isinstance(by_text["text"], str) and by_text["text"] == tok.decode(by_text["tokens"])
    assert by_text["text"].split()[0] == f"w{by_text['tokens'][0]}"
    assert generate("tok", "--prompt-ids", PROMPT_IDS)["text"] == by_text["text"]   # text whenever it can decode


def test_prompt_text_without_tokenizer_is_a_clean_error(runner, artifacts):
    r = runner.invoke(app, ["generate", str(artifacts["plain"]), "--prompt", PROMPT_TEXT, "--json"])
    text = " ".join(ANSI.sub("", r.output).split())
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output
    assert "error:" in text and "has no tokenizer.json" in text and "use --prompt-ids" in text
    assert r.stdout.strip() == "", "no JSON on stdout when the command fails"


def test_text_output(runner, artifacts):
    r = runner.invoke(app, ["generate", str(artifacts["tok"]), "--prompt", PROMPT_TEXT, "--max-new-tokens", "5",
                            "--simulate-accept-len", "2"])
    text = " ".join(ANSI.sub("", r.output).split())
    assert r.exit_code == 0, text
    assert "prompt (3 tokens): [11, 22, 33]" in text and "text: w" in text
    assert "(simulated accept length 2.0)" in text


@pytest.mark.parametrize("args, message", [
    (["--backend", "cuda"], "unknown backend 'cuda'; known: reference, triton"),
    (["--device", "cpu", "--cuda-graphs"], None),       # --cuda-graphs is ignored off CUDA, not an error
])
def test_backend_options(runner, artifacts, args, message):
    r = runner.invoke(app, ["generate", str(artifacts["plain"]), "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "2",
                            "--json", *args])
    text = " ".join(ANSI.sub("", r.output).split())
    if message is None:
        assert r.exit_code == 0, text
    else:
        assert r.exit_code == 2 and "Traceback" not in r.output and message in text, text
