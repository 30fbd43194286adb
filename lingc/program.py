"""Program: the IR every pass reads and writes: fixed-shape step graphs over one shared set of weights.

A Program holds `graphs` (name -> torch.fx.Graph of torch.ops.lingc.* calls), `weights` (name ->
tensor, referenced by get_attr nodes), `weight_info` (typed per-weight attributes such as the w13
layout) and the trace options. Passes never edit a Program in place: `copy()` gives new graphs and a
new weights dict whose tensors are shared until a pass replaces one (copy on write).

node.meta keys (documented in docs/ir.md):
  lingc.scope   module path that produced the node ("model.layers.3.mlp")
  lingc.tensor  TensorMeta (or list of them) of the node's value(s)
  lingc.input   role of a placeholder: "input_ids", "positions", "hidden", "next_ids", "state:<key>"
  lingc.pdl     PDL annotation {"chain", "index", "length", "early_launch"} (pdl pass)
  lingc.dtype   compute dtype a pass chose for the node (bf16_router)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def short(self) -> str:
        return f"{dtype_short(self.dtype)}[{','.join(map(str, self.shape))}]"

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TensorMeta":
        return cls(tuple(d["shape"]), dtype_from_name(d["dtype"]))


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
           "int32": torch.int32, "bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8}
_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int64: "i64",
          torch.int32: "i32", torch.bool: "b8", torch.int8: "i8", torch.uint8: "u8"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_short(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, dtype_name(dtype))


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class Program:
    """Step graphs + shared weights; see the module docstring."""

    config: Any                                      # LingConfig
    graphs: dict[str, fx.Graph]
    weights: dict[str, torch.Tensor]
    weight_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    # GraphModules built by module(); passes work on copies, so a graph is never edited after it is built
    _modules: dict[str, fx.GraphModule] = field(default_factory=dict, repr=False, compare=False)

    def copy(self) -> "Program":
        """New graphs (deep-copied, meta included) and dicts; tensors shared until replaced."""
        graphs = {}
        for name, g in self.graphs.items():
            new = fx.Graph()
            env: dict[fx.Node, fx.Node] = {}
            new.output(new.graph_copy(g, env))
            for old_node, new_node in env.items():
                new_node.meta = copy.deepcopy(old_node.meta)
            graphs[name] = new
        return Program(self.config, graphs, dict(self.weights), copy.deepcopy(self.weight_info), dict(self.options))

    def module(self, name: str) -> fx.GraphModule:
        """A runnable GraphModule of graph `name` over this program's weights (built once, then cached)."""
        if name in self._modules:
            return self._modules[name]
        graph = self.graphs[name]
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        missing = used - self.weights.keys()
        if missing:
            raise KeyError(f"graph {name!r} reads weights that the program lacks: {sorted(missing)[:5]}")
        gm = fx.GraphModule({k: self.weights[k] for k in used}, graph, class_name=f"lingc_{name}")
        self._modules[name] = gm
        return gm

    def inputs(self, name: str) -> list[fx.Node]:
        return [n for n in self.graphs[name].nodes if n.op == "placeholder"]

    def run(self, name: str, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run graph `name`, feeding placeholders by name; state inputs are updated in place."""
        names = [n.name for n in self.inputs(name)]
        missing = [n for n in names if n not in inputs]
        if missing:
            raise KeyError(f"graph {name!r} needs inputs {missing}")
        with torch.no_grad():
            return self.module(name)(*[inputs[n] for n in names])


def tensor_meta(node: fx.Node) -> TensorMeta | list[TensorMeta] | None:
    return node.meta.get("lingc.tensor")
