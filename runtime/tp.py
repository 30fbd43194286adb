"""Tensor-parallel runtime: one process per rank, rank 0 in the caller's process driving the others.

`open_tp_session(artifact, tp)` starts ranks 1..N-1 (torch.multiprocessing spawn), joins a process group
with them (gloo on CPU, NCCL on GPU; one TCPStore, hosted by rank 0, serves the rendezvous and the control
channel), builds rank 0's engine and returns a Session (runtime/session.py) whose `engine.generate(req,
on_tokens)` works as on one device. Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set) it
starts nothing: rank 0 returns the session and every other rank serves as a worker until rank 0 closes
the session, then exits the process.

Every rank runs the same Engine over its own weights (the tp pass made the graphs identical), so the
workers replay rank 0's graph sequence exactly. Rank 0 tells them only what the host feeds, one control
message per host action, at the points where its engine touches device state:

    ["open", slot, sampling]      request set-up (KDA state zeroed, sampling relays written)
    ["ensure", slot, tokens]      page-table growth (only when it allocates), sent with the next message
    ["prefill", slot, prompt]     the prompt chunks (the worker runs the same prefill graphs)
    ["first_token", slot, prompt] first token sampled on the device (from all-gathered logits: the same on
                                  every rank) and, for NEXTN, the MTP prefill
    ["step"]                      one decode step (draft/verify/extend or `step`); none are sent after the
                                  request stops, which is the stop signal
    ["release", slot]             the request's pages, sent with the next message
    ["shutdown"]

A decode step costs one control message (a TCPStore set on rank 0, a wait + get on each worker: ~0.1 ms on
CPU, host to host, no device read). Values (tokens, logits) never travel on the control channel: the
collectives inside the graphs keep the ranks' data in step.

Failure: the process group has a timeout (`timeout_s`); a watchdog thread on rank 0 polls the worker
processes, and when one dies it ends the others, so a collective rank 0 is blocked in fails at once
instead of waiting for the timeout; the session then raises TPError naming the rank, its exit code and,
if it raised, its traceback (workers post it to the store). A broken session refuses further requests.
On NCCL a collective does not fail when its peer dies (its kernel waits on the GPU, inside a CUDA graph too),
so rank 0 would sit until the process-group timeout: there the watchdog gives rank 0's thread `hard_exit_s`
(default 10 s on CUDA, off on CPU) to notice; if it has not raised the TPError by then, the watchdog prints
the error to stderr and ends the process with exit code 1 (`lingc serve --tp` and `lingc generate` stop
with the error instead of hanging).
`close()` is explicit and bounded: shutdown message, join with a timeout, then terminate / kill.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lingc.artifact import ArtifactError, load_artifact, read_manifest
from lingc.runtime.engine import Engine, EngineError, Request, SamplingParams
from lingc.runtime.session import TOKENIZER_FILE, Session

DEFAULT_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 300.0         # spawn + import + artifact load, per worker
HARD_EXIT_S = 10.0                # CUDA: how long rank 0 may stay blocked after a rank died (module docstring)
KEY_WINDOW = 64                   # control keys kept in the store (a worker is never more than a few behind)
_WAIT_FOREVER = datetime.timedelta(days=365)
_ACTIVE: list["TPRuntime"] = []   # at most one per process: torch.distributed has one default group
# NVLink SHARP / multicast off: the H200 machines require it (shared/docs/kernels.md section 7b); every process
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class TPError(EngineError):
    """A TP rank died, failed or timed out; the message names the rank and what happened."""

    fatal = True           # the TP session is over: `lingc serve` stops with this message (exit code 1)


# ---- process group and control channel ------------------------------------------------------------------
def _device_for(device: str, local_rank: int) -> str:
    if device.startswith("cuda"):
        return f"cuda:{local_rank}"
    return device


def nccl_environment() -> None:
    """Set NCCL_ENV in this process (and so in the ranks it spawns afterwards), overriding any other value."""
    os.environ.update(NCCL_ENV)


def _init_group(store: Any, rank: int, world: int, device: str, timeout_s: float) -> None:
    """Join the process group: NCCL on this rank's GPU (made the current device first), gloo on CPU."""
    import torch.distributed as dist

    from lingc.ops.dist import set_group
    if device.startswith("cuda"):
        nccl_environment()                                  # before the communicator exists: NCCL reads it then
        torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), device_id=torch.device(device))
        from lingc.kernels import allreduce
        allreduce.enable()                                  # one-shot all-reduce over NVLink
                                                            # (LINGC_ALL_REDUCE=nccl: off)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    set_group(None)


