"""Artifacts: a compiled Program on disk as JSON + safetensors, with a manifest of hashes.

    art/manifest.json          config, options, programs, pass records, stages, sha256 of every file
    art/graphs/<program>.json  the JSON IR (lingc.ir.serialize)
    art/weights/rank<r>-*.safetensors  weights, one file set per TP rank (rank0 only when tp = 1)
    art/trace/NN-<pass>.txt    the readable program after each stage (00 = traced)

Writing goes to a temporary sibling directory renamed into place at the end, so a failed compile
never leaves a half-written or mixed artifact. Reading checks the format, every file's hash and every
op against the allowlist; it never unpickles or executes anything from the artifact.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lingc.config import LingConfig
from lingc.ir.lint import LintError, lint
from lingc.ir.serialize import IRError, graph_from_json, graph_to_json
from lingc.program import Program

FORMAT = "lingc-artifact"
FORMAT_VERSION = 1          # what a tp = 1 artifact is written as (unchanged since version 1)
TP_FORMAT_VERSION = 2       # tp > 1: adds weights.ranks (one file set per rank); version-1 readers refuse it
READ_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
WEIGHT_SHARD_BYTES = 2 * 2**30


class ArtifactError(ValueError):
    """An artifact lingc refuses to read: missing file, bad hash, unknown op, wrong format."""


@dataclass
class Artifact:
    path: Path
    manifest: dict[str, Any]
    program: Program | None = None

    def stage_text(self, index: int) -> str:
        stage = self.manifest["stages"][index]
        return (self.path / stage["file"]).read_text()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_weights(weights: dict[str, torch.Tensor], root: Path, rank: int = 0) -> list[str]:
    (root / "weights").mkdir(exist_ok=True)
    files, shard, size = [], {}, 0

    def flush() -> None:
        nonlocal shard, size
        name = f"weights/rank{rank}-{len(files):05d}.safetensors"
        save_file(shard, root / name, metadata={"format": "pt"})
        files.append(name)
        shard, size = {}, 0

    for key in sorted(weights):
        t = weights[key].detach().to("cpu").contiguous()
        if shard and size + t.numel() * t.element_size() > WEIGHT_SHARD_BYTES:
            flush()
        shard[key] = t.clone() if any(t.data_ptr() == s.data_ptr() for s in shard.values()) else t
        size += t.numel() * t.element_size()
    if shard or not files:
        flush()
    return files


def _is_artifact(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def write_artifact(result: Any, out: str | Path, source: str = "", force: bool = True,
                   extra_files: list[Path] = (), rank_weights: list[dict[str, torch.Tensor]] | None = None) -> Path:
    """Write a CompileResult (program + stages) to `out` atomically; returns the path.

    rank_weights (compile --tp N): every rank's weights, rank 0's being the program's; one file set each."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not _is_artifact(out):
        raise ArtifactError(f"{out}: exists, is not empty and is not a lingc artifact; refusing to overwrite it")
    if out.exists() and not force:
        raise ArtifactError(f"{out}: already exists")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in extra_files:                          # tokenizer files travel with the artifact, hashed
            shutil.copyfile(f, tmp / f.name)
        _write_into(result, tmp, source, rank_weights)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)       # a failed write leaves nothing behind, not even the .partial
        raise
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out


