"""A fatal engine error (a dead TP rank: EngineError.fatal) fails the request in flight with a 500 naming it, then
stops `serve()` with ServerStopped (lingc serve exits 1) instead of serving errors from a dead session."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from lingc.runtime.engine import EngineError
from lingc.runtime.server import ServerConfig, ServerStopped, serve
from lingc.runtime.session import open_session

from srv_support import MODEL   # tests/server is on sys.path


class RankDied(EngineError):
    fatal = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fatal_engine_error_stops_the_server(server_artifacts):
    session = open_session(server_artifacts["plain"])

    def dead(request, on_tokens=None):
        raise RankDied("TP rank 1 (pid 4242) was killed by signal 9")
    session.engine.generate = dead
    port, outcome = _free_port(), {}

    def run() -> None:
        try:
            serve(session, ServerConfig(MODEL, warmup=False), port=port, log_level="warning")
            outcome["returned"] = True
        except ServerStopped as e:
            outcome["stopped"] = str(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    else:
        pytest.fail("the server did not come up")
    r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                   timeout=30)
    assert r.status_code == 500 and "TP rank 1 (pid 4242) was killed" in r.text
    thread.join(15)
    assert not thread.is_alive(), "the server kept running after a fatal engine error"
    assert "TP rank 1 (pid 4242) was killed" in outcome.get("stopped", ""), outcome