class _Control:
    """Rank 0 -> workers messages over the store: key cmd/<seq> holds a JSON list of commands."""

    def __init__(self, store: Any):
        import torch.distributed as dist
        self.store = dist.PrefixStore("lingc_tp/", store)
        self.seq = 0

    def send(self, commands: list[list]) -> None:
        self.seq += 1
        self.store.set(f"cmd/{self.seq}", json.dumps(commands))
        if self.seq > KEY_WINDOW:
            self.store.delete_key(f"cmd/{self.seq - KEY_WINDOW}")

    def recv(self) -> list[list]:
        self.seq += 1
        key = f"cmd/{self.seq}"
        self.store.wait([key], _WAIT_FOREVER)      # rank 0 gone -> the store's connection fails at once
        return json.loads(self.store.get(key))

    def flag(self, name: str, value: str = "1") -> None:
        self.store.set(name, value)

    def read_flag(self, name: str) -> str | None:
        try:
            return self.store.get(name).decode() if self.store.check([name]) else None
        except Exception:  # the store is gone: nothing to read
            return None


# ---- workers ---------------------------------------------------------------------------------------------
def _build_engine(artifact: str, rank: int, device: str, spec: str, engine_kw: dict) -> Engine:
    art = load_artifact(artifact, device=device, rank=rank)
    return Engine(art.program, device, spec, **engine_kw)


def _serve(engine: Engine, ctl: _Control) -> None:
    """Replay rank 0's host actions on this rank's engine until shutdown."""
    held: dict[int, tuple] = {}
    while True:
        for cmd in ctl.recv():
            op, args = cmd[0], cmd[1:]
            if op == "step":
                engine._enqueue_step()
            elif op == "ensure":
                engine.pages.ensure(*args)
            elif op == "open":
                slot, sampling = args
                engine._open(slot, Request([0], 1, SamplingParams(**sampling)))
            elif op == "prefill":
                slot, prompt = args
                held[slot] = engine._prefill(slot, prompt)
            elif op == "first_token":
                slot, prompt = args
                engine._first_token(slot, prompt, *held.pop(slot))
            elif op == "release":
                engine.pages.release(*args)
            elif op == "shutdown":
                return
            else:
                raise TPError(f"unknown control command {op!r}")


