"""`lingc serve`: an HTTP server over one Session: OpenAI-compatible completions and chat, SGLang-style /generate.

Routes, queueing and errors are described in docs/server.md. The app is thin: each route parses its body
with a pydantic model, turns it into one engine `Request` (checked here so that every bad input is a 4xx
naming the field), submits it to the `Scheduler` (runtime/scheduler.py: one thread owns the Engine, batch 1)
and formats the events it sends back, as one JSON response or as server-sent events. A client that goes away
cancels its job: a waiting job leaves the queue, a running one is aborted at the engine's next step.
(Over the ~400-line guide: the three protocols share one request path; splitting them would spread it.)
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from lingc.runtime.engine import EngineError, Request, Result, SamplingParams
from lingc.runtime.scheduler import QueueFull, Scheduler, ServerStats, ShuttingDown
from lingc.runtime.session import draft_vocab_size

log = logging.getLogger(__name__)

OPEN_ROUTES = ("/health",)                        # no API key needed
MAX_SEED = 2**63 - 1                              # the relay holds seeds as int64
TEMPERATURE_MAX = 2.0                             # OpenAI's range


@dataclass(frozen=True)
class ServerConfig:
    model_name: str                               # what /v1/models lists and `model` must name
    api_key: str | None = None                    # every route but /health needs "Authorization: Bearer KEY"
    max_queue: int = 64                           # requests waiting behind the running one; more get 503
    max_body_bytes: int = 1 << 20                 # larger bodies get 413
    warmup: bool = True                           # one short request at start-up (first-call initialisation)
    tp: int = 1
    device: str = "cpu"


class ApiError(Exception):
    """A request the server refuses: HTTP status + a message naming the problem (OpenAI's error shape)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 503: "server_busy"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# ---- request bodies -----------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingBody(_Body):
    """/generate's sampling_params (SGLang names)."""
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class GenerateBody(_Body):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingBody = SamplingBody()
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False                  # what sglang.bench_serving sends; only the defaults are served
    logprob_start_len: int | None = None
    lora_path: str | None = None


class _OpenAIBody(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                      # extensions (vLLM's names): top_k, ignore_eos, stop_token_ids
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionBody(_OpenAIBody):
    prompt: Any
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)     # templates may read more keys (name, tool_calls)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_OpenAIBody):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


def _reject_nonfinite(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


async def _parse(http: HttpRequest, model: type[BaseModel]) -> Any:
    raw = await http.body()
    try:
        data = json.loads(raw, parse_constant=_reject_nonfinite)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, "; ".join(_describe(err) for err in e.errors()[:5]),
                       param=".".join(map(str, e.errors()[0]["loc"]))) from None


def _describe(err: dict) -> str:
    where = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown field '{where}'"
    if err["type"] == "missing":
        return f"'{where}' is required"
    return f"'{where}': {err['msg']} (got {json.dumps(err.get('input'), default=str)[:80]})"


def _unsupported(checks: dict[str, bool]) -> None:
    """checks: field -> True when the request sets it to something this server does not implement."""
    bad = [name for name, is_set in checks.items() if is_set]
    if bad:
        raise ApiError(400, f"{', '.join(bad)}: not supported by lingc serve (batch-1 decoding, no logprobs, "
                            "no penalties, no tools)", param=bad[0])


# ---- one generation -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context: int                                  # prompt + new tokens, at most

    @classmethod
    def of(cls, engine: Any) -> "Limits":
        opt = engine.opt
        return cls(engine.program.config.vocab_size, opt["max_len"] - 2 * opt["draft_tokens"])


@dataclass
class Sampling:
    """The knobs every route shares, under the route's own field names (for error messages)."""
    max_new: int | None
    default_max: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    max_name: str = "max_tokens"


def build_request(limits: Limits, prompt: list[int], s: Sampling, prompt_name: str = "prompt") -> Request:
    """An engine Request from checked values; every refusal names the field and the allowed range."""
    V, ctx = limits.vocab_size, limits.context
    if not prompt:
        raise ApiError(400, f"'{prompt_name}' is empty", prompt_name)
    bad = [t for t in prompt if not 0 <= t < V]
    if bad:
        raise ApiError(400, f"'{prompt_name}' has token ids {bad[:5]} outside the vocabulary [0, {V})", prompt_name)
    if len(prompt) >= ctx:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; the context holds {ctx} (prompt + new tokens), "
                            f"so at most {ctx - 1} prompt tokens fit", prompt_name)
    room = ctx - len(prompt)
    if s.max_new is None:
        max_new = room if s.default_max is None else min(s.default_max, room)
    elif s.max_new < 1:
        raise ApiError(400, f"'{s.max_name}' must be >= 1, got {s.max_new}", s.max_name)
    elif s.max_new > room:
        raise ApiError(400, f"'{s.max_name}' is {s.max_new} but the prompt ({len(prompt)} tokens) leaves room for "
                            f"{room} in the {ctx}-token context", s.max_name)
    else:
        max_new = s.max_new
    temperature = 1.0 if s.temperature is None else s.temperature
    if not 0 <= temperature <= TEMPERATURE_MAX:
        raise ApiError(400, f"'temperature' must be in [0, {TEMPERATURE_MAX:g}], got {temperature}", "temperature")
    top_p = 1.0 if s.top_p is None else s.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if s.top_k in (None, -1) else s.top_k          # -1 is SGLang's "off"
    if top_k < 0:
        raise ApiError(400, f"'top_k' must be >= 0 (or -1 for off), got {top_k}", "top_k")
    seed = secrets.randbits(63) if s.seed is None else s.seed
    if not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"'seed' must be in [0, 2**63 - 1], got {seed}", "seed")
    stop_ids = tuple(s.stop_token_ids or ())
    bad = [t for t in stop_ids if not 0 <= t < V]
    if bad:
        raise ApiError(400, f"'stop_token_ids' {bad[:5]} are outside the vocabulary [0, {V})", "stop_token_ids")
    sampling = SamplingParams(float(temperature), top_k if top_k < V else 0, float(top_p), seed)    # top_k >= V: off
    return Request(list(prompt), max_new, sampling, s.ignore_eos, stop_ids)


