"""Checkpoint layout and loading: a published Ling-3.0 directory (config.json + safetensors shards) into the model.

`checkpoint_layout(config)` lists every tensor of the original HF naming (architecture.md section 10)
with its shape, stored dtype and where it lands in the reference model (lingc stacks experts into
w13 / w2 and gate/up into gate_up_proj). `load` reads every safetensors header first and checks it
against the layout (missing, unexpected, shape, dtype: errors name the key, file and shapes), and only
then streams the tensors, one at a time and in file order, straight into a model allocated once.

Why not `safe_open(...).get_tensor`: it reads through an mmap of the whole shard, and those pages
stay resident (and count in RSS) until the shard is closed, so a single-file checkpoint peaked at
about twice the model's size. Here each tensor is read with plain `readinto` into its destination
(or through one small staging buffer when the dtype or device differs), so peak memory is the model
plus a few MiB. The safetensors format is a little-endian u64 header length, a JSON header
{key: {dtype, shape, data_offsets}}, then the raw bytes; nothing is unpickled or executed.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from lingc.config import LingConfig
from lingc.model import LingForCausalLM
from lingc.progress import progress_bar

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP32_SUFFIXES = (".A_log", ".dt_bias", ".expert_bias", "conv1d.weight")   # stored and kept in fp32
FLOAT_DTYPES = {torch.bfloat16, torch.float16, torch.float32}
# safetensors dtype names -> torch; only the float ones are loadable, the rest exist for error messages
ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 100 * 2**20           # the safetensors library's own limit
STAGING_BYTES = 16 * 2**20               # staging buffer for tensors that need a dtype or device change
# copies of the shared embedding / head some MTP exports carry; ignored (architecture.md section 7)
IGNORED_MTP_KEYS = re.compile(r"model\.layers\.(\d+)\.(shared_head\.head|embed_tokens)\.weight")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the file, key and shapes."""


@dataclass(frozen=True)
class TensorSpec:
    key: str                    # name in the safetensors files
    shape: tuple[int, ...]
    dtype: torch.dtype          # dtype the published checkpoints store it in
    param: str                  # reference-model parameter it fills
    index: tuple                # where inside that parameter: () whole, (e,) one expert, (e, slice) rows


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it: absolute byte range [begin, end) in `file`."""

    key: str
    file: Path
    dtype: str                  # safetensors name: "BF16", "F32", "I8", ...
    shape: tuple[int, ...]
    begin: int
    end: int


def _stored_dtype(key: str) -> torch.dtype:
    return torch.float32 if key.endswith(FP32_SUFFIXES) else torch.bfloat16


def checkpoint_layout(config: LingConfig) -> list[TensorSpec]:
    """Every tensor of a checkpoint for `config`, in the reference model's parameter order."""
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


# ---- reading safetensors headers ------------------------------------------------------------

def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one .safetensors file, validated against the file's size; raises CheckpointError."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{file}: not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: safetensors header is not a JSON object")
    data_start, out = 8 + n, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            lo, hi = int(lo), int(hi)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor '{key}' has a malformed header entry {entry!r}") from None
        if not 0 <= lo <= hi <= size - data_start or any(d < 0 for d in shape):
            raise CheckpointError(f"{file}: tensor '{key}' has byte range [{lo}, {hi}) outside the file's "
                                  f"{size - data_start} data bytes (truncated file?)")
        if dtype in ST_DTYPES and hi - lo != math.prod(shape) * ST_DTYPES[dtype].itemsize:
            raise CheckpointError(f"{file}: tensor '{key}' ({dtype} {list(shape)}) spans {hi - lo} bytes, want "
                                  f"{math.prod(shape) * ST_DTYPES[dtype].itemsize}")
        out[key] = StoredTensor(key, file, str(dtype), shape, data_start + lo, data_start + hi)
    return out


