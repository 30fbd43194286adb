"""One fake SGLang server per session (tests/bench_client/fake_sglang.py); `fake` resets it for each test."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest

from fake_sglang import FakeSGLangServer, ServerThread   # tests/bench_client is on sys.path


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeSGLangServer]:
    with ServerThread(FakeSGLangServer()) as fake:
        yield fake


@pytest.fixture
def fake(fake_server: FakeSGLangServer) -> FakeSGLangServer:
    """The running fake server with default behaviour and cleared counters; tests call fake.reset(**behavior)."""
    return fake_server.reset()


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL nothing listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
