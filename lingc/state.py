"""Decode state of the reference model: per-layer pools indexed by request slot, and the step's index metadata.

KDA layers: conv windows `conv_q|k|v` [S, P, W-1] (activation dtype) and `recurrent` [S, H, D, D] fp32.
MLA layers (and MTP layers): `kv_pages` [NP, PS, L], L = kv_lora_rank + rope dim (576 at real size).
`slots` [B] says which request slot each batch row uses; `page_table` [S, MP] lists each slot's pages.
`ModelState.new` builds the simplest layout (slot b = row b, one page of max_len rows per request);
the runtime builds real pools (many slots, small pages) with the same tensors and names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lingc.config import LingConfig


@dataclass
class StepMeta:
    """What one step's layers need to find their state, computed once per step on the device."""

    positions: torch.Tensor       # [B, T] int64
    slots: torch.Tensor           # [B] int32
    page_rows: torch.Tensor       # [B, MP] int32: page_table[slots]
    cache_locs: torch.Tensor      # [B, T] int64: flat kv_pages row of each token


@dataclass
class ModelState:
    """Named pools `layers.{i}.{name}` plus slots and page table; ops update pools in place."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    slots: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    page_size: int = 0
    # verify chains: per-position post-states `layers.{i}.{name}` [B, T, ...]; KDA layers that have
    # staging leave their pools alone and kda_commit keeps the accepted position (techniques.md 10)
    staging: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def max_len(self) -> int:
        return self.page_table.shape[1] * self.page_size

    @classmethod
    def new(cls, config: LingConfig, batch: int, max_len: int, dtype: torch.dtype,
            device: torch.device | str = "cpu", layers: range | None = None) -> "ModelState":
        """Zero state for `layers` (default: all decoder and MTP layers): one slot and one page per row."""
        out = pools(config, slots=batch, pages=batch, page_size=max_len, dtype=dtype, device=device, layers=layers)
        slots = torch.arange(batch, dtype=torch.int32, device=device)
        return cls(out, slots, slots.view(batch, 1).clone(), max_len)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """The state tensors of layer i, keyed by their short name ('kv_pages', 'conv_q', 'recurrent', ...)."""
        prefix = f"layers.{i}."
        out = {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}
        out.update({"staging_" + k[len(prefix):]: v for k, v in self.staging.items() if k.startswith(prefix)})
        return out

    def clone(self) -> "ModelState":
        return ModelState({k: v.clone() for k, v in self.tensors.items()}, self.slots.clone(),
                          self.page_table.clone(), self.page_size, {k: v.clone() for k, v in self.staging.items()})


def pools(config: LingConfig, slots: int, pages: int, page_size: int, dtype: torch.dtype,
          device: torch.device | str = "cpu", layers: range | None = None) -> dict[str, torch.Tensor]:
    """Zeroed state pools for `layers`: KDA pools with `slots` rows, MLA caches of `pages` pages."""
    c = config
    out: dict[str, torch.Tensor] = {}
    for i in layers if layers is not None else range(c.num_hidden_layers + c.num_nextn_predict_layers):
        if c.is_mla_layer(i):
            out[f"layers.{i}.kv_pages"] = torch.zeros(pages, page_size, c.mla_latent_dim, dtype=dtype, device=device)
        else:
            for s in ("q", "k", "v"):
                out[f"layers.{i}.conv_{s}"] = torch.zeros(slots, c.kda_dim, c.short_conv_kernel_size - 1,
                                                          dtype=dtype, device=device)
            out[f"layers.{i}.recurrent"] = torch.zeros(slots, c.kda_heads, c.head_dim, c.head_dim,
                                                       dtype=torch.float32, device=device)
    return out


def staging_buffers(config: LingConfig, batch: int, tokens: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Verify-chain staging for every KDA layer: conv windows [B, T, P, W-1] and states [B, T, H, D, D] fp32."""
    c = config
    out: dict[str, torch.Tensor] = {}
    for i in range(c.num_hidden_layers):
        if c.is_mla_layer(i):
            continue
        for s in ("q", "k", "v"):
            out[f"layers.{i}.conv_{s}"] = torch.zeros(batch, tokens, c.kda_dim, c.short_conv_kernel_size - 1,
                                                      dtype=dtype, device=device)
        out[f"layers.{i}.recurrent"] = torch.zeros(batch, tokens, c.kda_heads, c.head_dim, c.head_dim,
                                                   dtype=torch.float32, device=device)
    return out
