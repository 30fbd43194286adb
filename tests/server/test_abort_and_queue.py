"""Client disconnects abort their request and leave no trace; a full queue answers 503; the API key guards routes."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from srv_support import KEY, MODEL, metric

# sampled through a narrow nucleus: random MTP drafts are rarely accepted, so 40 tokens take ~40 steps (~2 s)
LONG = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 0.05, "seed": 5, "ignore_eos": True}


def _wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _aborted(client: httpx.Client, **headers) -> float:
    text = client.get("/metrics", headers=headers).text
    return metric(text, "lingc_requests_finished_total", route="/generate", finish_reason="abort")


def test_disconnect_mid_stream_aborts_and_leaves_no_trace(tok_server, client, reference):
    """A sampled 40-token stream dropped after two chunks, then a greedy request: its output is a fresh Engine's."""
    want = reference([7, 8, 9], 8)
    before = client.get("/metrics").text
    with httpx.Client(base_url=tok_server.url, timeout=60) as doomed:
        with doomed.stream("POST", "/generate", json={"input_ids": [11, 22, 33], "stream": True,
                                                      "sampling_params": LONG}) as r:
            lines = r.iter_lines()
            assert sum(1 for line in (next(lines), next(lines), next(lines)) if line.startswith("data: ")) >= 1
    # leaving the block closed the connection mid-stream; the next request waits behind the aborted one
    out = client.post("/generate", json={"input_ids": [7, 8, 9], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
    assert out["output_ids"] == want
    after = client.get("/metrics").text
    assert _aborted(client) == metric(before, "lingc_requests_finished_total", route="/generate",
                                      finish_reason="abort") + 1
    generated = metric(after, "lingc_generation_tokens_total") - metric(before, "lingc_generation_tokens_total")
    assert 8 < generated < 8 + 40                                     # the aborted request stopped early
    assert tok_server.served.engine.free_slots == [0, 1]              # its slot came back
    assert not tok_server.served.engine.pages.owned                   # and its pages


def test_disconnect_while_waiting_for_a_json_answer(tok_server, client, reference):
    """A non-streaming client that times out (closing its connection) aborts its request too."""
    before = _aborted(client)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tok_server.url + "/generate", json={"input_ids": [11, 22, 33], "sampling_params": LONG}, timeout=0.5)
    out = client.post("/generate", json={"input_ids": [7, 8, 9], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
    assert out["output_ids"] == reference([7, 8, 9], 8)
    _wait_for(lambda: _aborted(client) == before + 1, "the abort to be counted")


class GatedEngine:
    """The engine behind a gate: generate() waits until the test opens it (to hold the queue full on purpose)."""

    def __init__(self, engine):
        self.engine, self.gate = engine, threading.Event()

    def generate(self, request, on_tokens=None):
        assert self.gate.wait(60), "the test never opened the gate"
        return self.engine.generate(request, on_tokens)


def test_full_queue_is_503_with_retry_after(plain_server, reference, monkeypatch):
    """max_queue 1: one request runs, one waits, the third is refused; the two accepted ones get their answers."""
    gated = GatedEngine(plain_server.served.scheduler.engine)
    monkeypatch.setattr(plain_server.served.scheduler, "engine", gated)
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=plain_server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        info = lambda: c.get("/get_server_info").json()                           # noqa: E731
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(c.post("/generate", json=body))) for _ in range(2)]
        threads[0].start()
        _wait_for(lambda: info()["running"], "the first request to run")
        threads[1].start()
        _wait_for(lambda: info()["queue_depth"] == 1, "the second request to queue")
        refused = c.post("/generate", json=body)
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert "1 request(s) already wait (--max-queue 1)" in refused.json()["error"]["message"]
        gated.gate.set()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in results] == [200, 200]
        assert all(r.json()["output_ids"] == reference([7, 8, 9], 4) for r in results)
        assert metric(c.get("/metrics").text, "lingc_http_requests_total", route="/generate", status="503") == 1


def test_api_key(plain_server):
    url = plain_server.url
    assert httpx.get(url + "/health").status_code == 200              # open: load balancers probe it
    for route in ("/v1/models", "/get_server_info", "/metrics"):
        r = httpx.get(url + route)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], route
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(url + "/generate", json={"input_ids": [1]}, headers={"Authorization": KEY}).status_code == 401
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_a_waiting_client_that_leaves_is_dropped_from_the_queue(plain_server, reference, monkeypatch):
    gated = GatedEngine(plain_server.served.scheduler.engine)
    monkeypatch.setattr(plain_server.served.scheduler, "engine", gated)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=plain_server.url, timeout=60, headers=auth) as c:
        info = lambda: c.get("/get_server_info").json()                           # noqa: E731
        results: list[httpx.Response] = []
        first = threading.Thread(target=lambda: results.append(c.post("/generate", json=body)))
        first.start()
        _wait_for(lambda: info()["running"], "the first request to run")
        with pytest.raises(httpx.ReadTimeout):                     # waits in the queue, then gives up
            httpx.post(plain_server.url + "/generate", json=body, headers=auth, timeout=1.0)
        _wait_for(lambda: info()["queue_depth"] == 0, "the abandoned request to leave the queue")
        gated.gate.set()
        first.join(60)
        assert results[0].json()["output_ids"] == reference([7, 8, 9], 4)