def _stops(stop: str | list[str] | None, tokenizer: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ApiError(400, "'stop' strings must not be empty", "stop")
    if len(stops) > 16:
        raise ApiError(400, f"'stop' has {len(stops)} strings; at most 16", "stop")
    if stops and tokenizer is None:
        raise ApiError(400, "'stop' strings need a tokenizer and the artifact has no tokenizer.json; use "
                            "'stop_token_ids'", "stop")
    return stops


class TextStream:
    """Detokenizes a growing output. Text that may still become a stop string (or is an incomplete UTF-8
    sequence) is held back; a stop string ends the output there, and the token that completed it is the last."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, None       # stopped: the stop string that matched

    def push(self, new: list[int]) -> tuple[list[int], str]:
        """Take one step's tokens; returns (tokens kept, text to send now)."""
        kept: list[int] = []
        for t in new:
            kept.append(t)
            self.ids.append(t)
            if self.stops and self._find_stop():
                break
        if self.tok is not None and not self.stopped:
            self.text = self.tok.decode(self.ids)
        return kept, self._release(final=self.stopped is not None)

    def flush(self) -> str:
        return self._release(final=True)

    def _find_stop(self) -> bool:
        self.text = self.tok.decode(self.ids)
        start = max(0, self.sent - self.hold)
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            i, self.stopped = min(hits)
            self.text = self.text[:i]
        return bool(hits)

    def _release(self, final: bool) -> str:
        safe = len(self.text)
        if not final:
            safe = min(safe - self.hold, len(self.text.rstrip("\ufffd")))
        delta = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta


class _Channel:
    """Scheduler events, handed from the scheduler thread to this event loop."""

    def __init__(self) -> None:
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

    def __call__(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class Generation:
    """One submitted request as a stream of (new token ids, new text) updates; then `finish`, `result`."""

    def __init__(self, served: "Served", request: Request, stops: list[str], route: str):
        self.served, self.request, self.route = served, request, route
        self.channel = _Channel()
        self.text = TextStream(served.tokenizer, stops)
        self.finish: str | None = None
        self.result: Result | None = None
        self.arrived = time.perf_counter()
        try:
            self.job = served.scheduler.submit(request, self.channel, route)
        except QueueFull as e:
            raise ApiError(503, str(e), headers={"Retry-After": str(e.retry_after_s)}) from None
        except ShuttingDown as e:
            raise ApiError(503, str(e)) from None

    async def updates(self) -> AsyncIterator[tuple[list[int], str]]:
        stopped = False                           # a stop string matched: the job is aborted, wait for its Result
        while self.result is None:
            kind, payload = await self.channel.queue.get()
            if kind == "tokens" and not stopped:
                kept, delta = self.text.push(payload)
                if self.text.stopped is not None:
                    self.served.scheduler.cancel(self.job, "stop")
                    stopped, delta = True, delta + self.text.flush()
                yield kept, delta
            elif kind == "done":
                self.result, self.finish = payload, "stop" if stopped else payload.finish_reason
                tail = self.text.flush()
                if tail:
                    yield [], tail
            elif kind == "error":
                self.finish = "error"
                if type(payload) is EngineError:      # a request the checks above missed; subclasses (TPError) are
                    raise ApiError(400, str(payload))  # the server's own failures
                if isinstance(payload, ShuttingDown):
                    raise ApiError(503, str(payload))
                raise ApiError(500, f"the engine failed: {type(payload).__name__}: {payload}")

    async def collect(self, http: HttpRequest) -> None:
        """Run to the end (non-streaming), aborting if the client disconnects first."""
        async def drain() -> None:
            async for _ in self.updates():
                pass
        work, gone = asyncio.ensure_future(drain()), asyncio.ensure_future(_disconnected(http))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if work not in done:
            work.cancel()
            self.close()
            raise ApiError(499, "the client disconnected")
        work.result()

    def close(self) -> None:
        """Abort unless finished (a client gone mid-stream, or a handler error)."""
        if self.result is None and self.finish != "error":
            self.served.scheduler.cancel(self.job, "disconnect")

    @property
    def tokens(self) -> list[int]:
        return self.text.ids

    def meta(self) -> dict[str, Any]:
        r = self.result
        accept = r.accept_lens if r is not None else []
        return {"prompt_tokens": len(self.request.prompt), "completion_tokens": len(self.tokens),
                "spec_accept_length": sum(accept) / len(accept) if accept else None, "spec_verify_ct": len(accept),
                "accept_lens": accept, "e2e_latency": time.perf_counter() - self.arrived,
                "queue_time": (self.job.started or self.arrived) - self.job.submitted,
                "ttft": None if self.job.first_token is None else self.job.first_token - self.job.submitted}


async def _disconnected(http: HttpRequest) -> None:
    try:
        while (await http.receive())["type"] != "http.disconnect":
            pass
    except Exception:                             # cannot watch this connection: never report it gone
        await asyncio.Event().wait()


def _sse_response(gen: Generation, chunks) -> StreamingResponse:
    # the background task aborts the job also when the client left before the stream's first chunk was pulled
    return StreamingResponse(_stream(gen, chunks), media_type="text/event-stream", background=BackgroundTask(gen.close))


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"


async def _stream(gen: Generation, chunks) -> AsyncIterator[str]:
    """SSE: `chunks(new_ids, delta, first, final)` gives the payloads of each update; [DONE] last. On a
    disconnect Starlette cancels this generator, and `finally` aborts the request."""
    first = True
    try:
        async for new_ids, delta in gen.updates():
            for c in chunks(new_ids, delta, first, False):
                yield _sse(c)
            first = False
        for c in chunks([], "", first, True):
            yield _sse(c)
    except ApiError as e:
        yield _sse(e.body())
    finally:
        gen.close()
    yield _sse("[DONE]")


# ---- chat templates -----------------------------------------------------------------------------------------
class ChatTemplate:
    """The checkpoint's chat template (tokenizer_config.json `chat_template`), rendered with jinja2's sandbox."""

    def __init__(self, path: Path):
        self.source, self.error, self.special, self.template = None, None, {}, None
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.exists():
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as e:
                self.error = f"{cfg_file} is unreadable: {e}"
                return
            source = cfg.get("chat_template")
            if isinstance(source, list):                  # [{"name": "default", "template": ...}, ...]
                source = next((t.get("template") for t in source if t.get("name") == "default"), None)
            self.source = source if isinstance(source, str) else None
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                tok = cfg.get(key)
                self.special[key] = tok.get("content") if isinstance(tok, dict) else tok
        jinja_file = path / "chat_template.jinja"                 # transformers' newer place for it
        if self.source is None and jinja_file.exists():
            self.source = jinja_file.read_text()
        if self.source is not None:
            try:
                from jinja2 import TemplateError
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                self.error = "chat templates need jinja2 (pip install jinja2)"
                return

            def raise_exception(message: str) -> None:
                raise TemplateError(message)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            try:
                self.template = env.from_string(self.source)
            except TemplateError as e:
                self.error = f"the checkpoint's chat template does not compile: {e}"

    def render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError
        if self.template is None:
            raise ApiError(400, self.error or "this model has no chat template (tokenizer_config.json has no "
                                              "'chat_template'); use /v1/completions with a prompt", "messages")
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as e:
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None


def _messages(body: ChatBody) -> list[dict]:
    if not body.messages:
        raise ApiError(400, "'messages' is empty", "messages")
    out = []
    for i, m in enumerate(body.messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            parts = []
            for p in m.content:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported, got "
                                        f"{json.dumps(p)[:80]}", "messages")
                parts.append(p["text"])
            d["content"] = "\n".join(parts)
        out.append(d)
    return out


# ---- the app ------------------------------------------------------------------------------------------------
class Served:
    """What the routes share: the session, its limits, tokenizer and chat template, the scheduler and its stats."""

    def __init__(self, session: Any, config: ServerConfig):
        self.session, self.config, self.engine = session, config, session.engine
        self.path = Path(session.path)
        self.limits = Limits.of(self.engine)
        self.tokenizer = session.tokenizer
        self.chat = ChatTemplate(self.path)
        self.stats = ServerStats(self.engine.opt["draft_tokens"])
        self.scheduler = Scheduler(self.engine, config.max_queue, self.stats)
        self.created = int(time.time())
        try:                                                      # read once: a manifest can be large
            self.passes = [p["name"] for p in json.loads((self.path / "manifest.json").read_text())["passes"]]
        except (OSError, ValueError, KeyError, TypeError):
            self.passes = None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise ApiError(404, f"model '{name}' not found; this server serves '{self.config.model_name}' "
                                "(GET /v1/models)", "model")

    def encode(self, text: str, field: str, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, f"'{field}' is text but the artifact has no tokenizer.json; send token ids", field)
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def warmup_request(self) -> Request:
        """Covers prefill, decode (and the MTP programs) and a decode step, so the first client is not slower."""
        n = max(1, min(self.engine.opt["prefill_tokens"] + 1, self.limits.context - 3))
        return Request([0] * n, 2, ignore_eos=True)

    def problem(self) -> str | None:
        """Why the server cannot generate (for /health), or None."""
        if not self.scheduler.thread.is_alive():
            return "the scheduler thread is not running"
        tp = getattr(self.engine, "tp", None)                     # a TP engine's runtime (runtime/tp.py)
        if tp is not None and (getattr(tp, "broken", None) or getattr(tp, "dead", None)):
            return f"tensor parallelism failed: {tp.broken or 'a TP rank exited'}"
        return None

    def info(self) -> dict[str, Any]:
        opt, w = self.engine.opt, self.stats.window_summary()
        return {"model_path": str(self.path), "served_model_name": self.config.model_name,
                "spec": getattr(self.engine, "spec", None), "tp": self.config.tp, "device": self.config.device,
                "passes": self.passes, "context_length": self.limits.context, "max_len": opt["max_len"],
                "vocab_size": self.limits.vocab_size, "draft_tokens": opt["draft_tokens"],
                "draft_vocab": draft_vocab_size(self.engine) if getattr(self.engine, "spec", None) == "nextn" else None,
                "tokenizer": self.tokenizer is not None, "chat_template": self.chat.template is not None,
                "max_queue": self.config.max_queue, "queue_depth": self.scheduler.queue_depth,
                "running": self.scheduler.running is not None, "start_time": self.stats.started,
                "internal_states": [{"avg_spec_accept_length": w["avg_spec_accept_length"], "stats_since": w["since"],
                                     "requests": w["requests"], "decode_steps": w["steps"],
                                     "completion_tokens": w["completion_tokens"],
                                     "spec_num_total_accepted_tokens": w["committed"],   # SGLang's counter names
                                     "spec_num_total_forward_ct": w["steps"]}]}


def _completion_prompt(prompt: Any, served: Served) -> list[int]:
    """OpenAI's prompt forms: a string, token ids, or a list holding one of either (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return served.encode(prompt, "prompt")
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; this batch-1 server takes one per request",
                       "prompt")
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a one-element list of either, got "
                        f"{json.dumps(prompt, default=str)[:80]}", "prompt")


def _openai_sampling(body: _OpenAIBody, max_new: int | None, default_max: int | None, max_name: str) -> Sampling:
    return Sampling(max_new, default_max, body.temperature, body.top_p, body.top_k, body.seed, body.stop_token_ids,
                    body.ignore_eos, max_name)


def _common_unsupported(body: _OpenAIBody) -> dict[str, bool]:
    return {"n": body.n not in (None, 1), "presence_penalty": body.presence_penalty not in (None, 0),
            "frequency_penalty": body.frequency_penalty not in (None, 0), "logit_bias": bool(body.logit_bias)}


def _usage(gen: Generation) -> dict[str, int]:
    n, p = len(gen.tokens), len(gen.request.prompt)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def _openai_stream(gen: Generation, body: _OpenAIBody, base: dict, choice) -> StreamingResponse:
    """One chunk per step, a last chunk with the finish reason, then usage when stream_options asks for it."""
    usage = body.stream_options is not None and body.stream_options.include_usage

    def chunks(ids: list[int], delta: str, first: bool, final: bool) -> list[dict]:
        if not final:
            return [base | {"choices": [choice(delta, ids, None, first)]}]
        out = [base | {"choices": [choice("", [], gen.finish, first, final=True)]}]
        return out + ([base | {"choices": [], "usage": _usage(gen)}] if usage else [])
    return _sse_response(gen, chunks)


def _sglang_finish(gen: Generation) -> dict[str, Any]:
    if gen.finish == "length":
        return {"type": "length", "length": len(gen.tokens)}
    if gen.finish == "stop":
        return {"type": "stop", "matched": gen.text.stopped}
    return {"type": gen.finish}


def _served(http: HttpRequest) -> Served:
    return http.app.state.served


async def _health(http: HttpRequest) -> JSONResponse:
    problem = _served(http).problem()
    return JSONResponse({"status": problem or "ok"}, status_code=503 if problem else 200)


async def _models(http: HttpRequest) -> JSONResponse:
    served = _served(http)
    return JSONResponse({"object": "list", "data": [{
        "id": served.config.model_name, "object": "model", "created": served.created, "owned_by": "lingc",
        "max_model_len": served.limits.context}]})


async def _server_info(http: HttpRequest) -> JSONResponse:
    return JSONResponse(_served(http).info())


async def _reset_stats(http: HttpRequest) -> JSONResponse:
    """POST /reset_stats, and /flush_cache (bench_serving calls it after its warm-up; as in SGLang it resets the
    accept counters; there is no prefix cache to flush)."""
    stats = _served(http).stats
    stats.reset_window()
    return JSONResponse({"status": "ok", "stats_since": stats.window["since"]})


async def _metrics(http: HttpRequest) -> PlainTextResponse:
    served = _served(http)
    text = served.stats.render(served.scheduler.queue_depth, int(served.scheduler.running is not None))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def _completions(http: HttpRequest) -> Response:
    served = _served(http)
    body = await _parse(http, CompletionBody)
    served.check_model(body.model)
    _unsupported(_common_unsupported(body) | {
        "best_of": body.best_of not in (None, 1), "echo": body.echo, "logprobs": body.logprobs is not None,
        "suffix": body.suffix is not None})
    prompt = _completion_prompt(body.prompt, served)
    stops = _stops(body.stop, served.tokenizer)
    req = build_request(served.limits, prompt, _openai_sampling(body, body.max_tokens, 16, "max_tokens"))
    gen = Generation(served, req, stops, "/v1/completions")
    base = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": served.config.model_name}

    def choice(text: str, ids: list[int], finish: str | None, first: bool = False, final: bool = False) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    if body.stream:
        return _openai_stream(gen, body, base, choice)
    await gen.collect(http)
    return JSONResponse(base | {"choices": [choice(gen.text.text, gen.tokens, gen.finish)], "usage": _usage(gen)})


async def _chat_completions(http: HttpRequest) -> Response:
    served = _served(http)
    body = await _parse(http, ChatBody)
    served.check_model(body.model)
    _unsupported(_common_unsupported(body) | {
        "logprobs": body.logprobs, "top_logprobs": body.top_logprobs is not None, "tools": bool(body.tools),
        "tool_choice": body.tool_choice not in (None, "none", "auto"),
        "response_format": body.response_format not in (None, {"type": "text"})})
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise ApiError(400, "'max_tokens' and 'max_completion_tokens' disagree; give one", "max_tokens")
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    text = served.chat.render(_messages(body))
    if served.tokenizer is None:
        raise ApiError(400, "chat needs the checkpoint's tokenizer.json, and this artifact has none", "messages")
    prompt = served.encode(text, "messages", special=False)          # the template wrote the special tokens
    stops = _stops(body.stop, served.tokenizer)
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    req = build_request(served.limits, prompt, _openai_sampling(body, max_new, None, max_name), "messages")
    gen = Generation(served, req, stops, "/v1/chat/completions")
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": served.config.model_name}

    def choice(text: str, ids: list[int], finish: str | None, first: bool, final: bool = False) -> dict:
        delta = {"role": "assistant", "content": text} if first else {} if final else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if body.stream:
        return _openai_stream(gen, body, base | {"object": "chat.completion.chunk"}, choice)
    await gen.collect(http)
    message = {"role": "assistant", "content": gen.text.text}
    return JSONResponse(base | {"choices": [{"index": 0, "message": message, "logprobs": None,
                                             "finish_reason": gen.finish}], "usage": _usage(gen)})


async def _generate(http: HttpRequest) -> Response:
    served = _served(http)
    body = await _parse(http, GenerateBody)
    _unsupported({"return_logprob": body.return_logprob, "lora_path": body.lora_path is not None})
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of 'text' and 'input_ids'", "text")
    field = "text" if body.text is not None else "input_ids"
    prompt = served.encode(body.text, "text") if body.text is not None else body.input_ids
    sp = body.sampling_params
    stops = _stops(sp.stop, served.tokenizer)
    sampling = Sampling(sp.max_new_tokens, 128, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop_token_ids,
                        sp.ignore_eos, "sampling_params.max_new_tokens")
    gen = Generation(served, build_request(served.limits, prompt, sampling, field), stops, "/generate")
    rid = body.rid or uuid.uuid4().hex

    def payload(final: bool) -> dict:
        """SGLang's shape; while streaming, text and output_ids are cumulative (its default)."""
        if final:
            meta = {"id": rid} | gen.meta() | {"finish_reason": _sglang_finish(gen)}
        else:
            meta = {"id": rid, "prompt_tokens": len(prompt), "completion_tokens": len(gen.tokens),
                    "finish_reason": None}
        text = gen.text.text if final else gen.text.text[:gen.text.sent]
        return {"text": text, "output_ids": list(gen.tokens), "meta_info": meta}
    if body.stream:
        return _sse_response(gen, lambda ids, delta, first, final: [payload(final)])
    await gen.collect(http)
    return JSONResponse(payload(True))


async def _api_error(_: HttpRequest, e: ApiError) -> JSONResponse:
    return _error_response(e)


async def _http_error(http: HttpRequest, e: StarletteHTTPException) -> JSONResponse:
    what = {404: f"no route {http.url.path}; see docs/server.md",
            405: f"{http.method} is not allowed on {http.url.path}"}.get(e.status_code, str(e.detail))
    return _error_response(ApiError(e.status_code, what))


async def _internal_error(_: HttpRequest, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return _error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))


ROUTE_TABLE = (("/health", "GET", _health), ("/v1/models", "GET", _models),
               ("/get_server_info", "GET", _server_info), ("/metrics", "GET", _metrics),
               ("/reset_stats", "POST", _reset_stats), ("/flush_cache", "POST", _reset_stats),
               ("/v1/completions", "POST", _completions), ("/v1/chat/completions", "POST", _chat_completions),
               ("/generate", "POST", _generate))


ROUTES = {path for path, _, _ in ROUTE_TABLE}


def create_app(session: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app over `session` (an open Session, or a TP session with the same interface)."""
    served = Served(session, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(served.scheduler.start, served.warmup_request() if config.warmup else None)
        try:
            yield
        finally:
            await asyncio.to_thread(served.scheduler.stop)

    app = FastAPI(title="lingc serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    app.add_middleware(_Gate, served=served)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for path, method, handler in ROUTE_TABLE:
        app.add_api_route(path, handler, methods=[method])
    return app


# ---- middleware: API key, body limit, request counting ------------------------------------------------------
def _authorized(scope: dict, key: str) -> bool:
    scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


class _Gate:
    """ASGI middleware in front of every route: API key (all but /health), body size (413), counting by status."""

    def __init__(self, app: Any, served: Served):
        self.app, self.served = app, served

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"        # bounded label values
        status = 0

        async def counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self._serve(scope, receive, counted)
        finally:
            if route not in ("/metrics", "/health"):          # no response at all: the client left first
                self.served.stats.count_http(route, status or 499)

    async def _serve(self, scope: dict, receive: Any, send: Any) -> None:
        cfg = self.served.config
        if cfg.api_key is not None and scope["path"] not in OPEN_ROUTES and not _authorized(scope, cfg.api_key):
            e = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                         headers={"WWW-Authenticate": "Bearer"})
            return await _error_response(e)(scope, receive, send)
        limit = cfg.max_body_bytes
        too_big = ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > 16 * limit:        # do not even read it
            return await _error_response(too_big)(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:                                   # read it all (discarding past the limit) so the 413 arrives
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > 16 * limit:                   # stop reading; uvicorn closes the connection after the 413
                break
            more = message.get("more_body", False)
        if size > limit:
            return await _error_response(too_big)(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)


class ServerStopped(RuntimeError):
    """The engine failed for good (a TP rank died): the server answered the request in flight and stopped."""


def serve(session: Any, config: ServerConfig, host: str = "127.0.0.1", port: int = 30000,
          log_level: str = "info") -> None:
    """Run the server until interrupted (what `lingc serve` calls). A fatal engine error (`EngineError.fatal`: a dead
    TP rank) fails the request in flight with a 500 naming it, then stops the server and raises ServerStopped."""
    import uvicorn
    app = create_app(session, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))
    fatal: list[BaseException] = []

    def on_fatal(e: BaseException) -> None:
        log.error("stopping the server: %s", e)
        fatal.append(e)
        server.should_exit = True
    app.state.served.scheduler.on_fatal = on_fatal
    try:
        server.run()
    except KeyboardInterrupt:                     # uvicorn re-raises the captured Ctrl-C after its graceful shutdown
        pass
    if fatal:
        raise ServerStopped(f"the server stopped: {fatal[0]}")


class ServerThread:
    """The app `lingc serve` runs, served by uvicorn from a daemon thread of this process: for tests and in-process
    benchmarks (bench/device_serve.py). The constructor returns once the port accepts connections (after the
    warm-up request); `url`, `served` (the app's state), `stop()`. port 0 binds a free port (IPv4 hosts only)."""

    def __init__(self, session: Any, config: ServerConfig, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", start_timeout_s: float = 300.0):
        import socket
        import threading

        import uvicorn
        self.app = create_app(session, config)
        self.served = self.app.state.served
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="lingc-serve",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server thread for {self.url} stopped before it started (see its log)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server at {self.url} did not start within {start_timeout_s:g} s")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful shutdown: uvicorn stops accepting, the scheduler thread stops, the thread is joined."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
