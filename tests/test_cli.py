"""The lingc CLI: init -> compile -> passes / diff / report, clean errors (no traceback), --help, the demo."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from lingc.artifact import load_artifact
from lingc.cli import app
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
    assert "programs: prefill, decode, verify, extend, draft" in text
    art = load_artifact(built["art"])
    assert [r["name"] for r in art.manifest["passes"]] == ["fuse_swiglu", "bf16_router", "pdl"]
    assert all(r["verify"]["ok"] for r in art.manifest["passes"])


def test_passes_lists_every_pass_with_its_numerics(runner):
    text = _ok(runner.invoke(app, ["passes"]))
    assert re.search(r"fuse_swiglu │ .* │ unchanged", text)
    assert re.search(r"bf16_router │ .* │ changed \(tol 0\.05\)", text)
    assert re.search(r"pdl │ .* │ unchanged │ fuse_swiglu, bf16_router", text)


def test_console_script_entry_point():
    lingc = Path(sys.executable).with_name("lingc")
    assert lingc.exists(), f"{lingc}: console script not installed (pip install -e .)"
    proc = subprocess.run([str(lingc), "passes"], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "200", "PATH": str(lingc.parent)})
    assert proc.returncode == 0, proc.stderr
    for name in ("fuse_swiglu", "bf16_router", "pdl"):
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
    assert "fuse_swiglu: 20 match(es); numerics unchanged" in text


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
           "unknown pass(es) ['fuse_everything']", "known passes: bf16_router, fuse_swiglu, pdl, all")
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
    ("demo", ["--workdir", "--new-tokens"]),
])
def test_help(runner, command, options):
    text = _ok(runner.invoke(app, [command, "--help"], prog_name="lingc"))
    assert f"Usage: lingc {command} [OPTIONS]" in text
    for option in options:
        assert option in text, option


def test_top_level_help_lists_the_commands(runner):
    text = _ok(runner.invoke(app, ["--help"]))
    for command in ("init", "compile", "passes", "diff", "report", "demo"):
        assert command in text


# -- the demo -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo(runner, tmp_path):
    """The built-in default end to end: two --verify compiles at default shapes (10-30 s on a 2-core CPU)."""
    text = _ok(runner.invoke(app, ["demo", "--workdir", str(tmp_path / "demo")]))
    for stage in ("1. lingc init --preset test-tiny", "2. lingc compile --passes all --verify", "3. generate"):
        assert stage in text
    assert "identical to the reference" in text and "DIFFERENT" not in text
    assert (tmp_path / "demo/art/manifest.json").exists()
