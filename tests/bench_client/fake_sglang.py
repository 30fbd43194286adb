"""A fake SGLang-compatible server for the bench client's tests: streaming /generate with controlled delays,
/get_server_info with spec accept-length stats, /flush_cache; run on a free loopback port in a thread.

Stream format (SGLang's): `data: {json}` lines, each with the cumulative `text`, `output_ids` and
`meta_info.completion_tokens`, then `data: [DONE]`. The first chunk carries one token (the prefill's); every
later chunk carries `tokens_per_chunk` tokens and counts as one verify step, so the reported accept length is
`tokens_per_chunk` whenever (output_len - 1) is a multiple of it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Behavior:
    ttft_s: float = 0.01
    chunk_delay_s: float = 0.002
    tokens_per_chunk: int = 1
    vocab_size: Optional[int] = 1000         # None: /get_server_info has no vocab_size
    fail_every: int = 0                      # every Nth /generate (1-based) answers HTTP 500
    failure: str = "http"                    # http | stream_error (data: {"error"}) | truncate (no [DONE])
    api_key: Optional[str] = None            # when set, /generate needs 'Authorization: Bearer KEY'
    send_text: bool = True                   # False: text stays "" (a server without a tokenizer)
    server_info: bool = True                 # False: /get_server_info and /server_info answer 404


@dataclass
class FakeSGLangServer:
    behavior: Behavior = field(default_factory=Behavior)
    payloads: list = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    flushes: int = 0
    port: int = 0

    def reset(self, **behavior) -> "FakeSGLangServer":
        self.behavior = Behavior(**behavior)
        self.payloads, self.active, self.max_active = [], 0, 0
        self.accepted_tokens = self.verify_steps = self.flushes = 0
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/get_server_info")
        @app.get("/server_info")
        async def server_info():
            if not self.behavior.server_info:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            avg = self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0
            info = {"model_path": "fake", "internal_states": [
                {"avg_spec_accept_length": avg, "spec_num_total_accepted_tokens": self.accepted_tokens,
                 "spec_num_total_forward_ct": self.verify_steps}]}
            if self.behavior.vocab_size is not None:
                info["vocab_size"] = self.behavior.vocab_size
            return info

        @app.post("/flush_cache")
        async def flush_cache():
            self.flushes += 1
            self.accepted_tokens = self.verify_steps = 0
            return {"ok": True}

        @app.post("/generate")
        async def generate(request: Request):
            b = self.behavior
            if b.api_key is not None and request.headers.get("authorization") != f"Bearer {b.api_key}":
                return JSONResponse({"error": "unauthorized"}, status_code=401)
            payload = await request.json()
            self.payloads.append(payload)
            failing = b.fail_every and len(self.payloads) % b.fail_every == 0
            if failing and b.failure == "http":
                return JSONResponse({"error": "injected failure"}, status_code=500)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            return StreamingResponse(self._stream(payload, failing), media_type="text/event-stream")

        return app

    async def _stream(self, payload: dict, failing: bool):
        b = self.behavior
        try:
            max_new = payload["sampling_params"]["max_new_tokens"]
            await asyncio.sleep(b.ttft_s)
            ids: list[int] = []
            while len(ids) < max_new:
                if failing and len(ids) >= max_new // 2 and ids:
                    if b.failure == "stream_error":
                        yield f"data: {json.dumps({'error': {'message': 'injected mid-stream failure'}})}\n\n"
                    return                                            # truncate: no [DONE]
                n = 1 if not ids else min(b.tokens_per_chunk, max_new - len(ids))
                if ids:
                    self.accepted_tokens += n
                    self.verify_steps += 1
                ids += [(7 * len(ids) + k) % 1000 for k in range(n)]
                chunk = {"text": " ".join(f"t{i}" for i in ids) if b.send_text else "", "output_ids": ids,
                         "meta_info": {"id": "x", "prompt_tokens": len(payload["input_ids"]),
                                       "completion_tokens": len(ids), "finish_reason": None}}
                yield f"data: {json.dumps(chunk)}\n\n"
                if len(ids) < max_new:
                    await asyncio.sleep(b.chunk_delay_s)
            yield "data: [DONE]\n\n"
        finally:
            self.active -= 1


class ServerThread:
    """uvicorn on 127.0.0.1, port chosen by the OS, in a daemon thread."""

    def __init__(self, fake: FakeSGLangServer) -> None:
        config = uvicorn.Config(fake.app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server, self.fake = uvicorn.Server(config), fake
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeSGLangServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fake SGLang server did not start")
            time.sleep(0.01)
        self.fake.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.fake

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
