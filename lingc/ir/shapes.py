"""Shape inference: recompute every node's `lingc.tensor` meta by running the graph on fake tensors.

Passes that add nodes call this (the PassManager does after every pass), so meta never goes stale.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from lingc.program import Program, TensorMeta


def meta_of(value: object) -> TensorMeta | list | None:
    """TensorMeta of a (fake) tensor, a list of them for a tuple, None otherwise."""
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return [meta_of(v) for v in value]
    return None


def propagate(program: Program) -> None:
    """Set lingc.tensor on every node of every graph of `program` (in place)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_weights: dict[str, torch.Tensor] = {}
    device = next(iter(program.weights.values())).device if program.weights else torch.device("cpu")
    with mode:
        for graph in program.graphs.values():
            env: dict[fx.Node, object] = {}
            for node in graph.nodes:
                if node.op == "placeholder":
                    m: TensorMeta = node.meta["lingc.tensor"]
                    env[node] = torch.empty(m.shape, dtype=m.dtype, device=device)   # inputs live with the weights
                elif node.op == "get_attr":
                    if node.target not in fake_weights:
                        fake_weights[node.target] = mode.from_tensor(program.weights[node.target])
                    env[node] = fake_weights[node.target]
                elif node.op == "call_function":
                    args = fx.node.map_arg(node.args, lambda n: env[n])
                    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                    env[node] = node.target(*args, **kwargs) if node.target is not operator.getitem \
                        else operator.getitem(*args)
                else:
                    continue
                node.meta["lingc.tensor"] = meta_of(env[node])
