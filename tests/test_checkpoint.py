"""Checkpoints: the writer matches checkpoint_layout, load maps every tensor, bad ones fail naming key/file/shape."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import lingc
from lingc.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, checkpoint_layout, checkpoint_tensors
from lingc.config import ConfigError
from lingc.init import write_random_checkpoint
from lingc.presets import preset

FP32_KEYS = (".A_log", ".dt_bias", ".expert_bias", "conv1d.weight")


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _stored(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ck"))


def _index(ck: Path) -> dict[str, str]:
    return json.loads((ck / INDEX_FILE).read_text())["weight_map"]


def _edit_shard(ck: Path, key: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """Rewrite the shard holding `key` after `edit(tensors)`; returns the shard's file name."""
    fname = _index(ck)[key]
    tensors = load_file(ck / fname)
    edit(tensors)
    save_file(tensors, ck / fname, metadata={"format": "pt"})
    return fname


def _edit_index(ck: Path, edit: Callable[[dict[str, str]], None]) -> None:
    index = json.loads((ck / INDEX_FILE).read_text())
    edit(index["weight_map"])
    (ck / INDEX_FILE).write_text(json.dumps(index))


def _load_fails(ck: Path, error: type = CheckpointError) -> str:
    """load(ck) raises `error`; the checkpoint directory is left untouched. Returns the message."""
    before = _digest(ck) if ck.is_dir() else None
    with pytest.raises(error) as e:
        lingc.load(ck)
    assert (_digest(ck) if ck.is_dir() else None) == before
    return str(e.value)


# ---- layout and writer --------------------------------------------------------------------

def test_written_checkpoint_matches_layout(tiny_ckpt: Path) -> None:
    specs = checkpoint_layout(preset("test-tiny"))
    weight_map = _index(tiny_ckpt)
    assert len(set(weight_map.values())) > 1                               # sharded, like the published ones
    assert list(weight_map) == [s.key for s in specs]
    for s in specs:
        with safe_open(tiny_ckpt / weight_map[s.key], framework="pt") as f:
            sl = f.get_slice(s.key)
            assert tuple(sl.get_shape()) == s.shape, s.key
            assert sl.get_dtype() == ("F32" if s.key.endswith(FP32_KEYS) else "BF16"), s.key
    assert not (tiny_ckpt / SINGLE_FILE).exists()


def test_layout_matches_architecture_tables() -> None:
    """architecture.md section 10, Tiny and Flash columns (spot checks of every tensor family)."""
    tiny = {s.key: s.shape for s in checkpoint_layout(preset("ling-3.0-tiny"))}
    kda, mla, moe = "model.layers.0.attention.", "model.layers.3.attention.", "model.layers.5.mlp."
    assert tiny["model.word_embeddings.weight"] == tiny["lm_head.weight"] == (157184, 1536)
    assert tiny[kda + "q_proj.weight"] == tiny[kda + "g_proj.weight"] == (2048, 1536)
    assert (tiny[kda + "b_proj.weight"], tiny[kda + "q_conv1d.weight"], tiny[kda + "A_log"],
            tiny[kda + "dt_bias"], tiny[kda + "o_norm.weight"], tiny[kda + "o_proj.weight"]) == \
        ((16, 1536), (2048, 1, 4), (16,), (2048,), (128,), (1536, 2048))
    assert (tiny[mla + "q_a_proj.weight"], tiny[mla + "q_a_layernorm.weight"], tiny[mla + "q_b_proj.weight"],
            tiny[mla + "kv_a_proj_with_mqa.weight"], tiny[mla + "kv_a_layernorm.weight"],
            tiny[mla + "kv_b_proj.weight"], tiny[mla + "g_proj.weight"], tiny[mla + "dense.weight"]) == \
        ((256, 1536), (256,), (3072, 256), (576, 1536), (512,), (4096, 512), (16, 1536), (1536, 2048))
    assert mla + "q_proj.weight" not in tiny
    assert tiny["model.layers.0.mlp.gate_proj.weight"] == (4608, 1536)
    assert (tiny[moe + "gate.weight"], tiny[moe + "gate.expert_bias"], tiny[moe + "experts.127.up_proj.weight"],
            tiny[moe + "experts.127.down_proj.weight"], tiny[moe + "shared_experts.gate_proj.weight"]) == \
        ((128, 1536), (128,), (512, 1536), (1536, 512), (512, 1536))
    assert not any(k.startswith("model.layers.24.") for k in tiny)
    flash = {s.key: s.shape for s in checkpoint_layout(preset("ling-3.0-flash"))}
    assert flash["model.layers.5.attention.q_proj.weight"] == (6144, 2560)
    assert flash["model.layers.5.attention.kv_b_proj.weight"] == (8192, 512)
    assert flash["model.layers.42.eh_proj.weight"] == (2560, 5120)
    assert flash["model.layers.42.attention.q_proj.weight"] == (6144, 2560)            # the MTP mixer is MLA
    assert flash["model.layers.42.mlp.experts.511.down_proj.weight"] == (2560, 768)
    for k in ("enorm", "hnorm", "final_layernorm"):
        assert flash[f"model.layers.42.{k}.weight"] == (2560,)


