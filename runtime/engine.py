"""Engine: prefill a request, then decode it with NEXTN speculation (or plain decode) and host run-ahead.

Per request: take a slot, zero its KDA state, write its sampling parameters into the relay buffers,
reserve pages, prefill the prompt (host-fed `prefill` chunks, `decode` for the tail), sample the first
token on the device, and for NEXTN run the MTP over the prompt (`mtp_prefill` / `mtp_decode`) to
propose d1. Then the step loop: enqueue step k (draft -> verify -> extend, or `step`; their specialize_greedy
copies draft_greedy -> ... for a temperature-0 request when the artifact has them) and only then
consume step k-1's tokens from a copy made one step late (EOS, stop ids, max tokens). Nothing on the
step path reads a device value on the host (runtime.host_reads guards that in tests).
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import torch

from lingc.ops import OPS as ops
from lingc.program import Program
from lingc.runtime.executor import Executor
from lingc.runtime.pages import PageAllocator
from lingc.steps import GREEDY_SUFFIX, NUCLEUS_SUFFIX, PLAIN_SUFFIX

NEXTN_GRAPHS = ("draft", "verify", "extend")


class EngineError(ValueError):
    """A request or artifact the engine cannot run; the message says what to change."""

    fatal = False          # True: the engine can run nothing more (a dead TP rank); a server must stop


def _is_int(x) -> bool:
    """A Python or NumPy integer (not a float, not a tensor)."""
    try:
        operator.index(x)
    except TypeError:
        return False
    return not isinstance(x, torch.Tensor)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    seed: int = 0

    def check(self) -> None:
        if not (self.temperature >= 0):
            raise EngineError(f"temperature must be >= 0, got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise EngineError(f"top_k must be >= 0 and an integer, got {self.top_k}")
        if not _is_int(self.seed):
            raise EngineError(f"seed must be an integer, got {self.seed}")
        if not (0 < self.top_p <= 1):
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str                   # "length", "stop", "abort"
    accept_lens: list[int]               # tokens committed by each decode step
    steps: int
    ttft_s: float
    total_s: float
    spec: str
    simulated_accept_len: float | None
    graphs: tuple[str, ...] = ()          # the step graphs that ran (the greedy copies for a temperature-0 request)

    @property
    def mean_accept_len(self) -> float:
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else 0.0

    @property
    def tpot_s(self) -> float:
        n = len(self.tokens)
        return (self.total_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


class LateCopy:
    """Step outputs copied off the device one step late: `start` right after enqueueing, `consume` a step later."""

    def __init__(self, out_tokens: torch.Tensor, out_len: torch.Tensor):
        pin = out_tokens.is_cuda
        self.src = (out_tokens, out_len)
        self.host = [(torch.empty_like(out_tokens, device="cpu", pin_memory=pin),
                      torch.empty_like(out_len, device="cpu", pin_memory=pin)) for _ in range(2)]
        # GPU: step k + 1 is enqueued before step k's side-stream copy has run, and would overwrite the relay;
        # so snapshot it on the compute stream (ordered before step k + 1) and copy the snapshot to the host.
        # Snapshot k % 2 is rewritten at start(k + 2), after consume(k) has waited for its copy.
        self.snap = [(torch.empty_like(out_tokens), torch.empty_like(out_len)) for _ in range(2)] if pin else None
        self.stream = torch.cuda.Stream(out_tokens.device) if pin else None
        self.events: list = [None, None]

    def start(self, k: int) -> None:
        toks, lens = self.host[k % 2]
        if self.stream is None:
            toks.copy_(self.src[0])
            lens.copy_(self.src[1])
            return
        snap_toks, snap_lens = self.snap[k % 2]
        snap_toks.copy_(self.src[0])
        snap_lens.copy_(self.src[1])
        self.stream.wait_stream(torch.cuda.current_stream(self.src[0].device))
        with torch.cuda.stream(self.stream):
            toks.copy_(snap_toks, non_blocking=True)
            lens.copy_(snap_lens, non_blocking=True)
            self.events[k % 2] = torch.cuda.Event()
            self.events[k % 2].record()

    def consume(self, k: int, slot: int) -> list[int]:
        """The tokens step k emitted for `slot` (waits only for that copy)."""
        if self.events[k % 2] is not None:
            self.events[k % 2].synchronize()
        toks, lens = self.host[k % 2]
        return toks[slot, : int(lens[slot])].tolist()


class Engine:
    """Runs requests on a compiled Program (see the module docstring)."""

    def __init__(self, program: Program, device: str | torch.device = "cpu", spec: str = "nextn",
                 simulate_accept_len: float = 0.0, backend: str = "auto", cuda_graphs: bool | None = None,
                 pdl: bool | None = None, greedy_graphs: bool = True):
        """backend "auto" is "triton" on CUDA and "reference" elsewhere; cuda_graphs (default: on CUDA) captures
        every graph at start-up and replays it; pdl (default: on with the triton backend on CUDA) launches the
        chains the `pdl` pass annotated with programmatic dependent launch; greedy_graphs: a request runs the
        specialised copies of the step graphs that fit it where the artifact has them (same tokens, fewer launches):
        specialize_greedy's for temperature 0, specialize_sampling's plain / nucleus copies for a sampled request
        with top-k off (and top-p off); False: always the general ones (`graph_set`)."""
        if spec not in ("nextn", "none"):
            raise EngineError(f"spec must be 'nextn' or 'none', got {spec!r}")
        step_graphs = NEXTN_GRAPHS if spec == "nextn" else ("step",)
        need = ("prefill", "decode") + step_graphs + (("mtp_prefill", "mtp_decode") if spec == "nextn" else ())
        missing = [g for g in need if g not in program.graphs]
        if missing:
            hint = " (compile with the partition pass, e.g. --passes all)" if "verify" in missing else ""
            raise EngineError(f"the artifact lacks program(s) {missing} needed for --spec {spec}{hint}")
        if simulate_accept_len and (spec != "nextn" or not 1 <= simulate_accept_len <= program.options["draft_tokens"]):
            raise EngineError(f"--simulate-accept-len needs --spec nextn and a value in [1, draft_tokens], "
                              f"got {simulate_accept_len}")
        self.program, self.spec, self.simulate = program, spec, float(simulate_accept_len)
        self.graph_sets = {"general": step_graphs}
        for name, suffix in (("greedy", GREEDY_SUFFIX), ("plain", PLAIN_SUFFIX), ("nucleus", NUCLEUS_SUFFIX)):
            copies = tuple(g + suffix for g in step_graphs)
            if greedy_graphs and all(g in program.graphs for g in copies):
                self.graph_sets[name] = copies
                need += copies
        self.step_graphs = step_graphs                  # the set the current request runs (set in _open)
        device = torch.device(device)
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "reference"
        if cuda_graphs and device.type != "cuda":
            raise EngineError(f"CUDA graphs need a CUDA device, got {device}")
        self.exe = Executor(program, device, backend, pdl=(backend == "triton" and device.type == "cuda")
                            if pdl is None else pdl)
        self.graphs = None
        if cuda_graphs or (cuda_graphs is None and device.type == "cuda"):
            from lingc.runtime.graphs import CudaGraphs
            self.graphs = CudaGraphs(self.exe)
            self.graphs.capture(g for g in need if g in program.graphs)
        self.opt = program.options
        self.relay = {k[len("relay_"):]: v for k, v in self.exe.buffers.tensors.items() if k.startswith("relay_")}
        page_table = self.exe.buffers.tensors["page_table"]
        self.pages = PageAllocator(page_table,
                                   self.opt["request_slots"] * self.opt["max_len"] // self.opt["page_size"] + 1,
                                   self.opt["page_size"])
        self.free_slots = list(range(self.opt["request_slots"]))
        self.slots = self.exe.buffers.tensors["slots"]
        self.late = LateCopy(self.relay["out_tokens"], self.relay["out_len"])
        self.eos = set(program.config.eos_token_ids)

    # ---- request set-up (not the step path) ----------------------------------------------
    def _check(self, req: Request) -> None:
        V, max_len = self.program.config.vocab_size, self.opt["max_len"]
        if not req.prompt:
            raise EngineError("the prompt is empty")
        not_int = [t for t in req.prompt if not _is_int(t)]
        if not_int:                                       # a float id would be truncated silently on the way in
            raise EngineError(f"prompt token ids must be integers, got {not_int[:5]}")
        bad = [t for t in req.prompt if not 0 <= t < V]
        if bad:
            raise EngineError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
        if not _is_int(req.max_new_tokens) or req.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1 and an integer, got {req.max_new_tokens}")
        room = max_len - 2 * self.opt["draft_tokens"]
        if len(req.prompt) + req.max_new_tokens > room:
            raise EngineError(f"prompt ({len(req.prompt)}) + max_new_tokens ({req.max_new_tokens}) exceeds the "
                              f"artifact's context {room} (max_len {max_len} minus 2 x draft_tokens); recompile "
                              "with a larger --max-len")
        req.sampling.check()

    def graph_set(self, s: SamplingParams) -> str:
        """The step graph set a request runs: the most specialised one the engine has that fits its sampling
        ("greedy": temperature 0; "plain": top-k and top-p off; "nucleus": top-k off; else "general"). Top-k is
        off at 0 or at the vocabulary size and above (kernels/filtered_probs.py), top-p at 1."""
        if s.temperature <= 0:
            name = "greedy"
        elif s.top_k == 0 or s.top_k >= self.program.config.vocab_size:
            name = "plain" if s.top_p >= 1 else "nucleus"
        else:
            name = "general"
        return name if name in self.graph_sets else "general"

    def _open(self, slot: int, req: Request) -> None:
        for key, pool in self.exe.buffers.tensors.items():
            if key.startswith("state_") and not key.endswith("kv_pages"):
                pool[slot].zero_()                        # KDA state starts from zero; old pages are masked
        s = req.sampling
        self.step_graphs = self.graph_sets[self.graph_set(s)]
        values = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed,
                  "rng_counter": 0, "simulate_accept": self.simulate, "seq_len": 0, "out_len": 0}
        for name, v in values.items():
            if name in self.relay:
                self.relay[name][slot] = v
        self.slots.fill_(slot)

    def _host_fed(self, graph: str, **inputs: torch.Tensor) -> tuple:
        for name, value in inputs.items():
            self.exe.input(graph, name).copy_(value)
        return self._launch(graph)

    def _launch(self, graph: str):
        return self.graphs.run(graph) if self.graphs is not None else self.exe.run(graph)

    def _prefill(self, slot: int, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Target over the prompt; returns (last logits [1, 1, V], hidden [1, L, h])."""
        chunk, device = self.opt["prefill_tokens"], self.exe.device
        ids = torch.tensor([prompt], device=device)
        hidden, pos, logits = [], 0, None
        while pos < len(prompt):
            n = chunk if len(prompt) - pos >= chunk else 1
            graph = "prefill" if n == chunk else "decode"
            logits, h = self._host_fed(graph, input_ids=ids[:, pos:pos + n],
                                       positions=torch.arange(pos, pos + n, device=device).view(1, n))
            hidden.append(h.clone())
            pos += n
        return logits[:, -1:].clone(), torch.cat(hidden, dim=1)

    def _sample(self, slot: int, logits: torch.Tensor, counter: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.slots
        r = self.relay
        probs = ops.filtered_probs(logits, r["temperature"][idx], r["top_k"][idx], r["top_p"][idx])
        u = ops.uniform(r["seed"][idx], r["rng_counter"][idx] + counter, 1)
        return ops.sample_tokens(probs, u), probs                                 # [1, 1], [1, 1, V]

    def _first_token(self, slot: int, prompt: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        token, _ = self._sample(slot, logits, 0)
        r = self.relay
        r["root"][slot] = token.view(())
        r["seq_len"][slot] = len(prompt)
        r["out_tokens"][slot, 0] = token.view(())
        r["out_len"][slot] = 1
        if self.spec == "nextn":
            self._mtp_prefill(slot, prompt, token, hidden)
        r["rng_counter"][slot] += 2

    def _mtp_prefill(self, slot: int, prompt: list[int], first: torch.Tensor, hidden: torch.Tensor) -> None:
        """MTP over the prompt: fills its cache and proposes d1 from the last position."""
        chunk, device, L = self.opt["prefill_tokens"], self.exe.device, len(prompt)
        next_ids = torch.cat([torch.tensor([prompt[1:]], device=device, dtype=torch.int64), first.view(1, 1)], dim=1)
        pos, logits, z = 0, None, None
        while pos < L:
            n = chunk if L - pos >= chunk else 1
            graph = "mtp_prefill" if n == chunk else "mtp_decode"
            logits, z = self._host_fed(graph, next_ids=next_ids[:, pos:pos + n], hidden=hidden[:, pos:pos + n],
                                       positions=torch.arange(pos, pos + n, device=device).view(1, n))
            pos += n
        d1, probs = self._sample(slot, logits[:, -1:], 1)
        self.relay["draft_first"][slot] = d1.view(())
        self.relay["draft_first_probs"][slot] = probs.view(-1)
        self.relay["mtp_hidden"][slot] = z[0, -1]

    # ---- the step path -------------------------------------------------------------------
    def _enqueue_step(self) -> None:
        for graph in self.step_graphs:
            self._launch(graph)

    def generate(self, req: Request, on_tokens=None) -> Result:
        """Run one request to completion; `on_tokens(list)` is called with each step's new tokens."""
        self._check(req)
        if not self.free_slots:
            raise EngineError("no free request slot")
        slot = self.free_slots.pop(0)
        t0 = time.perf_counter()
        try:
            return self._run(slot, req, t0, on_tokens)
        finally:
            self.pages.release(slot)
            self.free_slots.insert(0, slot)

    def _run(self, slot: int, req: Request, t0: float, on_tokens) -> Result:
        K1 = self.opt["draft_tokens"] if self.spec == "nextn" else 1
        self._open(slot, req)
        L = len(req.prompt)
        self.pages.ensure(slot, L + 2 * self.opt["draft_tokens"])
        logits, hidden = self._prefill(slot, req.prompt)
        self._first_token(slot, req.prompt, logits, hidden)
        self.late.start(0)
        stops = set(req.stop_token_ids) | (set() if req.ignore_eos else self.eos)
        out: list[int] = []
        accept_lens: list[int] = []
        finish = self._take(self.late.consume(0, slot), out, req, stops, on_tokens)   # the first token (TTFT)
        ttft = time.perf_counter() - t0
        k, enqueued = 1, 0                        # k: the next step whose copy to consume
        while finish is None:
            # enqueue step k + 1 before reading step k's tokens: the host stays a step ahead. Stop once the
            # steps in flight (enqueued, not yet consumed; each emits >= 1 token) cover max_new_tokens.
            while enqueued <= k and len(out) + (enqueued - k + 1) < req.max_new_tokens:
                self.pages.ensure(slot, L + (enqueued + 2) * K1 + 2 * self.opt["draft_tokens"])
                self._enqueue_step()
                enqueued += 1
                self.late.start(enqueued)
            if k > enqueued:
                break
            new = self.late.consume(k, slot)
            k += 1
            accept_lens.append(len(new))
            finish = self._take(new, out, req, stops, on_tokens)
        return Result(out, finish or "length", accept_lens, len(accept_lens), ttft,
                      time.perf_counter() - t0, self.spec, self.simulate or None, self.step_graphs)

    @staticmethod
    def _take(new: list[int], out: list[int], req: Request, stops: set[int], on_tokens) -> str | None:
        """Append a step's tokens, trimmed at a stop token or max_new_tokens; returns the finish reason."""
        kept, finish = [], None
        for t in new:
            if t in stops:
                finish = "stop"
                break
            kept.append(t)
            if len(out) + len(kept) == req.max_new_tokens:
                finish = "length"
                break
        out.extend(kept)
        if on_tokens is not None and kept and on_tokens(kept) is False:
            finish = "abort"
        return finish
