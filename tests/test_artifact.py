"""Artifacts: the manifest, bit-exact reload, refusal of tampered or foreign dirs, atomic writes, greedy parity."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import lingc
import lingc.artifact
from lingc.artifact import FORMAT, FORMAT_VERSION, MANIFEST, ArtifactError, load_artifact, read_manifest, write_artifact
from lingc.compile import compile_checkpoint
from lingc.passes import PASSES as REGISTRY
from lingc.passes.manager import CompileResult
from lingc.passes.verify import random_inputs
from lingc.runtime.engine import Engine, EngineError, Request
from lingc.trace import TraceOptions

OPTIONS = TraceOptions(max_len=48, prefill_tokens=16)
PASSES = ["fuse_swiglu", "bf16_router", "pdl"]
EXACT_PASSES = [name for name, p in REGISTRY.items() if not p.changes_numerics]   # partition included
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt")


@pytest.fixture(scope="module")
def compiled(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CompileResult]:
    """tiny_ckpt compiled once (fp32, every program) with fuse_swiglu,bf16_router,pdl. Treat it as read-only."""
    out = tmp_path_factory.mktemp("artifact") / "art"
    result = compile_checkpoint(tiny_ckpt, out, PASSES, dtype="fp32", options=OPTIONS)
    return out, result


@pytest.fixture(scope="module")
def exact_program(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> lingc.program.Program:
    """Every program compiled (fp32) with the numerics-preserving passes only, partition included, loaded back
    from disk. max_len 64: the engine keeps 2 x draft_tokens of margin, so a request may hold 52 tokens."""
    out = tmp_path_factory.mktemp("artifact_exact") / "art"
    compile_checkpoint(tiny_ckpt, out, EXACT_PASSES, dtype="fp32", options=TraceOptions(max_len=64, prefill_tokens=16))
    return load_artifact(out).program


def _copy(compiled: tuple[Path, CompileResult], tmp_path: Path) -> Path:
    return Path(shutil.copytree(compiled[0], tmp_path / "art"))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _edit_manifest(art: Path, edit) -> None:
    manifest = json.loads((art / MANIFEST).read_text())
    edit(manifest)
    (art / MANIFEST).write_text(json.dumps(manifest, indent=1))


# -- the manifest ---------------------------------------------------------------------------------------------


def test_manifest_lists_config_programs_passes_stages(compiled):
    out, result = compiled
    m = read_manifest(out).manifest
    assert m["format"] == FORMAT and m["format_version"] == FORMAT_VERSION
    assert m["config"] == result.program.config.to_dict()
    assert m["config"]["hidden_size"] == 128
    assert m["options"]["max_len"] == 48 and m["options"]["prefill_tokens"] == 16 and m["options"]["dtype"] == "float32"
    assert set(m["programs"]) == {"prefill", "decode", "mtp_prefill", "mtp_decode", "step", "nextn"}
    assert all(m["programs"][g]["file"] == f"graphs/{g}.json" for g in m["programs"])
    assert [(r["name"], r["changes_numerics"]) for r in m["passes"]] == \
        [("fuse_swiglu", False), ("bf16_router", True), ("pdl", False)]
    assert all(r["version"] and r["op_counts_before"] and r["op_counts_after"] for r in m["passes"])
    assert [(s["index"], s["name"], s["file"]) for s in m["stages"]] == [
        (0, "traced", "trace/00-traced.txt"), (1, "fuse_swiglu", "trace/01-fuse_swiglu.txt"),
        (2, "bf16_router", "trace/02-bf16_router.txt"), (3, "pdl", "trace/03-pdl.txt")]
    assert m["weights"]["files"] == ["weights/rank0-00000.safetensors"]
    assert set(m["weights"]["tensors"]) == set(result.program.weights)


def test_manifest_hashes_every_file(compiled):
    out, _ = compiled
    m = read_manifest(out).manifest
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(m["files"]) == on_disk
    for rel, digest in m["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == digest, rel


def test_stage_text_is_the_compiled_snapshot(compiled):
    out, result = compiled
    art = read_manifest(out)
    assert [art.stage_text(i) for i in range(len(result.stages))] == [s.text for s in result.stages]


def test_artifact_holds_no_pickle(compiled):
    out, _ = compiled
    for p in out.rglob("*"):
        if p.is_file():
            head = p.read_bytes()[:2]
            assert not p.name.endswith(PICKLE_SUFFIXES), p
            assert head[:1] != b"\x80" and head != b"PK", f"{p} looks like a pickle / torch.save zip"


# -- loading --------------------------------------------------------------------------------------------------


def test_load_is_bit_exact_on_every_graph(compiled):
    out, result = compiled
    loaded = load_artifact(out).program
    assert set(loaded.graphs) == set(result.program.graphs)
    assert loaded.options == result.program.options
    for name in sorted(loaded.graphs):
        mem_inputs, disk_inputs = random_inputs(result.program, name), random_inputs(loaded, name)
        assert list(mem_inputs) == list(disk_inputs)
        mem_out, disk_out = result.program.run(name, mem_inputs), loaded.run(name, disk_inputs)
        assert len(mem_out) == len(disk_out)
        for i, (x, y) in enumerate(zip(mem_out, disk_out)):
            if x is None:                                   # engine steps return nothing; their relays are below
                assert y is None and name in ("step", "nextn"), f"{name} output[{i}]"
                continue
            assert x.dtype == y.dtype and torch.equal(x, y), f"{name} output[{i}]"
        for key in mem_inputs:                              # state inputs are updated in place
            assert torch.equal(mem_inputs[key], disk_inputs[key]), f"{name} {key}"


def test_load_never_unpickles(compiled, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load_artifact must not unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    art = load_artifact(compiled[0])
    assert set(art.program.weights) == set(compiled[1].program.weights)


# -- refusals -------------------------------------------------------------------------------------------------


def test_modified_weight_byte_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    weights = art / "weights/rank0-00000.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    for reader in (read_manifest, load_artifact):
        with pytest.raises(ArtifactError, match=r"weights/rank0-00000\.safetensors does not match its sha256"):
            reader(art)


def test_unknown_op_is_refused_even_with_a_matching_hash(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    graph = art / "graphs/decode.json"
    text = graph.read_text()
    assert '"target": "lingc.moe_down"' in text
    graph.write_text(text.replace('"target": "lingc.moe_down"', '"target": "os.system"', 1))
    _edit_manifest(art, lambda m: m["files"].__setitem__("graphs/decode.json", lingc.artifact.sha256_file(graph)))
    read_manifest(art)                                      # hashes agree now; only the op is wrong
    with pytest.raises(ArtifactError, match=r"graphs/decode\.json.*unknown op 'os\.system'.*allowlist"):
        load_artifact(art)


def test_graph_file_outside_the_hashes_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    _edit_manifest(art, lambda m: m["files"].pop("graphs/decode.json"))
    with pytest.raises(ArtifactError, match=r"graphs/decode\.json is not covered by the manifest's hashes"):
        load_artifact(art)


def test_malformed_graph_json_is_an_artifact_error(compiled, tmp_path):
    """Regression: a graph file that is not JSON (hash updated to match) raised a bare JSONDecodeError."""
    art = _copy(compiled, tmp_path)
    graph = art / "graphs/decode.json"
    graph.write_text("{ not json")
    _edit_manifest(art, lambda m: m["files"].__setitem__("graphs/decode.json", lingc.artifact.sha256_file(graph)))
    with pytest.raises(ArtifactError, match=r"graphs/decode\.json"):
        load_artifact(art)


def test_missing_trace_file_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    (art / "trace/01-fuse_swiglu.txt").unlink()
    with pytest.raises(ArtifactError, match=r"file trace/01-fuse_swiglu\.txt listed in the manifest is missing"):
        read_manifest(art)


@pytest.mark.parametrize("entry", ["../outside.txt", "graphs/../../outside.txt"], ids=["dotdot", "nested-dotdot"])
def test_manifest_entry_outside_the_artifact_is_refused(compiled, tmp_path, entry):
    art = _copy(compiled, tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the artifact")
    _edit_manifest(art, lambda m: m["files"].__setitem__(entry, lingc.artifact.sha256_file(outside)))
    with pytest.raises(ArtifactError, match=r"points outside the artifact"):
        read_manifest(art)


def test_absolute_manifest_entry_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    _edit_manifest(art, lambda m: m["files"].__setitem__(str(outside), lingc.artifact.sha256_file(outside)))
    with pytest.raises(ArtifactError, match=r"points outside the artifact"):
        read_manifest(art)


def test_non_artifact_dirs_are_refused(tiny_ckpt, tmp_path):
    for path in (tiny_ckpt, tmp_path, tmp_path / "does-not-exist"):
        with pytest.raises(ArtifactError, match=r"no manifest\.json; not a lingc artifact"):
            load_artifact(path)


@pytest.mark.parametrize("key, value, message", [
    ("format_version", 99, r"format_version 99, this lingc reads 1"),
    ("format", "something-else", r"format is 'something-else', want 'lingc-artifact'"),
], ids=["version", "format"])
def test_wrong_format_is_refused(compiled, tmp_path, key, value, message):
    art = _copy(compiled, tmp_path)
    _edit_manifest(art, lambda m: m.__setitem__(key, value))
    with pytest.raises(ArtifactError, match=message):
        read_manifest(art)


def test_manifest_that_is_not_json_is_refused(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    (art / MANIFEST).write_text("{")
    with pytest.raises(ArtifactError, match=r"manifest\.json: not valid JSON"):
        read_manifest(art)


# -- writing --------------------------------------------------------------------------------------------------


def test_failed_write_leaves_the_old_artifact_intact(compiled, tmp_path, monkeypatch):
    """Regression (the .partial part): a failed write left `<out>.partial` behind, as big as the artifact."""
    art = _copy(compiled, tmp_path)
    before = _snapshot(art)

    def broken_save_file(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(lingc.artifact, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        write_artifact(compiled[1], art)
    assert _snapshot(art) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"], "a failed write left a partial directory behind"
    load_artifact(art)


def test_rewrite_replaces_an_existing_artifact(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    (art / "trace/stale.txt").write_text("from an older compile")
    write_artifact(compiled[1], art)
    assert not (art / "trace/stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    load_artifact(art)


def test_write_refuses_a_non_artifact_directory(compiled, tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match=r"mine: exists, is not empty and is not a lingc artifact"):
        write_artifact(compiled[1], target)
    assert _snapshot(target) == {"notes.txt": b"keep me"}


def test_write_without_force_refuses_an_existing_artifact(compiled, tmp_path):
    art = _copy(compiled, tmp_path)
    with pytest.raises(ArtifactError, match="already exists"):
        write_artifact(compiled[1], art, force=False)


# -- greedy generation from the artifact ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["nextn", "none"])
@pytest.mark.parametrize("prompt_len", [5, 16, 23], ids=["short", "one-chunk", "chunk-plus-tail"])
def test_greedy_from_artifact_matches_reference(exact_program, tiny_model_fp32, prompt_len, spec):
    """The engine on the loaded artifact (NEXTN speculation, or plain decode) gives model.generate's tokens."""
    prompt = [(7 * i + 3) % 500 for i in range(prompt_len)]
    result = Engine(exact_program, spec=spec).generate(Request(prompt, 20, ignore_eos=True))
    reference = tiny_model_fp32.generate(torch.tensor([prompt]), 20)[0].tolist()
    assert result.tokens == reference and result.finish_reason == "length"
    lens = result.accept_lens                                       # tokens each decode step emitted (the last
    assert sum(lens[:-1]) < 20 - 1 <= sum(lens)                     # one trimmed); the first came from the prefill
    assert all(1 <= n <= (exact_program.options["draft_tokens"] if spec == "nextn" else 1) for n in result.accept_lens)