def test_same_seed_same_bytes(tiny_ckpt: Path, tmp_path: Path) -> None:
    a = write_random_checkpoint(preset("test-tiny"), tmp_path / "a", seed=0)
    assert _digest(a) == _digest(tiny_ckpt)
    b = write_random_checkpoint(preset("test-tiny"), tmp_path / "b", seed=1)
    assert _digest(b)["config.json"] == _digest(a)["config.json"]
    assert all(_digest(b)[n] != h for n, h in _digest(a).items() if n.endswith(".safetensors"))


def test_rewrite_removes_stale_shards(tmp_path: Path) -> None:
    cfg = preset("test-tiny")
    write_random_checkpoint(cfg, tmp_path, seed=0, shard_bytes=100_000)
    write_random_checkpoint(cfg, tmp_path, seed=0, shard_bytes=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", SINGLE_FILE]
    write_random_checkpoint(cfg, tmp_path, seed=0)
    assert not (tmp_path / SINGLE_FILE).exists()
    assert sorted(set(_index(tmp_path).values())) == sorted(p.name for p in tmp_path.glob("*.safetensors"))


# ---- loading ------------------------------------------------------------------------------

def test_load_maps_every_tensor(tiny_ckpt: Path, tiny_model_fp32: lingc.LingForCausalLM) -> None:
    """Each stored tensor lands where checkpoint_layout says (stacked experts, gate/up rows), exactly."""
    stored = _stored(tiny_ckpt)
    params = dict(tiny_model_fp32.named_parameters())
    for s in checkpoint_layout(preset("test-tiny")):
        assert torch.equal(params[s.param][s.index], stored[s.key].float()), s.key
    assert all(p.dtype == torch.float32 for p in params.values())
    assert not tiny_model_fp32.training


def test_sharded_and_single_file_identical(tiny_ckpt: Path, tiny_model_fp32: lingc.LingForCausalLM,
                                           tmp_path: Path) -> None:
    single = write_random_checkpoint(preset("test-tiny"), tmp_path, seed=0, shard_bytes=0)
    assert not (single / INDEX_FILE).exists()
    other = dict(lingc.load(single, dtype=torch.float32).named_parameters())
    for name, p in tiny_model_fp32.named_parameters():
        assert torch.equal(p, other[name]), name


def test_bf16_load_keeps_fp32_params(tiny_ckpt: Path) -> None:
    params = dict(lingc.load(tiny_ckpt, dtype=torch.bfloat16, progress=True).named_parameters())
    fp32 = {n for n, p in params.items() if p.dtype == torch.float32}
    assert "model.layers.0.attention.A_log" in fp32 and "model.layers.1.mlp.gate.expert_bias" in fp32
    assert "model.layers.0.attention.q_conv1d.weight" in fp32 and "lm_head.weight" in fp32
    assert params["model.layers.0.attention.q_proj.weight"].dtype == torch.bfloat16


def test_bf16_a_log_upcast(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck, key = _copy(tiny_ckpt, tmp_path), "model.layers.0.attention.A_log"
    _edit_shard(ck, key, lambda t: t.update({key: t[key].bfloat16()}))
    model = lingc.load(ck, dtype=torch.float32)
    a_log = model.model.layers[0].attention.A_log
    assert a_log.dtype == torch.float32 and torch.equal(a_log, load_file(ck / _index(ck)[key])[key].float())


def test_mtp_head_copies_ignored(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck, emb = _copy(tiny_ckpt, tmp_path), "model.word_embeddings.weight"
    extra = ["model.layers.6.shared_head.head.weight", "model.layers.6.embed_tokens.weight"]
    _edit_shard(ck, emb, lambda t: t.update({k: t[emb].clone() for k in extra}))
    _edit_index(ck, lambda m: m.update({k: m[emb] for k in extra}))
    lingc.load(ck)
    # ... but only on MTP layers: a decoder layer with such a key is a different model
    bad = "model.layers.2.shared_head.head.weight"
    _edit_shard(ck, emb, lambda t: t.update({bad: t[emb].clone()}))
    _edit_index(ck, lambda m: m.update({bad: m[emb]}))
    assert f"unexpected tensor '{bad}'" in _load_fails(ck)


# ---- errors -------------------------------------------------------------------------------

def test_missing_tensor(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck, key = _copy(tiny_ckpt, tmp_path), "model.layers.1.mlp.experts.3.up_proj.weight"
    fname = _edit_shard(ck, key, lambda t: t.pop(key))
    msg = _load_fails(ck)                                                  # the index still lists it
    assert f"'{key}'" in msg and fname in msg
    _edit_index(ck, lambda m: m.pop(key))
    msg = _load_fails(ck)
    assert "missing 1 tensor" in msg and f"'{key}' [64, 128]" in msg


def test_unexpected_tensor(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck, key, new = _copy(tiny_ckpt, tmp_path), "model.norm.weight", "model.layers.0.attention.q_a_proj.weight"
    fname = _edit_shard(ck, key, lambda t: t.update({new: torch.zeros(48, 128, dtype=torch.bfloat16)}))
    msg = _load_fails(ck)                                                  # in the shard, not in the index
    assert f"unexpected tensor '{new}'" in msg and fname in msg
    _edit_index(ck, lambda m: m.update({new: fname}))
    msg = _load_fails(ck)
    assert f"unexpected tensor '{new}'" in msg and fname in msg


@pytest.mark.parametrize("key,shape", [
    ("model.layers.0.attention.o_proj.weight", (128, 64)),
    ("model.layers.3.attention.kv_b_proj.weight", (64, 256)),            # transposed
    ("model.layers.0.attention.q_conv1d.weight", (128, 4)),              # [P, W] instead of [P, 1, W]
    ("model.layers.0.attention.A_log", (1, 1, 4, 1)),                    # Kimi-Linear layout
])
def test_wrong_shape(tiny_ckpt: Path, tmp_path: Path, key: str, shape: tuple[int, ...]) -> None:
    ck = _copy(tiny_ckpt, tmp_path)
    want = [s.shape for s in checkpoint_layout(preset("test-tiny")) if s.key == key][0]

    def reshape(t: dict[str, torch.Tensor]) -> None:
        same = t[key].numel() == torch.Size(shape).numel()
        t[key] = t[key].reshape(shape) if same else torch.zeros(shape, dtype=t[key].dtype)

    fname = _edit_shard(ck, key, reshape)
    msg = _load_fails(ck)
    assert f"'{key}'" in msg and fname in msg and str(list(shape)) in msg and str(list(want)) in msg, msg


def test_int8_tensor(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck, key = _copy(tiny_ckpt, tmp_path), "model.layers.4.attention.dense.weight"
    fname = _edit_shard(ck, key, lambda t: t.update({key: torch.zeros(t[key].shape, dtype=torch.int8)}))
    msg = _load_fails(ck)
    assert f"'{key}'" in msg and fname in msg and "dtype I8" in msg


def test_index_names_missing_shard(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck = _copy(tiny_ckpt, tmp_path)
    shard = sorted(set(_index(ck).values()))[-1]
    (ck / shard).unlink()
    assert shard in _load_fails(ck)


def test_truncated_shard(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck = _copy(tiny_ckpt, tmp_path)
    shard = ck / sorted(set(_index(ck).values()))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert shard.name in _load_fails(ck)


def test_no_safetensors(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(tiny_ckpt / "config.json", ck)
    assert "no model.safetensors.index.json and no model.safetensors" in _load_fails(ck)
    shutil.copy(next(tiny_ckpt.glob("model-*.safetensors")), ck)           # shards without their index
    assert "without an index" in _load_fails(ck)


def test_missing_or_bad_config(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck = _copy(tiny_ckpt, tmp_path)
    assert _load_fails(ck / "config.json").endswith("not a directory (a checkpoint is a directory with "
                                                    "config.json and *.safetensors)")
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(cfg | {"architectures": ["BailingMoeV2ForCausalLM"]}))
    assert "'architectures'" in _load_fails(ck, ConfigError)
    (ck / "config.json").write_text(json.dumps(cfg | {"num_experts": 32}))   # valid config, other checkpoint
    assert "expert_bias' has shape [16], want [32]" in _load_fails(ck)
    (ck / "config.json").unlink()
    assert "config.json" in _load_fails(ck)


def test_checkpoint_tensors_single_file(tiny_ckpt: Path, tmp_path: Path) -> None:
    single = write_random_checkpoint(preset("test-tiny"), tmp_path, seed=0, shard_bytes=0)
    a, b = checkpoint_tensors(single), checkpoint_tensors(tiny_ckpt)
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


# ---- memory -------------------------------------------------------------------------------

MEMORY_SCRIPT = textwrap.dedent("""
    import sys, torch, lingc
    def status(field):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))
    lingc.load(sys.argv[2])                              # warm up lazy imports and allocator pools
    open("/proc/self/clear_refs", "w").write("5")        # reset VmHWM (peak RSS) to the current RSS
    base = status("VmRSS")
    model = lingc.load(sys.argv[1], dtype=torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(nbytes, status("VmHWM") - base)
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_load_streams(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Peak RSS while loading stays near the model's size: no whole-file or whole-shard copies.

    Single file is the worst case: reading through an mmap of it (safe_open) peaked at 2.26x."""
    cfg = preset("test-tiny", hidden_size=512, intermediate_size=1024, num_experts=32, moe_intermediate_size=256,
                 moe_shared_expert_intermediate_size=256)
    ck = write_random_checkpoint(cfg, tmp_path, seed=0, shard_bytes=0)
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(ck), str(tiny_ckpt)],
                         capture_output=True, text=True, check=True).stdout.split()
    nbytes, peak = int(out[0]), int(out[1])
    assert nbytes > 100e6
    assert peak < 1.6 * nbytes, f"peak RSS growth {peak / 1e6:.0f} MB for a {nbytes / 1e6:.0f} MB model"


def test_random_model_equals_loaded_random_checkpoint(tiny_ckpt: Path, tiny_model_fp32: lingc.LingForCausalLM) -> None:
    """lingc.init.random_model draws in place exactly the weights `lingc init` writes (the GPU benchmark's path)."""
    from lingc.init import random_model
    drawn = random_model(tiny_model_fp32.config, seed=0, dtype=torch.float32)
    want = dict(tiny_model_fp32.named_parameters())
    got = dict(drawn.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert got[name].dtype == p.dtype and torch.equal(got[name], p), name
