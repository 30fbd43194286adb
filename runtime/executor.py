"""Executor: lower each graph of a Program to a launch list and run it over persistent buffers.

Lowering resolves every node once to (implementation, argument slots): with backend "reference" every
lingc op runs its torch reference; with backend "triton" a lingc op runs its Triton launcher where
lingc.kernels.lowering has one (the rest, and aten view ops, run themselves). Nodes the `pdl` pass annotated
launch with pdl=True when PDL is on; a hint op's kernel (l2_prefetch*) runs on a side stream that forks after the
launches before it and joins at the graph's end, so no launch waits for it. Running walks the list; nothing is
looked up, allocated by the host or read back on the way, so `runtime.graphs` can capture a run as a CUDA graph.
Inputs are persistent buffers (`Buffers`): state pools, relay buffers, staging, slots and page table are shared by
every graph by name; host-fed inputs (input_ids, positions, ...) get one buffer per graph. The same code runs
eagerly on CPU and is what the GPU path captures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from lingc.ops import op_name
from lingc.ops.registry import HINTS
from lingc.program import Program

SHARED_ROLES = ("state:", "relay:", "staging:", "slots", "page_table")


def is_shared(role: str) -> bool:
    return role.startswith(SHARED_ROLES)


BACKENDS = ("reference", "triton")


def kernel_for(target: Any, backend: str = "reference") -> tuple[Callable, str]:
    """(implementation, label) of a node: its Triton launcher under backend "triton" when one exists,
    else the op itself (dispatched by torch: the reference, or aten)."""
    name = op_name(target)
    if backend == "triton" and name.startswith("lingc."):
        from lingc.kernels import lowering
        short = name[len("lingc."):]
        launcher = None if short in lowering.reference_ops() else lowering.kernel_table().get(short)
        if launcher is not None:
            return launcher, f"triton:{name[len('lingc.'):]}"
    return target, name


@dataclass
class Launch:
    fn: Callable
    args: tuple           # with _Ref placeholders for values
    kwargs: dict
    out: int              # env index of the result
    label: str = ""       # "triton:<op>" or the op's name
    side: bool = False    # a hint op's kernel (lingc.ops.registry HINTS): launched on the side stream (Executor.run)


@dataclass(frozen=True)
class _Ref:
    index: int


@dataclass
class Lowered:
    name: str
    inputs: list[tuple[int, str]]         # (env index, buffer key)
    weights: list[tuple[int, str]]        # (env index, weight name)
    launches: list[Launch]
    size: int
    output: Any = None                    # the graph's result, with _Refs


# node.meta["lingc.launch"]: keyword hints a pass leaves for an op's Triton launcher, which the torch reference never
# sees and which never change what the op computes (docs/ir.md). Only these keys and value types are accepted: an
# artifact names data, never arbitrary launcher arguments.
LAUNCH_HINTS = {"moe_up_act": {"shared_last": bool}, "moe_up_act_pairs": {"shared_last": bool},
                # the pdl pass's entry triggers: passes/pdl.py ENTRY_TRIGGER_HINT_OPS
                # (tests/kernels/test_entry_trigger.py keeps the two lists equal; the runtime does not import passes)
                **{op: {"entry_trigger": bool} for op in ("rmsnorm", "add_rmsnorm", "gated_rmsnorm",
                                                          "combine_add_rmsnorm", "mla_attention",
                                                          "embedding_rmsnorm", "mla_prep")},
                # after an entry-triggering mla_prep (passes/pdl.py PREP_ENTRY_TRIGGER): q_absorb reads q after its wait
                "mla_attention": {"entry_trigger": bool, "late_q": bool},
                "linear": {"launched_early": bool}}


def launch_hints(node: fx.Node) -> dict[str, Any]:
    """The node's validated `lingc.launch` hints; a ValueError names the node and the bad key or value."""
    hints = node.meta.get("lingc.launch") or {}
    short = op_name(node.target).removeprefix("lingc.")
    allowed = LAUNCH_HINTS.get(short, {})
    if not isinstance(hints, dict):
        raise ValueError(f"node '{node.name}': lingc.launch must be an object, got {hints!r}")
    for key, value in hints.items():
        if key not in allowed or not isinstance(value, allowed[key]):
            known = ", ".join(f"{k} ({t.__name__})" for k, t in allowed.items()) or "none"
            raise ValueError(f"node '{node.name}' ({short}): launch hint {key}={value!r} is not one lingc knows "
                             f"(known for {short}: {known})")
    return dict(hints)


