"""A bounded load test: 40 short requests over four routes from 8 concurrent clients. No errors, nothing lost, and
every output equals the same request run alone on a fresh Engine (so no request saw another's state)."""

from __future__ import annotations

import queue
import threading

import httpx

from srv_support import MODEL, PROMPTS, metric, sse_events

N_REQUESTS, N_CLIENTS, NEW_TOKENS = 40, 8, 4
ROUTES = ("generate", "generate-stream", "completions", "completions-stream")


def _case(i: int) -> dict:
    """Request i: prompt i % 4, route (i // 4) % 4; every 5th is sampled with one of two seeds."""
    sampled = i % 5 == 4
    return {"i": i, "prompt": PROMPTS[i % len(PROMPTS)], "route": ROUTES[(i // 4) % len(ROUTES)],
            "temperature": 0.8 if sampled else 0.0, "seed": 100 + i % 2 if sampled else 0}


def _send(client: httpx.Client, case: dict) -> list[int]:
    common = {"temperature": case["temperature"], "seed": case["seed"], "ignore_eos": True}
    if case["route"].startswith("generate"):
        body = {"input_ids": case["prompt"], "stream": case["route"].endswith("stream"),
                "sampling_params": dict(common, max_new_tokens=NEW_TOKENS)}
        path = "/generate"
    else:
        body = dict(common, model=MODEL, prompt=case["prompt"], max_tokens=NEW_TOKENS,
                    stream=case["route"].endswith("stream"))
        path = "/v1/completions"
    if not body["stream"]:
        r = client.post(path, json=body)
        r.raise_for_status()
        return r.json()["output_ids"] if path == "/generate" else r.json()["choices"][0]["token_ids"]
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        events = [e for e in sse_events(r) if e != "[DONE]"]
    if path == "/generate":
        return events[-1]["output_ids"]
    return sum((e["choices"][0]["token_ids"] for e in events if e["choices"]), [])


def test_concurrent_clients_get_their_own_outputs(tok_server, reference):
    cases = [_case(i) for i in range(N_REQUESTS)]
    want = {c["i"]: reference(c["prompt"], NEW_TOKENS, c["temperature"], c["seed"]) for c in cases}
    todo: queue.Queue = queue.Queue()
    for c in cases:
        todo.put(c)
    got, errors = {}, []
    before = httpx.get(tok_server.url + "/metrics").text

    def client_loop() -> None:
        with httpx.Client(base_url=tok_server.url, timeout=120) as client:
            while True:
                try:
                    case = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    got[case["i"]] = _send(client, case)
                except Exception as e:                          # collected: the assertion below names them
                    errors.append((case, repr(e)))

    threads = [threading.Thread(target=client_loop) for _ in range(N_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert sorted(got) == list(range(N_REQUESTS))
    wrong = [(c, got[c["i"]], want[c["i"]]) for c in cases if got[c["i"]] != want[c["i"]]]
    assert not wrong, wrong[:3]
    after = httpx.get(tok_server.url + "/metrics").text
    finished = sum(metric(after, "lingc_requests_finished_total", route=r, finish_reason="length") -
                   metric(before, "lingc_requests_finished_total", route=r, finish_reason="length")
                   for r in ("/generate", "/v1/completions"))
    assert finished == N_REQUESTS