def _write_into(result: Any, tmp: Path, source: str, rank_weights: list | None = None) -> None:
    """Write graphs, trace snapshots, weights and the manifest into the (empty) directory `tmp`."""
    program: Program = result.program
    (tmp / "graphs").mkdir()
    programs = {}
    for name, graph in program.graphs.items():
        rel = f"graphs/{name}.json"
        (tmp / rel).write_text(json.dumps({"name": name, "nodes": graph_to_json(graph)}, indent=1))
        programs[name] = {"file": rel}
    (tmp / "trace").mkdir()
    stages = []
    for stage in result.stages:
        rel = f"trace/{stage.index:02d}-{stage.name}.txt"
        (tmp / rel).write_text(stage.text)
        stages.append({"index": stage.index, "name": stage.name, "file": rel})
    ranks = rank_weights or [program.weights]
    tp = len(ranks)
    if tp != int(program.options.get("tp", 1)):
        raise ArtifactError(f"{len(ranks)} weight sets for a program sharded for {program.options.get('tp', 1)} ranks")
    rank_files = [_write_weights(ws, tmp, r) for r, ws in enumerate(ranks)]
    weight_files = rank_files[0]
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION if tp == 1 else TP_FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source, "command": " ".join(sys.argv[1:]) if sys.argv else "",
        "config": program.config.to_dict(), "options": program.options, "tp": tp,
        "programs": programs,
        "weights": {"files": weight_files, **({"ranks": rank_files} if tp > 1 else {}), "info": program.weight_info,
                    "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                                for k, v in sorted(program.weights.items())}},
        "passes": [r.to_json() for r in result.records],
        "stages": stages,
        "files": {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def read_manifest(path: str | Path, check_hashes: bool = True, rank: int | None = None) -> Artifact:
    """Read and check manifest.json (format, files present, hashes); loads no graph or weight.
    With `rank`, other ranks' weight files are checked for presence but not hashed (each rank hashes its own)."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.exists():
        raise ArtifactError(f"{path}: no {MANIFEST}; not a lingc artifact (make one with `lingc compile`)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mf}: not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{mf}: format is {manifest.get('format')!r}, want {FORMAT!r}")
    if manifest.get("format_version") not in READ_VERSIONS:
        raise ArtifactError(f"{mf}: format_version {manifest.get('format_version')}, this lingc reads "
                            f"{' and '.join(map(str, READ_VERSIONS))}")
    tp = manifest.get("tp", 1)
    ranks = manifest.get("weights", {}).get("ranks") if isinstance(manifest.get("weights"), dict) else None
    if not isinstance(tp, int) or tp < 1 or (tp > 1 and (not isinstance(ranks, list) or len(ranks) != tp)):
        raise ArtifactError(f"{mf}: tp is {tp!r} but weights.ranks lists "
                            f"{len(ranks) if isinstance(ranks, list) else 'no'} weight sets")
    if manifest.get("format_version") == FORMAT_VERSION and tp != 1:
        raise ArtifactError(f"{mf}: format_version {FORMAT_VERSION} artifacts have one rank, this one says tp {tp}")
    others = {f for r, files in enumerate(ranks or []) if r != rank for f in files} if rank is not None else set()
    for rel, digest in manifest.get("files", {}).items():
        f = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ArtifactError(f"{mf}: file entry {rel!r} points outside the artifact")
        if not f.exists():
            raise ArtifactError(f"{path}: file {rel} listed in the manifest is missing")
        if check_hashes and rel not in others and sha256_file(f) != digest:
            raise ArtifactError(f"{path}: file {rel} does not match its sha256 in the manifest (modified or corrupt)")
    return Artifact(path, manifest)


def load_artifact(path: str | Path, device: str | torch.device = "cpu", check_hashes: bool = True,
                  rank: int = 0) -> Artifact:
    """Read an artifact fully: manifest, graphs (allowlisted ops only) and the weights of TP rank `rank`
    (a tp > 1 artifact's graphs need all its ranks running: lingc.runtime.tp)."""
    art = read_manifest(path, check_hashes, rank=rank)
    m = art.manifest
    tp = m.get("tp", 1)
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise ArtifactError(f"{art.path}: rank {rank} does not exist; the artifact has {tp} TP rank(s)")
    listed = set(m.get("files", {}))
    config = LingConfig.from_dict(m["config"], source=str(art.path / MANIFEST))
    graphs = {}
    for name, entry in m["programs"].items():
        if entry["file"] not in listed:
            raise ArtifactError(f"{art.path}: graph file {entry['file']} is not covered by the manifest's hashes")
        try:
            nodes = json.loads((art.path / entry["file"]).read_text())["nodes"]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise ArtifactError(f"{art.path / entry['file']}: not a lingc graph file (want a JSON object with "
                                f"'nodes'; {type(e).__name__}: {e})") from None
        try:
            graphs[name] = graph_from_json(nodes, name)
        except IRError as e:
            raise ArtifactError(f"{art.path / entry['file']}: {e}") from None
    weights: dict[str, torch.Tensor] = {}
    for rel in (m["weights"]["ranks"][rank] if tp > 1 else m["weights"]["files"]):
        if rel not in listed:
            raise ArtifactError(f"{art.path}: weight file {rel} is not covered by the manifest's hashes")
        with safe_open(art.path / rel, framework="pt", device=str(device)) as f:
            for key in f.keys():
                t = f.get_tensor(key)
                # safetensors places tensors at 8-byte offsets; CPU BLAS picks its kernel (and its rounding) by
                # alignment, so a reloaded program keeps its bits only on the allocator's 64-byte alignment
                weights[key] = t.clone() if t.device.type == "cpu" and t.data_ptr() % 64 else t
    wanted = m["weights"]["tensors"]
    if set(wanted) != set(weights):
        raise ArtifactError(f"{art.path}: weights on disk {sorted(set(weights) ^ set(wanted))[:5]} "
                            "disagree with the manifest")
    art.program = Program(config, graphs, weights, m["weights"].get("info", {}), m.get("options", {}))
    try:
        lint(art.program)
    except LintError as e:
        raise ArtifactError(f"{art.path}: {e}") from None
    return art
