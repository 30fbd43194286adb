"""ModelState: the per-request decode state of the reference model (KDA conv + recurrent state, MLA latent cache).

Dense and simple on purpose: one slot per batch row and one latent row per position. The runtime's
paged cache and state pools (runtime/) hold the same tensors in a different layout.
Letters: B batch, S cache slots, P = KDA heads * head dim, W conv width, L latent (576).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lingc.config import LingConfig


@dataclass
class ModelState:
    """Named state tensors, `layers.{i}.{name}`; every op that updates one does so in place."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    max_len: int = 0

    @classmethod
    def new(cls, config: LingConfig, batch: int, max_len: int, dtype: torch.dtype,
            device: torch.device | str = "cpu", layers: range | None = None) -> "ModelState":
        """Zero state for `layers` (default: all decoder layers and MTP layers) with `max_len` cache slots."""
        c = config
        n = c.num_hidden_layers + c.num_nextn_predict_layers
        out: dict[str, torch.Tensor] = {}
        for i in layers if layers is not None else range(n):
            if c.is_mla_layer(i):
                out[f"layers.{i}.kv_cache"] = torch.zeros(batch, max_len, c.mla_latent_dim, dtype=dtype, device=device)
            else:
                for s in ("q", "k", "v"):
                    out[f"layers.{i}.conv_{s}"] = torch.zeros(batch, c.kda_dim, c.short_conv_kernel_size - 1,
                                                              dtype=dtype, device=device)
                out[f"layers.{i}.recurrent"] = torch.zeros(batch, c.kda_heads, c.head_dim, c.head_dim,
                                                           dtype=torch.float32, device=device)
        return cls(out, max_len)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """The state tensors of layer i, keyed by their short name ('kv_cache', 'conv_q', 'recurrent', ...)."""
        prefix = f"layers.{i}."
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    def clone(self) -> "ModelState":
        return ModelState({k: v.clone() for k, v in self.tensors.items()}, self.max_len)
