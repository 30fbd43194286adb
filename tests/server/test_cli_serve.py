"""`lingc serve`: a real subprocess on a loopback port, then the clean errors (no TP module, no CUDA, no artifact)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

from lingc.cli import app
from srv_support import KEY

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lingc_serve_subprocess(server_artifacts):
    """--api-key from LINGC_API_KEY, --spec none, --max-queue; /health, /get_server_info, /generate; Ctrl-C stops it."""
    port = _free_port()
    lingc = Path(sys.executable).parent / "lingc"
    cmd = [str(lingc)] if lingc.exists() else [sys.executable, "-m", "lingc.cli"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "LINGC_API_KEY": KEY, "COLUMNS": "200", "NO_COLOR": "1"}
    proc = subprocess.Popen(cmd + ["serve", str(server_artifacts["plain"]), "--port", str(port), "--spec", "none",
                                   "--max-queue", "3", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "lingc serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        info = httpx.get(url + "/get_server_info", headers=auth).json()
        assert (info["spec"], info["max_queue"], info["served_model_name"]) == ("none", 3, "art_plain")
        assert not info["tokenizer"]
        assert httpx.get(url + "/get_server_info").status_code == 401
        out = httpx.post(url + "/generate", headers=auth, timeout=60, json={
            "input_ids": [11, 22, 33],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).json()
        assert out["meta_info"]["completion_tokens"] == 4 and out["meta_info"]["accept_lens"] == [1, 1, 1]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
    assert proc.returncode == 0, output
    assert f"on http://127.0.0.1:{port}" in " ".join(ANSI.sub("", output).split())


def _serve_fails(args: list[str], *needles: str) -> None:
    result = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, ["serve", *args])
    text = " ".join(ANSI.sub("", result.output).split())
    assert result.exit_code == 2 and "Traceback" not in result.output, text
    for needle in needles:
        assert needle in text, (needle, text)


def test_tp_without_the_tp_module_is_a_clean_error(server_artifacts, monkeypatch):
    monkeypatch.setitem(sys.modules, "lingc.runtime.tp", None)          # as if runtime/tp.py did not exist
    _serve_fails([str(server_artifacts["plain"]), "--tp", "2"], "tensor parallelism is not available",
                 "serve without --tp")


def test_tp_opens_a_tp_session(server_artifacts, monkeypatch):
    """--tp N goes through lingc.runtime.tp.open_tp_session and hands its session to the server."""
    from lingc.runtime import server
    from lingc.runtime.session import open_session
    calls = {}

    def open_tp_session(artifact, tp, device, spec):
        calls["open"] = (Path(artifact), tp, device, spec)
        return open_session(artifact, spec=spec)

    monkeypatch.setitem(sys.modules, "lingc.runtime.tp", types.SimpleNamespace(open_tp_session=open_tp_session))
    monkeypatch.setattr(server, "serve", lambda session, config, **kw: calls.update(serve=(session, config, kw)))
    result = CliRunner().invoke(app, ["serve", str(server_artifacts["plain"]), "--tp", "2", "--port", "30001"])
    assert result.exit_code == 0, result.output
    assert calls["open"] == (server_artifacts["plain"], 2, "cpu", "nextn")
    session, config, kw = calls["serve"]
    assert config.tp == 2 and config.api_key is None and kw == {"host": "127.0.0.1", "port": 30001, "log_level": "info"}


def test_default_tp_follows_the_artifact(server_artifacts, monkeypatch):
    """Without --tp the artifact decides (open_any_session); a tp-1 artifact gets a plain session."""
    from lingc.runtime import server
    calls = {}
    monkeypatch.setattr(server, "serve", lambda session, config, **kw: calls.update(serve=(session, config, kw)))
    result = CliRunner().invoke(app, ["serve", str(server_artifacts["plain"]), "--api-key", "k", "--host", "0.0.0.0"])
    assert result.exit_code == 0, result.output
    session, config, kw = calls["serve"]
    assert config.tp == 1 and config.api_key == "k" and kw["host"] == "0.0.0.0"
    assert session.engine.spec == "nextn"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clean_error(server_artifacts):
    _serve_fails([str(server_artifacts["plain"]), "--device", "cuda"], "torch sees no CUDA device")


def test_missing_artifact_is_a_clean_error(tmp_path):
    _serve_fails([str(tmp_path / "nope")], "nope")