def _worker_main(rank: int, world: int, addr: str, port: int, artifact: str, device: str, spec: str,
                 engine_kw: dict, timeout_s: float, threads: int, local_rank: int | None = None,
                 run: dict | None = None) -> None:
    """A spawned (or torchrun) worker: join, load this rank's weights, serve; report any failure to rank 0.
    Never returns: the process exits (code 0 after a shutdown message, 1 after an error)."""
    import torch.distributed as dist
    ctl = None
    code = 0
    try:
        torch.set_num_threads(threads)
        store = _torchrun_store(run, world) if run is not None else \
            dist.TCPStore(addr, port, world, is_master=False, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        ctl = _Control(store)
        ctl.flag(f"up/{rank}")
        dev = _device_for(device, rank if local_rank is None else local_rank)
        _init_group(store, rank, world, dev, timeout_s)
        engine = _build_engine(artifact, rank, dev, spec, engine_kw)
        ctl.flag(f"ready/{rank}")
        _serve(engine, ctl)
    except BaseException as e:  # noqa: BLE001  report, then exit; rank 0 turns it into a TPError
        code = 1
        if ctl is not None and not isinstance(e, KeyboardInterrupt):
            try:
                ctl.flag(f"error/{rank}", "".join(traceback.format_exception(e))[-4000:])
            except Exception:  # noqa: BLE001  the store is gone too (rank 0 died)
                pass
    finally:
        os._exit(code)      # bounded: no process-group teardown (it can hang); the sockets close with us


# ---- rank 0 ----------------------------------------------------------------------------------------------
class TPRuntime:
    """Rank 0's side: the store, the worker processes, the watchdog, the control channel, the failure state."""

    def __init__(self, world: int, device: str, timeout_s: float, hard_exit_s: float | None = None):
        self.world, self.device, self.timeout_s, self.hard_exit_s = world, device, timeout_s, hard_exit_s
        self.store: Any = None
        self.ctl: _Control | None = None
        self.procs: dict[int, Any] = {}            # rank -> spawned process (empty under torchrun)
        self.dead: dict[int, int] = {}              # rank -> exit code, filled by the watchdog
        self.broken: str | None = None
        self.pending: list[list] = []
        self.closed = False
        self._stop = threading.Event()
        self._noticed = threading.Event()          # rank 0's thread has raised the failure
        self._watchdog: threading.Thread | None = None
        self._lock = threading.Lock()

    # control
    def post(self, cmd: list) -> None:
        """Queue a command; it goes out with the next `send` (keeps a decode step to one message)."""
        self.pending.append(cmd)

    def send(self, cmd: list) -> None:
        self.check()
        msg, self.pending = self.pending + [cmd], []
        self.ctl.send(msg)

    # health
    def check(self) -> None:
        if self.closed:
            raise TPError("the TP session is closed")
        if self.broken is None and self.dead:
            self.broken = self._describe_dead()
        if self.broken is not None:
            self._noticed.set()
            raise TPError(self.broken)

    def _describe_dead(self) -> str:
        """Which rank died first (a signal before an exit code, then the lowest rank) and how."""
        order = sorted(self.dead, key=lambda r: (self.dead[r] >= 0, r))
        first, code = order[0], self.dead[order[0]]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        msg = f"TP rank {first} (pid {self.procs[first].pid}) {how}"
        err = self.ctl.read_flag(f"error/{first}") if self.ctl is not None else None
        if err:
            msg += "; it raised:\n" + "\n".join(err.strip().splitlines()[-20:])
        elif code == 1:
            msg += (" before it could report why (a script that opens a TP session must guard that code with "
                    "`if __name__ == '__main__':`, since the ranks are spawned)")
        if order[1:]:
            msg += f"; rank(s) {order[1:]} stopped with it"
        return msg + "; the TP session is stopped (open a new one)"

    def failure(self, exc: BaseException) -> TPError:
        """The TPError for an exception out of rank 0's engine (a collective failed or timed out)."""
        deadline = time.monotonic() + 3.0                 # let the watchdog see an exit that caused this
        while not self.dead and self.procs and time.monotonic() < deadline:
            time.sleep(0.05)
        errors = {r: self.ctl.read_flag(f"error/{r}") for r in range(1, self.world)} if self.ctl else {}
        if self.dead:
            self.broken = self._describe_dead()
        elif any(errors.values()):
            self.broken = "; ".join(f"TP rank {r} failed:\n{e.strip()}" for r, e in errors.items() if e)
        else:
            self.broken = (f"a collective on rank 0 failed ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); "
                           f"a TP rank is gone or stuck (process-group timeout {self.timeout_s:g} s)")
        self._kill_all()
        self._noticed.set()
        return TPError(self.broken)

    def start_watchdog(self) -> None:
        def watch() -> None:
            while not self._stop.wait(0.1):
                for rank, p in self.procs.items():
                    if rank not in self.dead and p.exitcode is not None and not self.closed:
                        self.dead[rank] = p.exitcode
                if self.dead and not self.closed:
                    self._kill_all()               # the session is over: unblock any collective at once
                    if self.hard_exit_s is not None and not self._noticed.wait(self.hard_exit_s) \
                            and not self.closed:
                        self._hard_exit()
                    return
        self._watchdog = threading.Thread(target=watch, name="lingc-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _hard_exit(self) -> None:
        """Rank 0 is still blocked (an NCCL collective whose peer is gone never returns): say why and exit."""
        msg = self._describe_dead().replace("; the TP session is stopped (open a new one)", "")
        sys.stderr.write(f"lingc: {msg}; rank 0 is blocked in a collective that cannot finish, so this process "
                         f"exits now (exit code 1)\n")
        sys.stderr.flush()
        os._exit(1)

    def _kill_all(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()

    def close(self, timeout_s: float = 10.0) -> None:
        """Shut the workers down (bounded) and leave the process group."""
        if self.closed:
            return
        try:
            if self.ctl is not None and self.broken is None and not self.dead:
                self.ctl.send(self.pending + [["shutdown"]])
        except Exception:  # noqa: BLE001  a dead store: the workers are gone anyway
            pass
        self.closed = True
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
                p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)
        _leave_group(timeout_s=5.0)
        self.store = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)


def _leave_group(timeout_s: float) -> None:
    """destroy_process_group, bounded (teardown can hang when a peer is gone: kernels.md section 7b)."""
    import torch.distributed as dist

    from lingc.ops.dist import set_group
    set_group(None)
    if not dist.is_initialized():
        return
    t = threading.Thread(target=dist.destroy_process_group, daemon=True)
    t.start()
    t.join(timeout_s)


class _MirroredPages:
    """rank 0's PageAllocator; allocations and releases are posted to the workers (same calls, same pages)."""

    def __init__(self, pages: Any, rt: TPRuntime):
        self._pages, self._rt = pages, rt

    def ensure(self, slot: int, tokens: int) -> None:
        before = len(self._pages.owned.get(slot, []))
        self._pages.ensure(slot, tokens)
        if len(self._pages.owned.get(slot, [])) != before:
            self._rt.post(["ensure", slot, tokens])

    def release(self, slot: int) -> None:
        self._pages.release(slot)
        self._rt.post(["release", slot])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pages, name)


