"""Deterministic random checkpoints in the published format: `lingc init --preset NAME --out DIR`.

Each tensor is drawn from its own generator, seeded from (seed, key), so the bytes depend only on the
seed, the config and the device kind that drew them, never on shard boundaries or order. Tensors are
written shard by shard (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, as the
published checkpoints are), so memory stays at about one shard.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from lingc.checkpoint import INDEX_FILE, SINGLE_FILE, TensorSpec, checkpoint_layout
from lingc.config import LingConfig
from lingc.progress import progress_bar

if TYPE_CHECKING:
    from lingc.model import LingForCausalLM

DEFAULT_SHARD_BYTES = 512 * 2**20   # the published Tiny BF16 checkpoint: 15.8 GB in 32 shards
INIT_STD = 0.02                     # initializer_range of the HF config


def _generator(seed: int, key: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return g


def random_tensor(spec: TensorSpec, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor `spec.key` of the random checkpoint with this seed, in its stored dtype."""
    device = torch.device(device)
    g = _generator(seed, spec.key, device)
    key, shape = spec.key, spec.shape

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=g, device=device) * (hi - lo) + lo

    if key.endswith(".A_log"):
        t = uniform(1.0, 16.0).log()                           # Mamba-style decay rates
    elif key.endswith(".dt_bias"):
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        t = dt + torch.log(-torch.expm1(-dt))                  # inverse softplus
    elif key.endswith("conv1d.weight"):
        t = uniform(-0.5, 0.5)                                 # torch's default for a width-4 conv
    elif key.endswith(".expert_bias"):
        t = torch.randn(shape, generator=g, device=device) * 0.02
    elif key.endswith("norm.weight"):                          # every RMSNorm: near one, not exactly
        t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
    else:
        t = torch.randn(shape, generator=g, device=device) * INIT_STD
    return t.to(spec.dtype)


def _shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        nbytes = math.prod(s.shape) * s.dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += nbytes
    return shards


def write_random_checkpoint(config: LingConfig, out: str | Path, seed: int = 0, device: str = "cpu",
                            shard_bytes: int | None = None, progress: bool = False) -> Path:
    """Write config.json and random weights for `config` to `out`; returns the directory.

    shard_bytes defaults to 512 MiB, or a quarter of the model for small models so that even a test
    checkpoint is sharded with an index like the published ones. shard_bytes <= 0 writes one
    model.safetensors without an index.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = checkpoint_layout(config)
    total = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)
    if shard_bytes is None:
        shard_bytes = min(DEFAULT_SHARD_BYTES, max(1, total // 4))
    shards = _shards(specs, shard_bytes) if shard_bytes > 0 else [specs]
    names = ([SINGLE_FILE] if shard_bytes <= 0 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    with progress_bar(f"writing {out}", total=len(specs), enabled=progress) as advance:
        for name, shard in zip(names, shards):
            tensors = {}
            for s in shard:
                tensors[s.key] = random_tensor(s, seed, device).cpu()
                weight_map[s.key] = name
                advance(1)
            tmp = out / (name + ".partial")
            save_file(tensors, tmp, metadata={"format": "pt"})
            tmp.replace(out / name)
    if shard_bytes > 0:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    _remove_stale(out, set(names) | ({INDEX_FILE} if shard_bytes > 0 else set()))
    config.to_json(out / "config.json")
    return out


def random_model(config: LingConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu") -> "LingForCausalLM":
    """The reference model holding exactly the weights `lingc load` would read from
    `write_random_checkpoint(config, ..., seed, device)`, drawn in place on `device` without touching disk
    (the GPU benchmark builds Ling-3.0-tiny this way in seconds instead of writing 16 GB)."""
    from lingc.checkpoint import checkpoint_layout as layout
    from lingc.model import LingForCausalLM

    device = torch.device(device)
    with torch.device("meta"):
        model = LingForCausalLM(config, dtype)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for spec in layout(config):
            if spec.param not in params:
                continue
            params[spec.param].detach()[spec.index].copy_(random_tensor(spec, seed, device))
    return model.eval()


def _remove_stale(out: Path, keep: set[str]) -> None:
    """Delete weight files an earlier write left in `out` (another shard count, or index vs single file),
    which would otherwise be loaded instead of, or mixed with, the new ones."""
    for p in [out / INDEX_FILE, out / SINGLE_FILE, *out.glob("model-*-of-*.safetensors")]:
        if p.name not in keep and p.is_file():
            p.unlink()
