"""SGLang-style /generate through httpx: text or input_ids, sampling_params, streaming, meta_info."""

from __future__ import annotations

import pytest

from srv_support import sse_events, words


def _generate(client, **body) -> dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("prompt", [{"text": "w11 w22 w33"}, {"input_ids": [11, 22, 33]}], ids=["text", "input_ids"])
def test_generate(client, reference, prompt):
    want = reference([11, 22, 33], 6)
    out = _generate(client, **prompt, sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert out["output_ids"] == want and out["text"] == words(want)
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 6)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert sum(meta["accept_lens"]) == 5 and meta["spec_verify_ct"] == len(meta["accept_lens"])   # + the first
    assert meta["spec_accept_length"] == pytest.approx(5 / meta["spec_verify_ct"])
    assert 0 < meta["ttft"] <= meta["e2e_latency"]


def test_streaming_generate(client, reference):
    """Cumulative text and output_ids per step (SGLang's default), the finish and accept stats last, then [DONE]."""
    want = reference([11, 22, 33], 6)
    body = {"input_ids": [11, 22, 33], "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    data = events[:-1]
    counts = [e["meta_info"]["completion_tokens"] for e in data]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6
    assert all(e["output_ids"] == want[:e["meta_info"]["completion_tokens"]] for e in data)
    assert all(words(want).startswith(e["text"]) for e in data) and data[-1]["text"] == words(want)
    assert [e["meta_info"]["finish_reason"] for e in data[:-1]] == [None] * (len(data) - 1)
    assert data[-1]["meta_info"]["finish_reason"]["type"] == "length" and data[-1]["meta_info"]["accept_lens"]


def test_stop_token_ids_and_sampling(client, reference):
    want = reference([11, 22, 33], 8)
    out = _generate(client, input_ids=[11, 22, 33],
                    sampling_params={"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [want[3]]})
    assert out["output_ids"] == want[:want.index(want[3])] and out["meta_info"]["finish_reason"]["type"] == "stop"
    sampled = reference([11, 22, 33], 6, temperature=1.0, seed=3, top_k=20)
    sp = {"max_new_tokens": 6, "temperature": 1.0, "seed": 3, "top_k": 20, "ignore_eos": True}
    assert _generate(client, input_ids=[11, 22, 33], sampling_params=sp)["output_ids"] == sampled


def test_stop_string(client, reference):
    want = reference([11, 22, 33], 8)
    stop = words(want[1:3])
    out = _generate(client, text="w11 w22 w33", sampling_params={"max_new_tokens": 8, "temperature": 0, "stop": stop,
                                                                  "ignore_eos": True})
    assert out["text"] == words(want)[:words(want).index(stop)] and out["output_ids"] == want[:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["meta_info"]["accept_lens"]                        # the aborted engine run still reports its steps


def test_defaults_fill_the_context(client):
    """max_new_tokens defaults to 128, clipped to the room the prompt leaves (52-token context)."""
    prompt = list(range(1, 46))
    out = _generate(client, input_ids=prompt, sampling_params={"temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 52 - len(prompt)


def test_bench_serving_payload(client):
    """The body sglang.bench_serving sends (return_logprob, logprob_start_len, lora_path at their defaults)."""
    sampling = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
    out = _generate(client, input_ids=[5, 6], sampling_params=sampling, stream=False, lora_path=None,
                    return_logprob=False, logprob_start_len=-1)
    assert out["meta_info"]["completion_tokens"] == 2