class TPEngine(Engine):
    """Rank 0's engine: an Engine whose host actions are mirrored to the workers (module docstring)."""

    def __init__(self, program: Any, device: str, spec: str, runtime: TPRuntime, **kw: Any):
        super().__init__(program, device, spec, **kw)
        self.tp = runtime
        self.pages = _MirroredPages(self.pages, runtime)

    def _open(self, slot: int, req: Request) -> None:
        self.tp.post(["open", slot, asdict(req.sampling)])
        super()._open(slot, req)

    def _prefill(self, slot: int, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        self.tp.send(["prefill", slot, [int(t) for t in prompt]])
        return super()._prefill(slot, prompt)

    def _first_token(self, slot: int, prompt: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self.tp.send(["first_token", slot, [int(t) for t in prompt]])
        super()._first_token(slot, prompt, logits, hidden)

    def _enqueue_step(self) -> None:
        self.tp.send(["step"])
        super()._enqueue_step()

    def generate(self, req: Request, on_tokens=None):
        with self.tp._lock:                         # one request at a time drives the workers
            self.tp.check()
            try:
                result = super().generate(req, on_tokens)
                from lingc.kernels import allreduce
                if allreduce.timeouts():               # a host read after the request, never on the step path
                    raise self.tp.failure(RuntimeError("the one-shot all-reduce gave up waiting for a peer rank "
                                                       "(its sums are wrong from there on)"))
                return result
            except TPError:
                raise
            except EngineError:
                if self.tp.dead:
                    raise self.tp.failure(RuntimeError("a TP rank died")) from None
                raise
            except RuntimeError as e:
                import torch.distributed as dist
                text = str(e).lower()
                if self.tp.dead or isinstance(e, dist.DistError) or "gloo" in text or "nccl" in text:
                    raise self.tp.failure(e) from e    # a collective failed (a peer is gone) or timed out
                raise                                  # rank 0's own error (e.g. out of cache pages)


@dataclass
class TPSession(Session):
    """A Session over N ranks (rank 0 here); close() (or a with block) shuts the workers down."""

    tp: int = 1
    runtime: TPRuntime | None = None

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()

    def __enter__(self) -> "TPSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _torchrun_store(run: dict[str, Any], world: int) -> Any:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT: torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE),
    otherwise rank 0 does (ranks started by hand with the env vars set)."""
    import torch.distributed as dist
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(run["addr"], run["port"], world, is_master=run["rank"] == 0 and not agent,
                         timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)


def _torchrun_env() -> dict[str, Any] | None:
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return {"rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"]), "addr": env["MASTER_ADDR"],
            "port": int(env["MASTER_PORT"]), "local_rank": int(env.get("LOCAL_RANK", env["RANK"]))}


def open_tp_session(artifact: str | Path, tp: int | None = None, device: str = "cpu", spec: str = "nextn", *,
                    timeout_s: float = DEFAULT_TIMEOUT_S, threads_per_rank: int | None = None,
                    simulate_accept_len: float = 0.0, backend: str = "auto", cuda_graphs: bool | None = None,
                    pdl: bool | None = None, greedy_graphs: bool = True, hard_exit_s: float | None = -1.0) -> TPSession:
    """Open a TP artifact on its N ranks (module docstring); `tp` defaults to the artifact's. `hard_exit_s`:
    seconds rank 0 may stay blocked after a rank died before the process exits (default: 10 on CUDA, where
    NCCL collectives never fail on a dead peer; None on CPU, where gloo's do)."""
    import torch.distributed as dist
    artifact = str(artifact)
    manifest = read_manifest(artifact, check_hashes=False).manifest
    world = int(manifest.get("tp", 1))
    if tp is not None and tp != world:
        raise EngineError(f"{artifact} was compiled for --tp {world}, not {tp}; recompile with `lingc compile "
                          f"--tp {tp}` or open it with tp={world}")
    if world < 2:
        raise EngineError(f"{artifact} is not a tensor-parallel artifact (tp 1); use runtime.session.open_session")
    if _ACTIVE or dist.is_initialized():
        raise EngineError("a torch.distributed process group is already running in this process (another TP "
                          "session?); close it first")
    if device.startswith("cuda") and torch.cuda.device_count() < world and _torchrun_env() is None:
        raise EngineError(f"{artifact} has {world} TP ranks, one per GPU, but torch sees "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    engine_kw = {"simulate_accept_len": simulate_accept_len, "backend": backend, "cuda_graphs": cuda_graphs, "pdl": pdl,
                 "greedy_graphs": greedy_graphs}
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world)
    run = _torchrun_env()
    if run is not None and run["world"] != world:
        raise EngineError(f"torchrun started {run['world']} ranks but {artifact} has {world}")
    if run is not None and run["rank"] != 0:
        _worker_main(run["rank"], world, run["addr"], run["port"], artifact, device, spec, engine_kw, timeout_s,
                     torch.get_num_threads(), run["local_rank"], run)   # never returns (exits the process)
    if device.startswith("cuda"):
        nccl_environment()                          # before spawning: the workers inherit it
    if hard_exit_s is not None and hard_exit_s < 0:
        hard_exit_s = HARD_EXIT_S if device.startswith("cuda") else None
    rt = TPRuntime(world, device, timeout_s, hard_exit_s)
    _ACTIVE.append(rt)
    try:
        if run is None:
            rt.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                                     timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)
            rt.ctl = _Control(rt.store)
            ctx = torch.multiprocessing.get_context("spawn")
            for r in range(1, world):
                p = ctx.Process(target=_worker_main, name=f"lingc-tp-rank{r}", daemon=True,
                                args=(r, world, "127.0.0.1", rt.store.port, artifact, device, spec, engine_kw,
                                      timeout_s, threads))
                p.start()
                rt.procs[r] = p
            rt.start_watchdog()
            _wait_flags(rt, "up", STARTUP_TIMEOUT_S)
            dev = _device_for(device, 0)
        else:
            rt.store = _torchrun_store(run, world)
            rt.ctl = _Control(rt.store)
            dev = _device_for(device, run["local_rank"])
        _init_group(rt.store, 0, world, dev, timeout_s)
        art = load_artifact(artifact, device=dev, rank=0)
        engine = TPEngine(art.program, dev, spec, rt, **engine_kw)
        _wait_flags(rt, "ready", STARTUP_TIMEOUT_S)
    except BaseException as e:
        failed = rt.broken or (rt._describe_dead() if rt.dead else None)
        rt.close(timeout_s=5.0)
        if failed and not isinstance(e, KeyboardInterrupt):
            raise TPError(f"starting {world} TP ranks failed: {failed}") from None
        raise
    atexit.register(rt.close)
    tokenizer = None
    tok_file = Path(artifact) / TOKENIZER_FILE
    if tok_file.exists():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(tok_file))
    return TPSession(Path(artifact), engine, tokenizer, tp=world, runtime=rt)


def _wait_flags(rt: TPRuntime, name: str, timeout_s: float) -> None:
    """Wait until every worker has set flag `name`, failing fast when one dies or reports an error."""
    deadline = time.monotonic() + timeout_s
    waiting = set(range(1, rt.world))
    while waiting:
        waiting = {r for r in waiting if rt.ctl.read_flag(f"{name}/{r}") is None}
        for r in range(1, rt.world):
            err = rt.ctl.read_flag(f"error/{r}")
            if err:
                rt.broken = f"TP rank {r} failed while starting:\n{err.strip()}"
                raise TPError(rt.broken)
        if rt.dead:
            rt.broken = rt._describe_dead()
            raise TPError(rt.broken)
        if waiting and time.monotonic() > deadline:
            rt.broken = f"TP ranks {sorted(waiting)} did not start within {timeout_s:g} s"
            raise TPError(rt.broken)
        if waiting:
            time.sleep(0.02)


def open_any_session(artifact: str | Path, spec: str = "nextn", device: str = "cpu", **kw: Any) -> Session:
    """open_session for a tp = 1 artifact, open_tp_session (which starts the ranks) for a TP one."""
    from lingc.runtime.session import open_session
    try:
        world = int(read_manifest(artifact, check_hashes=False).manifest.get("tp", 1))
    except (ArtifactError, ValueError, TypeError):
        world = 1                                  # let open_session report what is wrong
    if world > 1:
        return open_tp_session(artifact, world, device, spec, **kw)
    return open_session(artifact, spec=spec, device=device, **kw)
