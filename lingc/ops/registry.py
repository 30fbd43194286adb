"""The allowlist of lingc ops: name -> OpOverload, filled as each op module registers its ops."""

from __future__ import annotations

import torch
import torch.fx

LIB = "lingc"


def op_name(target: object) -> str:
    """'lingc.rmsnorm' for torch.ops.lingc.rmsnorm.default, 'aten.view' for aten.view.default."""
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::")      # name() would already carry the overload
        overload = target._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    return getattr(target, "__name__", str(target))


class _Ops(dict):
    """Short name ('rmsnorm') -> torch.ops.lingc.<name>.default, for every registered lingc op."""

    def __getattr__(self, name: str) -> torch._ops.OpOverload:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no lingc op named {name!r}; known: {sorted(self)}") from None


OPS = _Ops()
HINTS: set[str] = set()   # short names of hint ops: no result, no writes, yet kept in a graph (lingc/ops/prefetch.py)


def register(name: str, hint: bool = False) -> None:
    """Record torch.ops.lingc.<name>.default in OPS (called right after torch.library.custom_op). A hint op
    (hint=True) is also kept by graph.eliminate_dead_code and by the IR lint, though nothing reads it."""
    OPS[name] = getattr(getattr(torch.ops, LIB), name).default
    if hint:
        HINTS.add(name)
        keep = getattr(torch.fx.node, "has_side_effect", None)
        if keep is not None:
            keep(OPS[name])
