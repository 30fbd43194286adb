"""Executor: lower each graph of a Program to a launch list and run it over persistent buffers.

Lowering resolves every node once to (implementation, argument slots): lingc ops to their kernel
(`kernel_for`, today the reference op; Triton kernels and CUDA-graph capture come with the GPU issue),
aten view ops to themselves. Running walks the list; nothing is looked up, allocated by the host or
read back on the way. Inputs are persistent buffers (`Buffers`): state pools, relay buffers, staging,
slots and page table are shared by every graph by name; host-fed inputs (input_ids, positions, ...)
get one buffer per graph. The same code runs eagerly on CPU and is what the GPU path captures.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from lingc.program import Program, TensorMeta

SHARED_ROLES = ("state:", "relay:", "staging:", "slots", "page_table")


def is_shared(role: str) -> bool:
    return role.startswith(SHARED_ROLES)


def kernel_for(target: Any) -> Callable:
    """The implementation a node runs: its reference op for now (the op itself, dispatched by torch)."""
    return target


@dataclass
class Launch:
    fn: Callable
    args: tuple           # with _Ref placeholders for values
    kwargs: dict
    out: int              # env index of the result


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


def lower(program: Program, name: str) -> Lowered:
    """The launch list of graph `name`."""
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
            launches.append(Launch(kernel_for(node.target), fx.node.map_arg(node.args, ref),
                                   fx.node.map_arg(node.kwargs, ref), index[node]))
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


class Executor:
    """Runs a Program's graphs by name over its Buffers, on one device."""

    def __init__(self, program: Program, device: str | torch.device = "cpu"):
        self.program, self.device = program, torch.device(device)
        self.weights = {k: v.to(self.device) for k, v in program.weights.items()}
        self.buffers = Buffers.allocate(program, self.device)
        self.lowered = {name: lower(program, name) for name in program.graphs}

    def input(self, graph: str, name: str) -> torch.Tensor:
        """The persistent buffer behind input `name` of `graph` (write host-fed inputs here)."""
        key = name if name in self.buffers.tensors else f"{graph}:{name}"
        return self.buffers.tensors[key]

    @torch.no_grad()
    def run(self, name: str) -> Any:
        """Launch graph `name`; returns its outputs (host-fed programs: logits, hidden; engine steps: None).
        Everything else the graph computes lands in the buffers it writes (pools, relays)."""
        low = self.lowered[name]
        env: list[Any] = [None] * low.size
        for i, key in low.inputs:
            env[i] = self.buffers.tensors[key]
        for i, w in low.weights:
            env[i] = self.weights[w]
        for launch in low.launches:
            env[launch.out] = launch.fn(*_resolve(launch.args, env), **_resolve(launch.kwargs, env))
        return _resolve(low.output, env)
