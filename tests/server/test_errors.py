"""Bad input never kills the server: each gets a 4xx whose message names the problem, and the server still serves."""

from __future__ import annotations

import pytest

from srv_support import MODEL

OK_GEN = {"input_ids": [11, 22, 33], "sampling_params": {"max_new_tokens": 2}}
OK_CMPL = {"model": MODEL, "prompt": [11, 22, 33], "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w11"}], "max_tokens": 2}


def gen(**sampling):
    return dict(OK_GEN, sampling_params=dict(OK_GEN["sampling_params"], **sampling))


# (route, JSON body, status, what the message must say)
CASES = [
    ("/generate", [1, 2], 400, "must be a JSON object"),
    ("/generate", {}, 400, "exactly one of 'text' and 'input_ids'"),
    ("/generate", dict(OK_GEN, text="w1"), 400, "exactly one of 'text' and 'input_ids'"),
    ("/generate", {"input_ids": []}, 400, "'input_ids' is empty"),
    ("/generate", {"input_ids": [11, 512]}, 400, "token ids [512] outside the vocabulary [0, 512)"),
    ("/generate", {"input_ids": [-1]}, 400, "token ids [-1] outside the vocabulary"),
    ("/generate", {"input_ids": [1.5]}, 400, "'input_ids.0': Input should be a valid integer"),
    ("/generate", {"input_ids": "11,22"}, 400, "'input_ids'"),
    ("/generate", {"input_ids": list(range(52))}, 400, "the prompt has 52 tokens; the context holds 52"),
    ("/generate", dict(OK_GEN, stream="yes"), 400, "'stream': Input should be a valid boolean"),
    ("/generate", dict(OK_GEN, foo=1), 400, "unknown field 'foo'"),
    ("/generate", gen(max_tokens=3), 400, "unknown field 'sampling_params.max_tokens'"),
    ("/generate", gen(max_new_tokens=0), 400, "'sampling_params.max_new_tokens' must be >= 1"),
    ("/generate", gen(max_new_tokens=-5), 400, "'sampling_params.max_new_tokens' must be >= 1"),
    ("/generate", gen(max_new_tokens=10**12), 400, "leaves room for 49 in the 52-token context"),
    ("/generate", gen(max_new_tokens="5"), 400, "'sampling_params.max_new_tokens': Input should be a valid integer"),
    ("/generate", gen(temperature=-0.5), 400, "'temperature' must be in [0, 2]"),
    ("/generate", gen(temperature=2.5), 400, "'temperature' must be in [0, 2]"),
    ("/generate", gen(top_p=0.0), 400, "'top_p' must be in (0, 1]"),
    ("/generate", gen(top_p=1.5), 400, "'top_p' must be in (0, 1]"),
    ("/generate", gen(top_k=-2), 400, "'top_k' must be >= 0"),
    ("/generate", gen(seed=-1), 400, "'seed' must be in [0, 2**63 - 1]"),
    ("/generate", gen(seed=2**64), 400, "'seed' must be in [0, 2**63 - 1]"),
    ("/generate", gen(stop_token_ids=[600]), 400, "'stop_token_ids' [600] are outside the vocabulary"),
    ("/generate", gen(stop=[""]), 400, "'stop' strings must not be empty"),
    ("/generate", dict(OK_GEN, return_logprob=True), 400, "return_logprob: not supported"),
    ("/v1/completions", dict(OK_CMPL, model="gpt-4"), 404, "model 'gpt-4' not found"),
    ("/v1/completions", dict(OK_CMPL, max_token=3), 400, "unknown field 'max_token'"),
    ("/v1/completions", dict(OK_CMPL, max_tokens=-1), 400, "'max_tokens' must be >= 1"),
    ("/v1/completions", dict(OK_CMPL, max_tokens=100000), 400, "'max_tokens' is 100000"),
    ("/v1/completions", dict(OK_CMPL, max_tokens=True), 400, "'max_tokens': Input should be a valid integer"),
    ("/v1/completions", dict(OK_CMPL, prompt=""), 400, "'prompt' is empty"),
    ("/v1/completions", dict(OK_CMPL, prompt=[[1], [2]]), 400, "holds 2 prompts"),
    ("/v1/completions", dict(OK_CMPL, prompt={"a": 1}), 400, "'prompt' must be a string, a list of token ids"),
    ("/v1/completions", dict(OK_CMPL, prompt=[1, "w2"]), 400, "'prompt' must be a string, a list of token ids"),
    ("/v1/completions", dict(OK_CMPL, prompt=[999]), 400, "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 2}, 400, "'prompt' is required"),
    ("/v1/completions", dict(OK_CMPL, n=2), 400, "n: not supported"),
    ("/v1/completions", dict(OK_CMPL, logprobs=1), 400, "logprobs: not supported"),
    ("/v1/completions", dict(OK_CMPL, temperature=3), 400, "'temperature' must be in [0, 2]"),
    ("/v1/completions", dict(OK_CMPL, top_p=-1), 400, "'top_p' must be in (0, 1]"),
    ("/v1/chat/completions", dict(OK_CHAT, messages=[]), 400, "'messages' is empty"),
    ("/v1/chat/completions", dict(OK_CHAT, messages=[{"role": "wizard", "content": "x"}]), 400, "'messages.0.role'"),
    ("/v1/chat/completions", dict(OK_CHAT, messages="hi"), 400, "'messages'"),
    ("/v1/chat/completions", dict(OK_CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "only text parts are supported"),
    ("/v1/chat/completions", dict(OK_CHAT, max_tokens=2, max_completion_tokens=3), 400, "disagree"),
    ("/v1/chat/completions", dict(OK_CHAT, tools=[{"type": "function"}]), 400, "tools: not supported"),
    ("/v1/chat/completions", dict(OK_CHAT, max_tokens=60), 400, "'max_tokens' is 60"),
]


@pytest.mark.parametrize("route,body,status,needle", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_json_body(client, route, body, status, needle):
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("raw,needle", [(b"{bad", "malformed JSON body"), (b"", "malformed JSON body"),
                                        (b'{"input_ids": [NaN]}', "NaN is not valid JSON"),
                                        (b"\xff\xfe", "malformed JSON body")])
def test_malformed_json(client, raw, needle):
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_oversized_bodies_get_413(client):
    big = b'{"text": "' + b"w1 " * 400_000 + b'"}'                      # 1.2 MB > the 1 MiB default
    r = client.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["error"]["message"]

    def chunked():                                                    # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b" " * 100_000
    r = client.post("/generate", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_unknown_routes_and_methods(client):
    r = client.post("/v1/embeddings", json={})
    assert r.status_code == 404 and "no route /v1/embeddings" in r.json()["error"]["message"]
    r = client.get("/generate")
    assert r.status_code == 405 and "GET is not allowed on /generate" in r.json()["error"]["message"]


def test_server_survives_bad_input(client):
    """After all of the above the server is healthy and generates."""
    assert client.get("/health").json() == {"status": "ok"}
    r = client.post("/generate", json=OK_GEN)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1


def test_engine_failure_is_a_500_and_the_server_goes_on(tok_server, client, monkeypatch):
    engine = tok_server.served.scheduler.engine

    class Broken:
        def generate(self, request, on_tokens=None):
            raise RuntimeError("simulated device fault")

    monkeypatch.setattr(tok_server.served.scheduler, "engine", Broken())
    r = client.post("/generate", json=OK_GEN)
    assert r.status_code == 500 and "simulated device fault" in r.json()["error"]["message"]
    with client.stream("POST", "/generate", json=dict(OK_GEN, stream=True)) as r:   # mid-stream: an error event
        assert r.status_code == 200 and "simulated device fault" in r.read().decode()
    monkeypatch.setattr(tok_server.served.scheduler, "engine", engine)
    assert client.post("/generate", json=OK_GEN).status_code == 200