def lower(program: Program, name: str, backend: str = "reference", pdl: bool = False) -> Lowered:
    """The launch list of graph `name`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    graph = program.graphs[name]
    index: dict[fx.Node, int] = {}
    inputs, weights, launches = [], [], []
    output = None
    for node in graph.nodes:
        if node.op == "output":
            output = fx.node.map_arg(node.args[0], lambda n: _Ref(index[n]))
            continue
        index[node] = len(index)
        if node.op == "placeholder":
            role = node.meta["lingc.input"]
            inputs.append((index[node], node.target if is_shared(role) else f"{name}:{node.target}"))
        elif node.op == "get_attr":
            weights.append((index[node], node.target))
        else:
            ref = lambda n: _Ref(index[n])  # noqa: E731
            fn, label = kernel_for(node.target, backend)
            kwargs = fx.node.map_arg(node.kwargs, ref)
            if pdl and label.startswith("triton:") and "lingc.pdl" in node.meta:
                kwargs = {**kwargs, "pdl": True}
            if label.startswith("triton:") and node.meta.get("lingc.launch"):
                kwargs = {**kwargs, **launch_hints(node)}           # kernel-only hints (docs/ir.md)
            side = label.startswith("triton:") and label.removeprefix("triton:") in HINTS
            if side:                             # off the chain: nothing waits for it, it waits for nothing
                kwargs = {k: v for k, v in kwargs.items() if k != "pdl"}
            launches.append(Launch(fn, fx.node.map_arg(node.args, ref), kwargs, index[node], label, side))
    return Lowered(name, inputs, weights, launches, len(index), output)


def _resolve(a: Any, env: list) -> Any:
    if isinstance(a, _Ref):
        return env[a.index]
    if isinstance(a, (list, tuple)):
        return type(a)(_resolve(x, env) for x in a)
    if isinstance(a, dict):
        return {k: _resolve(v, env) for k, v in a.items()}
    return a


@dataclass
class Buffers:
    """Every input tensor of every graph, allocated once (zeros) from the graphs' input meta."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(cls, program: Program, device: str | torch.device) -> "Buffers":
        out: dict[str, torch.Tensor] = {}
        for gname, graph in program.graphs.items():
            for node in graph.nodes:
                if node.op != "placeholder":
                    continue
                role, meta = node.meta["lingc.input"], node.meta["lingc.tensor"]
                key = node.target if is_shared(role) else f"{gname}:{node.target}"
                if key in out:
                    if tuple(out[key].shape) != meta.shape:
                        raise ValueError(f"input '{key}' has shape {list(meta.shape)} in graph '{gname}' but "
                                         f"{list(out[key].shape)} elsewhere")
                    continue
                out[key] = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
        return cls(out)


def _indexed(device: torch.device) -> torch.device:
    """"cuda" -> "cuda:<current device>": an engine's GPU must be nameable from another thread (the server's
    scheduler binds it with torch.cuda.set_device, which refuses a device without an index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Executor:
    """Runs a Program's graphs by name over its Buffers, on one device."""

    def __init__(self, program: Program, device: str | torch.device = "cpu", backend: str = "reference",
                 pdl: bool = False):
        self.program, self.device, self.backend, self.pdl = program, _indexed(torch.device(device)), backend, pdl
        self.weights = {k: v.to(self.device) for k, v in program.weights.items()}
        self.buffers = Buffers.allocate(program, self.device)
        self.lowered = {name: lower(program, name, backend, pdl) for name in program.graphs}
        # the hint kernels' stream (l2_prefetch, l2_prefetch_experts): the launches after a hint do not wait for it, so
        # a hint that lives until its prefetch lands never holds up the chain; it starts once everything before it is
        # done. Made here, never first inside a CUDA-graph capture
        hints = any(x.side for low in self.lowered.values() for x in low.launches)
        self._side = torch.cuda.Stream(self.device) if hints and self.device.type == "cuda" else None

    def kernel_counts(self, name: str) -> dict[str, int]:
        """How many launches of graph `name` run each implementation ("triton:<op>" or the op name)."""
        counts: dict[str, int] = {}
        for launch in self.lowered[name].launches:
            counts[launch.label] = counts.get(launch.label, 0) + 1
        return counts

    def input(self, graph: str, name: str) -> torch.Tensor:
        """The persistent buffer behind input `name` of `graph` (write host-fed inputs here)."""
        key = name if name in self.buffers.tensors else f"{graph}:{name}"
        return self.buffers.tensors[key]

    @torch.no_grad()
    def run(self, name: str, observe: Callable[[Launch, tuple, dict, Any], None] | None = None) -> Any:
        """Launch graph `name`; returns its outputs (host-fed programs: logits, hidden; engine steps: None).
        Everything else the graph computes lands in the buffers it writes (pools, relays).
        `observe(launch, args, kwargs, result)`, if given, sees every launch (benchmarks count bytes with it)."""
        low = self.lowered[name]
        env: list[Any] = [None] * low.size
        for i, key in low.inputs:
            env[i] = self.buffers.tensors[key]
        for i, w in low.weights:
            env[i] = self.weights[w]
        forked = False
        for launch in low.launches:
            args, kwargs = _resolve(launch.args, env), _resolve(launch.kwargs, env)
            if launch.side and self._side is not None:
                forked = True
                self._side.wait_stream(torch.cuda.current_stream(self.device))     # after everything launched so far
                with torch.cuda.stream(self._side):
                    env[launch.out] = launch.fn(*args, **kwargs)
            else:
                env[launch.out] = launch.fn(*args, **kwargs)
            if observe is not None:
                observe(launch, args, kwargs, env[launch.out])
        if forked:
            torch.cuda.current_stream(self.device).wait_stream(self._side)   # joined at the end (a graph must join)
        return _resolve(low.output, env)
