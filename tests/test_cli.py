"""The lingc CLI: init -> compile -> passes / diff / report / generate, clean errors (no traceback), --help, the demo."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

import lingc
from lingc.artifact import load_artifact
from lingc.cli import app
from lingc.passes import PASSES
from lingc.presets import preset

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
SMALL = ["--dtype", "fp32", "--max-len", "48", "--prefill-tokens", "16"]     # keeps compile a few seconds


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})     # wide enough that rich does not wrap names


def _text(result: Result) -> str:
    """stdout + stderr without colour codes and with whitespace collapsed, so rich's wrapping cannot split words."""
    return " ".join(ANSI.sub("", result.output).split())


def _ok(result: Result) -> str:
    assert result.exit_code == 0, result.output + repr(result.exception)
    return _text(result)


def _fails(result: Result, *needles: str) -> str:
    """A clean user error: non-zero exit through typer.Exit, no traceback, the message names the problem."""
    text = _text(result)
    assert result.exit_code != 0, text
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert "error:" in text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


@pytest.fixture(scope="module")
def built(runner: CliRunner, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`lingc init --preset test-tiny` then `lingc compile --passes pdl,fuse_swiglu,bf16_router --verify`, once."""
    root = tmp_path_factory.mktemp("cli")
    ck, art = root / "ck", root / "art"
    init = runner.invoke(app, ["init", "--preset", "test-tiny", "--out", str(ck)])
    compile_ = runner.invoke(app, ["compile", str(ck), "--passes", "pdl,fuse_swiglu,bf16_router", "-o", str(art),
                                   "--verify", *SMALL])
    return {"root": root, "ck": ck, "art": art, "init": init, "compile": compile_}


@pytest.fixture(scope="module")
def exact(runner: CliRunner, built: dict) -> Path:
    """`lingc compile --passes partition,fuse_swiglu,pdl --dtype fp32 --max-len 64` of the same checkpoint: every
    program, split for NEXTN, numerics of the reference model (no bf16_router)."""
    out = built["root"] / "exact"
    _ok(runner.invoke(app, ["compile", str(built["ck"]), "--passes", "partition,fuse_swiglu,pdl", "-o", str(out),
                            "--dtype", "fp32", "--max-len", "64", "--prefill-tokens", "16"]))
    return out


def _generate(runner: CliRunner, art: Path, *args: str) -> dict:
    result = runner.invoke(app, ["generate", str(art), "--prompt-ids", "11,22,33", "--max-new-tokens", "10",
                                 "--ignore-eos", "--json", *args])
    _ok(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the happy path -------------------------------------------------------------------------------------------


def test_init_writes_a_checkpoint(built):
    text = _ok(built["init"])
    assert "wrote test-tiny (seed 0)" in text
    assert json.loads((built["ck"] / "config.json").read_text())["num_hidden_layers"] == 6
    assert (built["ck"] / "model.safetensors.index.json").exists()


def test_compile_prints_the_pass_table(built):
    text = _ok(built["compile"])
    assert "lingc compile ->" in text
    for col in ("pass", "numerics", "matches", "verify"):
        assert col in text
    # ordering constraints put pdl last; --verify is bit-exact for the numerics-preserving passes
    assert re.search(r"1 │ fuse_swiglu │ unchanged .* bit-exact", text)
    assert re.search(r"2 │ bf16_router │ changed .* ok \(tol 0\.05\)", text)
    assert re.search(r"3 │ pdl │ unchanged .* bit-exact", text)
    assert "programs: prefill, decode, step, mtp_prefill, mtp_decode, nextn" in text
    art = load_artifact(built["art"])
    assert [r["name"] for r in art.manifest["passes"]] == ["fuse_swiglu", "bf16_router", "pdl"]
    assert all(r["verify"]["ok"] for r in art.manifest["passes"])


def test_passes_lists_every_pass_with_its_numerics(runner):
    text = _ok(runner.invoke(app, ["passes"]))
    assert re.search(r"fuse_swiglu │ .* │ unchanged", text)
    assert re.search(r"bf16_router │ .* │ changed \(tol 0\.05\)", text)
    assert re.search(r"pdl │ .* │ unchanged │ fuse_swiglu, fuse_moe_align, fuse_projections, fuse_add_norm,", text)
    assert re.search(r"partition │ .*relay.* │ unchanged │ -", text)
    assert re.search(r"tp \(only via --tp N\) │", text)            # listed, with the flag that runs it
    assert re.search(r"fuse_all_reduce_norm │ .* │ unchanged │ tp \(runs with --tp N\)", text)


def test_console_script_entry_point():
    lingc = Path(sys.executable).with_name("lingc")
    assert lingc.exists(), f"{lingc}: console script not installed (pip install -e .)"
    proc = subprocess.run([str(lingc), "passes"], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "200", "PATH": str(lingc.parent)})
    assert proc.returncode == 0, proc.stderr
    for name in PASSES:
        assert name in proc.stdout


def test_diff_prints_the_unified_diff_and_op_counts(runner, built):
    result = runner.invoke(app, ["diff", str(built["art"]), "--pass", "fuse_swiglu"])
    _ok(result)
    assert "--- trace/00-traced.txt\n+++ trace/01-fuse_swiglu.txt\n" in result.output
    lines = result.output.splitlines()
    assert any(line.startswith("-") and "= lingc.moe_up(" in line for line in lines)
    assert any(line.startswith("+") and "= lingc.moe_up_act(" in line for line in lines)
    text = _text(result)
    assert "op counts around fuse_swiglu" in text
    assert re.search(r"decode │ lingc\.moe_up │ 5 │ 0", text)
    assert re.search(r"decode │ lingc\.moe_up_act │ 0 │ 5", text)
    assert "fuse_swiglu: 27 match(es); numerics unchanged" in text


def test_diff_program_option(runner, built):
    text = _ok(runner.invoke(app, ["diff", str(built["art"]), "--pass", "fuse_swiglu", "--program", "decode"]))
    assert "decode │ lingc.moe_up" in text and "prefill │" not in text


def test_report_writes_the_html(runner, built, tmp_path):
    out = tmp_path / "r.html"
    text = _ok(runner.invoke(app, ["report", str(built["art"]), "-o", str(out)]))
    assert "wrote" in text and "r.html" in text
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "fuse_swiglu" in page and "PDL chains" in page


def test_init_layer_overrides(runner, tmp_path):
    """Regression: --layers / --mtp-layers failed on test-tiny, whose clamp lists had one entry per original layer."""
    _ok(runner.invoke(app, ["init", "--preset", "test-tiny", "--out", str(tmp_path / "ck"),
                            "--layers", "4", "--mtp-layers", "0", "--shard-mb", "0"]))
    config = json.loads((tmp_path / "ck/config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["num_nextn_predict_layers"] == 0
    assert len(config["expert_swiglu_limit_list"]) <= 4
    assert (tmp_path / "ck/model.safetensors").exists()


def test_layer_overrides_resize_the_per_layer_clamp_lists():
    base = preset("test-tiny")                       # 6 layers + 1 MTP; the MTP entry is the last one
    c = preset("test-tiny", num_hidden_layers=4)
    assert c.expert_swiglu_limit_list == base.expert_swiglu_limit_list[:4] + base.expert_swiglu_limit_list[6:]
    assert c.shared_limit(3) == base.shared_limit(3) and c.shared_limit(4) == base.shared_limit(6)
    c = preset("test-tiny", num_hidden_layers=8)
    assert [c.expert_limit(i) for i in range(9)] == [base.expert_limit(i) for i in range(6)] + [0.0, 0.0, 0.1]
    assert preset("test-tiny", num_hidden_layers=4, expert_swiglu_limit_list=[0.5]).expert_swiglu_limit_list == (0.5,)
    assert preset("ling-3.0-flash", num_hidden_layers=2).expert_swiglu_limit_list == (0.0, 0.0)


# -- errors: exit non-zero, name the problem, no traceback ----------------------------------------------------


def test_unknown_preset(runner, tmp_path):
    _fails(runner.invoke(app, ["init", "--preset", "ling-9", "--out", str(tmp_path / "ck")]),
           "unknown preset 'ling-9'", "test-tiny")
    assert not (tmp_path / "ck").exists()


def test_messages_are_not_rich_markup(runner, built, tmp_path):
    """Regression: names and paths went through rich markup: '[/x]' crashed with a MarkupError traceback and
    'runs/[exp]' printed as 'runs/'."""
    _fails(runner.invoke(app, ["init", "--preset", "[/x]", "--out", str(tmp_path / "ck")]), "unknown preset '[/x]'")
    odd = tmp_path / "runs" / "[exp]"
    odd.mkdir(parents=True)
    _fails(runner.invoke(app, ["report", str(odd)]), f"{odd}: no manifest.json")
    text = _ok(runner.invoke(app, ["report", str(built["art"]), "-o", str(odd / "r.html")]))
    assert f"wrote {odd / 'r.html'}" in text


def test_bad_layer_count(runner, tmp_path):
    _fails(runner.invoke(app, ["init", "--preset", "test-tiny", "--out", str(tmp_path / "ck"), "--layers", "0"]),
           "num_hidden_layers", "positive")


def test_init_over_a_file(runner, tmp_path):
    """Regression: an OSError while writing the checkpoint showed a traceback."""
    (tmp_path / "f").write_text("x")
    _fails(runner.invoke(app, ["init", "--preset", "test-tiny", "--out", str(tmp_path / "f")]),
           "cannot write the checkpoint", "File exists")


def test_unknown_pass(runner, built, tmp_path):
    _fails(runner.invoke(app, ["compile", str(built["ck"]), "--passes", "fuse_swiglu,fuse_everything",
                               "-o", str(tmp_path / "a")]),
           "unknown pass(es) ['fuse_everything']", f"known passes: {', '.join(sorted(PASSES))}, all")
    assert not (tmp_path / "a").exists()


def test_compile_without_config_json(runner, tmp_path):
    (tmp_path / "ck").mkdir()
    _fails(runner.invoke(app, ["compile", str(tmp_path / "ck"), "-o", str(tmp_path / "a")]), "no config.json")
    _fails(runner.invoke(app, ["compile", str(tmp_path / "missing"), "-o", str(tmp_path / "a")]), "not a directory")


def test_compile_bad_dtype_and_program(runner, built, tmp_path):
    _fails(runner.invoke(app, ["compile", str(built["ck"]), "-o", str(tmp_path / "a"), "--dtype", "fp8"]),
           "unknown dtype 'fp8'")
    _fails(runner.invoke(app, ["compile", str(built["ck"]), "-o", str(tmp_path / "a"), "--programs", "decoder"]),
           "unknown program(s) ['decoder']")


def test_compile_refuses_to_overwrite_a_non_artifact(runner, built):
    before = sorted(p.name for p in built["ck"].iterdir())
    _fails(runner.invoke(app, ["compile", str(built["ck"]), "-o", str(built["ck"]), *SMALL,
                               "--programs", "decode"]),
           "is not a lingc artifact; refusing to overwrite it")
    assert sorted(p.name for p in built["ck"].iterdir()) == before


def test_diff_for_a_pass_that_did_not_run(runner, built):
    _fails(runner.invoke(app, ["diff", str(built["art"]), "--pass", "fuse_moe_align"]),
           "pass 'fuse_moe_align' did not run", "passes run: fuse_swiglu, bf16_router, pdl")
    _fails(runner.invoke(app, ["diff", str(built["art"]), "--pass", "pdl", "--program", "decoder"]),
           "no program 'decoder'", "programs: prefill, decode")


def test_diff_and_report_on_a_non_artifact(runner, built, tmp_path):
    for cmd in (["diff", str(built["ck"]), "--pass", "pdl"], ["report", str(built["ck"]), "-o", str(tmp_path / "r.html")]):
        _fails(runner.invoke(app, cmd), "no manifest.json; not a lingc artifact")
    assert not (tmp_path / "r.html").exists()


def test_report_into_a_missing_directory(runner, built, tmp_path):
    """Regression: a report path in a missing directory showed a FileNotFoundError traceback."""
    _fails(runner.invoke(app, ["report", str(built["art"]), "-o", str(tmp_path / "no/such/dir/r.html")]),
           "cannot write the report", "No such file or directory")


# -- help -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command, options", [
    ("init", ["--preset", "--out", "--layers", "--mtp-layers", "--seed", "--device", "--shard-mb"]),
    ("compile", ["--passes", "--out", "--programs", "--dtype", "--verify", "--max-len", "--prefill-tokens",
                 "--draft-tokens"]),
    ("passes", []),
    ("diff", ["--pass", "--program", "--context", "--color"]),
    ("report", ["--out"]),
    ("generate", ["--prompt-ids", "--prompt", "--max-new-tokens", "--spec", "--temperature", "--top-p", "--top-k",
                  "--seed", "--ignore-eos", "--simulate-accept-len", "--device", "--json"]),
    ("demo", ["--workdir", "--new-tokens"]),
])
def test_help(runner, command, options):
    text = _ok(runner.invoke(app, [command, "--help"], prog_name="lingc"))
    assert f"Usage: lingc {command} [OPTIONS]" in text
    for option in options:
        assert option in text, option


def test_compile_help_shows_the_default_max_len(runner):
    text = _ok(runner.invoke(app, ["compile", "--help"], prog_name="lingc"))
    assert re.search(r"--max-len .*\[default: 512\]", text), text


def test_top_level_help_lists_the_commands(runner):
    text = _ok(runner.invoke(app, ["--help"]))
    for command in ("init", "compile", "passes", "diff", "report", "generate", "demo", "serve", "bench"):
        assert command in text


# -- generate -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["nextn", "none"])
def test_generate_greedy_matches_the_reference(runner, built, exact, spec):
    """`lingc generate --json` (NEXTN speculation, or plain decode) gives the fp32 reference model's greedy tokens."""
    out = _generate(runner, exact, "--spec", spec)
    model = lingc.load(built["ck"], dtype=torch.float32)
    assert out["tokens"] == model.generate(torch.tensor([[11, 22, 33]]), 10)[0].tolist()
    assert out["prompt_tokens"] == 3 and out["finish_reason"] == "length" and out["spec"] == spec
    assert out["text"] is None and out["simulated_accept_len"] is None     # no tokenizer.json in a random checkpoint
    assert out["steps"] == len(out["accept_lens"]) and sum(out["accept_lens"]) >= 9
    assert out["mean_accept_len"] == pytest.approx(sum(out["accept_lens"]) / out["steps"])
    for key in ("ttft_ms", "tpot_ms", "tok_per_s", "step_ms"):
        assert out[key] >= 0, key


def test_generate_prints_a_summary(runner, exact):
    text = _ok(runner.invoke(app, ["generate", str(exact), "--prompt-ids", "11,22,33", "--max-new-tokens", "10",
                                   "--ignore-eos"]))
    assert "prompt (3 tokens): [11, 22, 33]" in text
    assert re.search(r"output \(10 tokens, finish: length\): \[\d+(, \d+){9}\]", text)
    assert re.search(r"spec nextn: \d+ decode steps, mean accept length \d\.\d\d; TTFT [\d.]+ ms", text)


def test_generate_sampled_is_reproducible(runner, exact):
    a = _generate(runner, exact, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    b = _generate(runner, exact, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    c = _generate(runner, exact, "--temperature", "0.8", "--top-p", "0.9", "--seed", "4")
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 10
    assert c["tokens"] != a["tokens"]


def test_generate_simulated_accept_length(runner, exact):
    out = _generate(runner, exact, "--simulate-accept-len", "3")
    assert out["simulated_accept_len"] == 3.0 and len(out["tokens"]) == 10
    assert out["accept_lens"][:-1] == [3] * (len(out["accept_lens"]) - 1)


def test_generate_errors(runner, built, exact, tmp_path):
    art = str(exact)
    gen = lambda *a: runner.invoke(app, ["generate", *a])  # noqa: E731
    _fails(gen(str(built["art"]), "--prompt-ids", "1,2"),                 # compiled without partition
           "lacks program(s) ['draft', 'verify', 'extend'] needed for --spec nextn", "partition")
    _ok(gen(str(built["art"]), "--prompt-ids", "1,2", "--max-new-tokens", "3", "--spec", "none"))
    _fails(gen(art, "--prompt-ids", "1,2", "--prompt", "hi"), "give exactly one of --prompt-ids and --prompt")
    _fails(gen(art), "give exactly one of --prompt-ids and --prompt")
    _fails(gen(art, "--prompt-ids", "1,x"), "--prompt-ids must be comma-separated integers, got '1,x'")
    _fails(gen(art, "--prompt-ids", "1,99999"), "prompt token ids [99999] are outside the vocabulary [0, 512)")
    _fails(gen(art, "--prompt-ids", "1,2", "--max-new-tokens", "51"),
           "prompt (2) + max_new_tokens (51) exceeds the artifact's context 52", "--max-len")
    _fails(gen(art, "--prompt", "hello"), "has no tokenizer.json (the checkpoint had none); use --prompt-ids")
    _fails(gen(art, "--prompt-ids", "1", "--spec", "eagle"), "spec must be 'nextn' or 'none', got 'eagle'")
    short = ("--prompt-ids", "1", "--max-new-tokens", "3")
    _fails(gen(art, *short, "--temperature", "-1"), "temperature must be >= 0")
    _fails(gen(art, *short, "--top-p", "0"), "top_p must be in (0, 1]")
    _fails(gen(art, *short, "--top-k", "-2"), "top_k must be >= 0")
    _fails(gen(art, *short, "--spec", "none", "--simulate-accept-len", "3"),
           "--simulate-accept-len needs --spec nextn")
    _fails(gen(str(tmp_path), "--prompt-ids", "1"), "no manifest.json; not a lingc artifact")


# -- the demo -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo(runner, tmp_path):
    """The built-in default end to end: a --verify compile of every pass at default shapes, then greedy generation
    on the engine with NEXTN speculation and with plain decoding, which must agree (10-30 s on a 2-core CPU)."""
    text = _ok(runner.invoke(app, ["demo", "--workdir", str(tmp_path / "demo"), "--new-tokens", "24"]))
    for stage in ("1. lingc init --preset test-tiny", "2. lingc compile --passes all --verify",
                  "3. lingc generate (greedy): NEXTN 5/6 vs plain decode"):
        assert stage in text
    assert re.search(r"--spec nextn: \d+ steps, accept length [\d.]+, 24 tokens", text)
    assert re.search(r"--spec none : 23 steps, accept length 1\.00, 24 tokens", text)
    assert "NEXTN output is byte-identical to plain decoding" in text and "differ" not in text
    for name in PASSES:
        assert name in text, name
    art = load_artifact(tmp_path / "demo/art")
    assert {"draft", "verify", "extend", "step"} <= set(art.manifest["programs"])
