"""The lingc IR: `torch.ops.lingc.*` custom ops, each with a plain-torch reference and a fake (shape) impl.

The reference model calls only these ops (plus a few aten view/shape ops), so tracing it yields them
directly. `OPS` lists every lingc op by short name; `lingc.ir_json` resolves graph ops only through it.
Importing this package registers the ops (the only import-time side effect lingc has).
"""

from lingc.ops import norm, linear, norm_linear, kda, mla, moe, sample, meta, spec, dist  # noqa: F401  (registration)
from lingc.ops import norm_router  # noqa: F401  (registration; after norm_linear and moe, which it composes)
from lingc.ops import prefetch  # noqa: F401  (registration)
from lingc.ops.registry import OPS, op_name

__all__ = ["OPS", "op_name"]
