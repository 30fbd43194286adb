"""Fixtures for the server tests: real `lingc serve` apps (uvicorn on a loopback port, in a thread) over a test-tiny
artifact compiled with all passes, and a fresh Engine as the reference for every output.

One compile (fp32, max_len 64 -> a 52-token context, prefill chunks of 16) written twice: `art_tok` from a
checkpoint given a WordLevel tokenizer.json ("w0" .. "w509", "<pad>", "<eos>") and a tokenizer_config.json with
a chat template, and `art_plain` without either. Servers: `tok_server` (art_tok, open, queue 64) and
`plain_server` (art_plain, API key KEY, max queue 1). A decode step of test-tiny takes ~40 ms on one core, so
requests ask for few tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import httpx
import pytest

from lingc.artifact import write_artifact
from lingc.compile import compile_checkpoint
from lingc.runtime.engine import Request, SamplingParams
from lingc.runtime.server import ServerConfig, ServerThread
from lingc.runtime.session import open_session
from lingc.trace import TraceOptions

from srv_support import CHAT_TEMPLATE, KEY, MODEL, word_level_tokenizer   # tests/server is on sys.path


@pytest.fixture(scope="session")
def server_artifacts(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server")
    ck = shutil.copytree(tiny_ckpt, root / "ck")
    word_level_tokenizer().save(str(ck / "tokenizer.json"))
    (ck / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<eos>"}))
    result = compile_checkpoint(ck, root / "art_tok", ["all"], dtype="fp32",
                                options=TraceOptions(max_len=64, prefill_tokens=16))
    write_artifact(result, root / "art_plain", source=str(ck))          # the same program, no tokenizer files
    return {"tok": root / "art_tok", "plain": root / "art_plain"}


class LiveServer(ServerThread):
    """runtime.server.ServerThread (create_app + uvicorn on 127.0.0.1:<free port>, in a daemon thread) over an
    artifact; `url`, `served` (the app's state), `stop()`."""

    def __init__(self, artifact: Path, **config):
        super().__init__(open_session(artifact), ServerConfig(MODEL, **config), start_timeout_s=120)


@pytest.fixture(scope="session")
def tok_server(server_artifacts) -> LiveServer:
    server = LiveServer(server_artifacts["tok"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plain_server(server_artifacts) -> LiveServer:
    server = LiveServer(server_artifacts["plain"], api_key=KEY, max_queue=1)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference(server_artifacts) -> Callable[..., list[int]]:
    """reference(prompt, n, temperature=0.0, seed=0, top_p=1.0, top_k=0) -> the tokens a fresh Engine (not the
    server's) generates for that request with ignore_eos; cached."""
    engine = open_session(server_artifacts["plain"]).engine
    cache: dict[tuple, list[int]] = {}

    def run(prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0, top_p: float = 1.0,
            top_k: int = 0) -> list[int]:
        key = (tuple(prompt), n, temperature, seed, top_p, top_k)
        if key not in cache:
            req = Request(list(prompt), n, SamplingParams(temperature, top_k, top_p, seed), ignore_eos=True)
            cache[key] = engine.generate(req).tokens
        return cache[key]

    return run


@pytest.fixture(scope="session")
def client(tok_server) -> httpx.Client:
    with httpx.Client(base_url=tok_server.url, timeout=60) as c:
        yield c
