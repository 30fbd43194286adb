"""/metrics (Prometheus text), /get_server_info (model info, mean accept length since /reset_stats), /health."""

from __future__ import annotations

import re

from srv_support import metric

SAMPLE = re.compile(r'^[a-z_][a-z0-9_]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$')


def test_server_info_and_accept_length_window(client):
    assert client.post("/reset_stats").status_code == 200
    info = client.get("/get_server_info").json()
    assert info["internal_states"][0]["requests"] == 0 and info["internal_states"][0]["avg_spec_accept_length"] is None
    assert (info["spec"], info["context_length"], info["vocab_size"], info["draft_tokens"]) == ("nextn", 52, 512, 6)
    assert info["passes"][:2] == ["specialize_greedy", "partition"] and "pdl" in info["passes"]
    assert info["tokenizer"] and info["chat_template"] and info["tp"] == 1 and info["max_queue"] == 64
    metas = [client.post("/generate", json={"input_ids": p, "sampling_params": {
        "max_new_tokens": 6, "temperature": t, "seed": 1, "ignore_eos": True}}).json()["meta_info"]
        for p, t in (([11, 22], 0.0), ([3, 4, 5], 0.9))]
    state = client.get("/get_server_info").json()["internal_states"][0]
    lens = metas[0]["accept_lens"] + metas[1]["accept_lens"]
    assert state["requests"] == 2 and state["decode_steps"] == len(lens) and state["completion_tokens"] == 12
    assert state["avg_spec_accept_length"] == sum(lens) / len(lens)    # committed tokens / decode steps, pooled


def test_prometheus_metrics(client):
    client.post("/generate", json={"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    client.post("/generate", json={"input_ids": [600]})                 # a 400 to count
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = [line for line in r.text.splitlines() if line and not line.startswith("#")]
    assert all(SAMPLE.match(line) for line in lines), [line for line in lines if not SAMPLE.match(line)][:3]
    text = r.text
    assert metric(text, "lingc_http_requests_total", route="/generate", status="200") >= 1
    assert metric(text, "lingc_http_requests_total", route="/generate", status="400") >= 1
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "queue_wait_seconds", "step_seconds", "spec_accept_length"):
        assert f"# TYPE lingc_{name} histogram" in text, name
        count = metric(text, f"lingc_{name}_count")
        assert count >= 1 and metric(text, f"lingc_{name}_bucket", le="+Inf") == count, name
    assert metric(text, "lingc_generation_tokens_total") >= 3 and metric(text, "lingc_queue_depth") == 0
    assert metric(text, "lingc_spec_accept_length_bucket", le="1") <= metric(text, "lingc_spec_accept_length_count")
