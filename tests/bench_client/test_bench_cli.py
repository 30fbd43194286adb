"""`lingc bench` through typer's CliRunner against the fake server: tables, the JSON report, clean errors.

The command is registered on a local app here, as lingc/cli.py registers it (`app.command("bench")(bench)`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lingc.bench_cli import bench

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
BOX = re.compile(r"[\u2500-\u257f]")          # rich's table borders
SMALL = ["--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "7", "--random-range-ratio", "1",
         "--max-concurrency", "2", "--timeout", "30"]

app = typer.Typer()
app.command("bench")(bench)


@app.callback()
def _group() -> None:
    """A group, so the command is invoked as `bench`, as under `lingc`."""


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def _text(result) -> str:
    return " ".join(BOX.sub(" ", ANSI.sub("", result.output)).split())


def _fails(result, *needles: str, code: int = 2) -> str:
    text = _text(result)
    assert result.exit_code == code, text
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert "error:" in text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def test_bench_prints_tables_and_writes_json(runner, fake, tmp_path: Path):
    fake.reset(tokens_per_chunk=2)
    out = tmp_path / "bench.json"
    r = runner.invoke(app, ["bench", "--base-url", fake.url, *SMALL, "--seed", "5", "--api-key", "secret",
                            "--json", str(out)])
    text = _text(r)
    assert r.exit_code == 0, text + repr(r.exception)
    for needle in ("successful requests 4", "failed requests 0", "TTFT", "TPOT (excl. 1st token)", "ITL",
                   "E2E latency", "peak output throughput, 1 s window", "accept length 2.00 (diff)",
                   "derived step time"):
        assert needle in text, (needle, text)
    report = json.loads(out.read_text())
    assert report["command"].startswith(f"lingc bench --base-url {fake.url} --backend sglang")
    assert "--api-key '***'" in report["command"] and "secret" not in out.read_text()
    assert report["parameters"]["num_prompts"] == 4 and report["parameters"]["seed"] == 5
    assert report["parameters"]["api_key"] == "***"
    assert report["server_info"]["vocab_size"] == 1000 and report["timestamp"]
    m = report["metrics"]
    assert m["completed"] == 4 and m["total_output_tokens"] == 28 and m["accept_length"] == 2.0
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "output_throughput", "max_output_tokens_per_s",
                "mean_e2e_latency_ms", "step_time_ms"):
        assert isinstance(m[key], float), key
    assert report["warmup"] == {"requests": 1, "failed": 0, "flushed": True}
    assert [row["output_len"] for row in report["requests"]] == [7] * 4


@pytest.mark.parametrize("args, needle", [
    (["--random-range-ratio", "1.5"], "--random-range-ratio"), (["--max-concurrency", "0"], "--max-concurrency"),
    (["--num-prompts", "0"], "--num-prompts"), (["--backend", "vllm"], "--backend"),
    (["--dataset-name", "sharegpt"], "--dataset-name"), (["--extra-request-body", "{bad"], "--extra-request-body"),
    (["--extra-request-body", "[1]"], "--extra-request-body"), (["--base-url", "localhost:1"], "--base-url"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_bad_options_are_clean_errors(runner, args, needle):
    _fails(runner.invoke(app, ["bench", *args]), needle)


def test_unreachable_server_without_vocab_size(runner, closed_port_url):
    _fails(runner.invoke(app, ["bench", "--base-url", closed_port_url, *SMALL]), "cannot reach", "--vocab-size")


def test_every_request_failing_prints_the_report_and_exits_1(runner, fake):
    fake.reset(fail_every=1)
    r = runner.invoke(app, ["bench", "--base-url", fake.url, *SMALL, "--warmup", "0", "--no-flush-cache"])
    text = _fails(r, "no request succeeded (4 failed)", code=1)
    assert "successful requests 0" in text and "4 request(s) failed: HTTP 500" in text


def test_unwritable_json_path(runner, fake, tmp_path: Path):
    r = runner.invoke(app, ["bench", "--base-url", fake.url, *SMALL, "--warmup", "0", "--no-flush-cache",
                            "--json", str(tmp_path / "missing" / "out.json")])
    _fails(r, "cannot write the report")
