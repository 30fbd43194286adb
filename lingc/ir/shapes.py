"""Shape inference: recompute every node's `lingc.tensor` meta by running the graph on fake tensors.

Passes that add nodes call this (the PassManager does after every pass), so meta never goes stale.

Memo: an op's output meta is a function of its target and its arguments' metas and constants (fake tensors carry
no values), so `propagate` remembers (target, argument metas, constants) -> output meta across calls and graphs.
A compile re-propagates a dozen times over graphs whose layers repeat the same ops, so nearly every node hits;
only a miss runs the op on fake tensors (its inputs: the real fake values where this call computed them, else
fresh contiguous fakes of the remembered metas). Arguments that cannot be hashed, or outputs that are not
tensors / tuples of tensors, are never memoised.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from lingc.program import Program, TensorMeta

_MEMO: dict[tuple, TensorMeta | list] = {}
_MEMO_LIMIT = 200_000
_MISS = object()


def meta_of(value: object) -> TensorMeta | list | None:
    """TensorMeta of a (fake) tensor, a list of them for a tuple, None otherwise."""
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return [meta_of(v) for v in value]
    return None


def _memoisable(meta: object) -> bool:
    if isinstance(meta, TensorMeta):
        return True
    return isinstance(meta, list) and bool(meta) and all(isinstance(m, TensorMeta) for m in meta)


def _frozen(meta: TensorMeta | list) -> object:
    return tuple(meta) if isinstance(meta, list) else meta


class _Env:
    """Node -> fake value, where computed; node -> meta always (a memo hit stores only the meta)."""

    def __init__(self, device: torch.device):
        self.device, self.values, self.metas = device, {}, {}

    def key_of(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in self.values and not isinstance(self.values[a], (torch.Tensor, list, tuple)):
                return ("value", self.values[a])
            return ("node", _frozen(self.metas[a]) if isinstance(self.metas[a], list) else self.metas[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(self.key_of(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, self.key_of(v)) for k, v in a.items()))
        return a

    def value(self, n: fx.Node) -> Any:
        if n not in self.values:                          # a memo hit: a fresh fake of the remembered meta
            meta = self.metas[n]
            make = lambda m: torch.empty(m.shape, dtype=m.dtype, device=self.device)   # noqa: E731
            self.values[n] = make(meta) if isinstance(meta, TensorMeta) else tuple(make(m) for m in meta)
        return self.values[n]


def propagate(program: Program) -> None:
    """Set lingc.tensor on every node of every graph of `program` (in place)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_weights: dict[str, torch.Tensor] = {}
    device = next(iter(program.weights.values())).device if program.weights else torch.device("cpu")
    if len(_MEMO) > _MEMO_LIMIT:
        _MEMO.clear()
    with mode:
        for graph in program.graphs.values():
            env = _Env(device)
            for node in graph.nodes:
                if node.op == "placeholder":
                    m: TensorMeta = node.meta["lingc.tensor"]
                    env.values[node] = torch.empty(m.shape, dtype=m.dtype,
                                                   device=device)   # inputs live with the weights
                    env.metas[node] = m
                elif node.op == "get_attr":
                    if node.target not in fake_weights:
                        fake_weights[node.target] = mode.from_tensor(program.weights[node.target])
                    env.values[node] = fake_weights[node.target]
                    env.metas[node] = meta_of(env.values[node])
                elif node.op == "call_function":
                    try:
                        key = (node.target, env.key_of(node.args), env.key_of(node.kwargs))
                        hash(key)
                    except TypeError:                     # an unhashable constant: always run the op
                        key = None
                    meta = _MEMO.get(key, _MISS) if key is not None else _MISS
                    if meta is _MISS:
                        args = fx.node.map_arg(node.args, env.value)
                        kwargs = fx.node.map_arg(node.kwargs, env.value)
                        out = node.target(*args, **kwargs) if node.target is not operator.getitem \
                            else operator.getitem(*args)
                        env.values[node] = out
                        meta = meta_of(out)
                        if key is not None and _memoisable(meta):
                            _MEMO[key] = meta
                    env.metas[node] = meta
                else:
                    continue
                node.meta["lingc.tensor"] = env.metas[node]