def checkpoint_tensors(path: Path) -> dict[str, StoredTensor]:
    """key -> StoredTensor, from model.safetensors.index.json and its shards, or the single model.safetensors."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object of "
                                  f"key -> file name): {e!r}") from None
        shards: dict[str, dict[str, StoredTensor]] = {}
        for key, fname in weight_map.items():
            if fname not in shards:
                if Path(fname).name != fname or not fname.endswith(".safetensors"):
                    raise CheckpointError(f"{index}: tensor '{key}' maps to {fname!r}, not a .safetensors file "
                                          f"name in {path}")
                if not (path / fname).is_file():
                    raise CheckpointError(f"{index}: lists shard {fname} (for '{key}'), which is missing from {path}")
                shards[fname] = read_header(path / fname)
            if key not in shards[fname]:
                raise CheckpointError(f"{fname}: {INDEX_FILE} maps '{key}' to this file, but the file has no "
                                      "such tensor")
        for fname, tensors in shards.items():
            for key in tensors:
                if weight_map.get(key) != fname:
                    where = f"maps it to {weight_map[key]}" if key in weight_map else "does not list it"
                    raise CheckpointError(f"{fname}: unexpected tensor '{key}': {INDEX_FILE} {where}")
        return {key: shards[fname][key] for key, fname in weight_map.items()}
    single = path / SINGLE_FILE
    if single.exists():
        return read_header(single)
    shards_found = sorted(p.name for p in path.glob("*.safetensors"))
    found = f" (found {', '.join(shards_found[:3])}{' ...' if len(shards_found) > 3 else ''} without an index)" \
        if shards_found else ""
    raise CheckpointError(f"{path}: no {INDEX_FILE} and no {SINGLE_FILE}; not a safetensors checkpoint{found}")


def checkpoint_files(path: Path) -> dict[str, Path]:
    """key -> file holding it."""
    return {key: st.file for key, st in checkpoint_tensors(path).items()}


# ---- checking a checkpoint against the layout -----------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_checkpoint(config: LingConfig, specs: dict[str, TensorSpec], stored: dict[str, StoredTensor],
                     path: Path) -> list[str]:
    """Raise CheckpointError on any unexpected / wrong-shape / non-float / missing tensor; return keys to skip."""
    skipped: list[str] = []
    for key, st in sorted(stored.items(), key=lambda kv: (kv[1].file, kv[1].begin)):
        want = specs.get(key)
        if want is None:
            m = IGNORED_MTP_KEYS.fullmatch(key)
            if m and int(m.group(1)) >= config.num_hidden_layers:
                skipped.append(key)
                continue
            raise CheckpointError(f"{st.file.name}: unexpected tensor '{key}' {list(st.shape)} (not part of this "
                                  "config's model; check num_hidden_layers / num_nextn_predict_layers / "
                                  "q_lora_rank / first_k_dense_replace in config.json)")
        if st.shape != want.shape:
            hint = " (same elements, different layout)" if math.prod(st.shape) == math.prod(want.shape) else ""
            raise CheckpointError(f"{st.file.name}: tensor '{key}' has shape {list(st.shape)}, want "
                                  f"{list(want.shape)}{hint}")
        if ST_DTYPES.get(st.dtype) not in FLOAT_DTYPES:
            raise CheckpointError(f"{st.file.name}: tensor '{key}' has dtype {st.dtype}, want "
                                  f"{_dtype_name(want.dtype)} (bf16, fp16 or fp32 accepted)")
    missing = [s for k, s in specs.items() if k not in stored]
    if missing:
        shown = ", ".join(f"'{s.key}' {list(s.shape)} {_dtype_name(s.dtype)}" for s in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: checkpoint is missing {len(missing)} tensor(s): {shown}{more}")
    return skipped


# ---- streaming the bytes in -----------------------------------------------------------------

def _read_exact(fh: BinaryIO, buf: memoryview, st: StoredTensor) -> None:
    done = 0
    while done < len(buf):
        got = fh.readinto(buf[done:])
        if not got:
            raise CheckpointError(f"{st.file}: tensor '{st.key}' ends early (read {done} of {len(buf)} bytes)")
        done += got


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _read_tensor(fh: BinaryIO, st: StoredTensor, dst: torch.Tensor, staging: torch.Tensor) -> None:
    """Read `st`'s bytes into `dst` (contiguous, same shape); dtype/device changes go via `staging` in chunks."""
    src_dtype = ST_DTYPES[st.dtype]
    assert dst.is_contiguous() and tuple(dst.shape) == st.shape, (st.key, dst.shape)
    fh.seek(st.begin)
    if dst.device.type == "cpu" and dst.dtype == src_dtype:
        _read_exact(fh, _bytes_of(dst), st)
        return
    flat, item = dst.view(-1), src_dtype.itemsize
    per_chunk = len(staging) // item
    for start in range(0, flat.numel(), per_chunk):
        n = min(per_chunk, flat.numel() - start)
        chunk = staging[: n * item]
        _read_exact(fh, _bytes_of(chunk), st)
        flat[start:start + n].copy_(chunk.view(src_dtype))


def load(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
         progress: bool = False) -> LingForCausalLM:
    """Load a Ling-3.0 checkpoint directory into the reference model (eval mode, no grad).

    `dtype` is the dtype of the big weights; A_log, dt_bias, the convs, the router and lm_head stay
    fp32 whatever the checkpoint stores. Every header is checked before any weight is read, so a bad
    checkpoint fails fast, and nothing on disk is ever modified.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a checkpoint is a directory with {CONFIG_FILE} and "
                              "*.safetensors)")
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE}; a checkpoint directory needs one")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"load: dtype {dtype} is not one of bfloat16, float16, float32")
    config = LingConfig.from_json(path / CONFIG_FILE)
    specs = {s.key: s for s in checkpoint_layout(config)}
    stored = checkpoint_tensors(path)
    skipped = check_checkpoint(config, specs, stored, path)
    if skipped:
        log.info("ignoring %d MTP copies of shared tensors: %s", len(skipped), ", ".join(skipped[:3]))
    with torch.device("meta"):
        model = LingForCausalLM(config, dtype)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    device = torch.device(device)
    biggest = max((st.end - st.begin for k, st in stored.items() if k in specs), default=1)
    staging = torch.empty(max(8, min(STAGING_BYTES, biggest)), dtype=torch.uint8,
                          pin_memory=device.type == "cuda")
    by_file: dict[Path, list[StoredTensor]] = {}
    for key, st in stored.items():
        if key in specs:
            by_file.setdefault(st.file, []).append(st)
    with progress_bar(f"loading {path}", total=len(specs), enabled=progress) as advance, torch.no_grad():
        for file, tensors in sorted(by_file.items()):
            with open(file, "rb", buffering=0) as fh:
                for st in sorted(tensors, key=lambda s: s.begin):      # sequential reads
                    spec = specs[st.key]
                    _read_tensor(fh, st, params[spec.param].detach()[spec.index], staging)
                    advance(1)
    return model.eval()