def test_greedy_refuses_more_than_max_len(exact_program):
    engine = Engine(exact_program, spec="none")
    with pytest.raises(EngineError, match=r"prompt \(30\) \+ max_new_tokens \(23\) exceeds the artifact's context 52 "
                                          r"\(max_len 64 minus 2 x draft_tokens\)"):
        engine.generate(Request(list(range(30)), 23))
    with pytest.raises(EngineError, match="the prompt is empty"):
        engine.generate(Request([], 5))
    assert engine.generate(Request(list(range(30)), 22, ignore_eos=True)).finish_reason == "length"   # fits


def test_compile_copies_and_hashes_the_chat_template_file(tiny_ckpt, tmp_path):
    """transformers' newer checkpoints keep the chat template in chat_template.jinja; `lingc serve` reads it from
    the artifact, so compile copies it (and lists it in the manifest's hashes) like tokenizer.json."""
    from lingc.artifact import read_manifest
    from lingc.compile import compile_checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    compile_checkpoint(ckpt, tmp_path / "art", ["partition"], programs=["decode"])
    assert (tmp_path / "art" / "chat_template.jinja").read_text() == (ckpt / "chat_template.jinja").read_text()
    assert "chat_template.jinja" in json.dumps(read_manifest(tmp_path / "art").manifest)
