"""Checkpoint layout and loading: a published Ling-3.0 directory (config.json + safetensors shards) into the model.

`checkpoint_layout(config)` lists every tensor of the original HF naming (architecture.md section 10)
with its shape, stored dtype and where it lands in the reference model (lingc stacks experts into
w13 / w2 and gate/up into gate_up_proj). `load` checks every header first (missing, unexpected,
shape, dtype: errors name the key, file and shapes) and only then streams tensor by tensor into a
model allocated once, so peak memory stays about the model's size.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from lingc.config import LingConfig
from lingc.model import LingForCausalLM
from lingc.progress import progress_bar

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP32_SUFFIXES = (".A_log", ".dt_bias", ".expert_bias", "conv1d.weight")   # stored and kept in fp32
FLOAT_DTYPES = {torch.bfloat16, torch.float16, torch.float32}
# copies of the shared embedding / head some MTP exports carry; ignored (architecture.md section 7)
IGNORED_MTP_KEYS = re.compile(r"model\.layers\.\d+\.(shared_head\.head|embed_tokens)\.weight")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the file, key and shapes."""


@dataclass(frozen=True)
class TensorSpec:
    key: str                    # name in the safetensors files
    shape: tuple[int, ...]
    dtype: torch.dtype          # dtype the published checkpoints store it in
    param: str                  # reference-model parameter it fills
    index: tuple                # where inside that parameter: () whole, (e,) one expert, (e, slice) rows


def _stored_dtype(key: str) -> torch.dtype:
    return torch.float32 if key.endswith(FP32_SUFFIXES) else torch.bfloat16


def checkpoint_layout(config: LingConfig) -> list[TensorSpec]:
    """Every tensor of a checkpoint for `config`, in file order."""
    with torch.device("meta"):
        model = LingForCausalLM(config)
    specs: list[TensorSpec] = []
    for name, p in model.named_parameters():
        specs.extend(_specs_for(name, tuple(p.shape)))
    return specs


def _specs_for(name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
    def spec(key: str, sub_shape: tuple[int, ...], index: tuple = ()) -> TensorSpec:
        return TensorSpec(key, sub_shape, _stored_dtype(key), name, index)

    if name.endswith(".gate_up_proj.weight"):          # dense MLP / shared expert: [gate; up] rows
        base, inter = name[: -len("gate_up_proj.weight")], shape[0] // 2
        return [spec(f"{base}gate_proj.weight", (inter, shape[1]), (slice(0, inter),)),
                spec(f"{base}up_proj.weight", (inter, shape[1]), (slice(inter, 2 * inter),))]
    if name.endswith(".experts.w13"):
        base, (E, two_i, h) = name[: -len("w13")], shape
        inter = two_i // 2
        return [s for e in range(E) for s in (
            spec(f"{base}{e}.gate_proj.weight", (inter, h), (e, slice(0, inter))),
            spec(f"{base}{e}.up_proj.weight", (inter, h), (e, slice(inter, two_i))))]
    if name.endswith(".experts.w2"):
        base, (E, h, inter) = name[: -len("w2")], shape
        return [spec(f"{base}{e}.down_proj.weight", (h, inter), (e,)) for e in range(E)]
    return [spec(name, shape)]


def checkpoint_files(path: Path) -> dict[str, Path]:
    """key -> file, from model.safetensors.index.json or the single model.safetensors."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from None
        files = {key: path / fname for key, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.exists():
                raise CheckpointError(f"{index}: lists shard {f.name}, which is missing from {path}")
        return files
    single = path / SINGLE_FILE
    if single.exists():
        with safe_open(single, framework="pt") as f:
            return {key: single for key in f.keys()}
    raise CheckpointError(f"{path}: no {INDEX_FILE} and no {SINGLE_FILE}; not a safetensors checkpoint")


def _check_headers(specs: dict[str, TensorSpec], files: dict[str, Path]) -> list[str]:
    """Raise on any missing / unexpected / wrong-shape / non-float tensor; return keys to skip."""
    skipped: list[str] = []
    by_file: dict[Path, list[str]] = {}
    for key, f in files.items():
        by_file.setdefault(f, []).append(key)
    for f, keys in by_file.items():
        with safe_open(f, framework="pt") as handle:
            present = set(handle.keys())
            for key in keys:
                if key not in present:
                    raise CheckpointError(f"{f.name}: the index maps '{key}' to this file, but the file has no such tensor")
                if key not in specs:
                    if IGNORED_MTP_KEYS.fullmatch(key):
                        skipped.append(key)
                        continue
                    raise CheckpointError(f"{f.name}: unexpected tensor '{key}' (not part of this config's model; "
                                          "check num_hidden_layers / num_nextn_predict_layers / q_lora_rank)")
                sl = handle.get_slice(key)
                shape, dtype = tuple(sl.get_shape()), _st_dtype(sl.get_dtype())
                want = specs[key]
                if shape != want.shape:
                    raise CheckpointError(f"{f.name}: tensor '{key}' has shape {list(shape)}, want {list(want.shape)}")
                if dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"{f.name}: tensor '{key}' has dtype {sl.get_dtype()}, want "
                                          f"{str(want.dtype).removeprefix('torch.')} (bf16/fp16/fp32 accepted)")
    missing = [k for k in specs if k not in files]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}{more}")
    return skipped


def _st_dtype(name: str) -> torch.dtype | None:
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(name)


def load(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
         progress: bool = False) -> LingForCausalLM:
    """Load a Ling-3.0 checkpoint directory into the reference model (eval mode, no grad)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a checkpoint is a directory with config.json and *.safetensors)")
    config = LingConfig.from_json(path / "config.json")
    specs = {s.key: s for s in checkpoint_layout(config)}
    files = checkpoint_files(path)
    skipped = _check_headers(specs, files)
    if skipped:
        log.info("ignoring %d MTP copies of shared tensors: %s", len(skipped), ", ".join(skipped[:3]))
    with torch.device("meta"):
        model = LingForCausalLM(config, dtype)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for key, f in files.items():
        if key in specs:
            by_file.setdefault(f, []).append(key)
    with progress_bar("loading", total=len(specs), enabled=progress) as advance:
        for f, keys in sorted(by_file.items()):
            with safe_open(f, framework="pt", device=str(device)) as handle:
                for key in keys:
                    spec = specs[key]
                    target = params[spec.param]
                    target[spec.index].copy_(handle.get_tensor(key))
                    advance(1)
    return model.eval()
