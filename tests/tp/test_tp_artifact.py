"""TP artifacts: format version 2 with one weight set per rank, rank-scoped loading and hashing, refusal of
inconsistent manifests, a tp = 1 artifact unchanged (version 1), and a rank's program run alone refusing to
compute partial sums."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lingc.artifact import (FORMAT_VERSION, MANIFEST, TP_FORMAT_VERSION, ArtifactError, load_artifact,
                            read_manifest)
from lingc.diff import pass_diff
from lingc.runtime.engine import Engine, Request


def test_manifest_lists_one_weight_set_per_rank(tp_artifacts):
    m2 = read_manifest(tp_artifacts[2]).manifest
    assert m2["format_version"] == TP_FORMAT_VERSION == 2 and m2["tp"] == 2 and m2["options"]["tp"] == 2
    assert m2["weights"]["ranks"] == [["weights/rank0-00000.safetensors"], ["weights/rank1-00000.safetensors"]]
    assert m2["weights"]["files"] == m2["weights"]["ranks"][0]
    assert {f for files in m2["weights"]["ranks"] for f in files} <= set(m2["files"])        # every rank hashed
    assert [s["name"] for s in m2["stages"][-2:]] == [p["name"] for p in m2["passes"][-2:]] == ["tp", "fuse_all_reduce_norm"]
    assert m2["weights"]["info"]["lm_head.weight"]["tp"] == {"rule": "rows"}
    assert len(read_manifest(tp_artifacts[4]).manifest["weights"]["ranks"]) == 4
    m1 = read_manifest(tp_artifacts[1]).manifest
    assert m1["format_version"] == FORMAT_VERSION == 1 and m1["tp"] == 1 and "ranks" not in m1["weights"]


def test_each_rank_loads_its_own_weights(tp_artifacts):
    ranks = [load_artifact(tp_artifacts[4], rank=r).program for r in range(4)]
    lm = torch.cat([p.weights["lm_head.weight"] for p in ranks])
    full = load_artifact(tp_artifacts[1]).program.weights["lm_head.weight"]
    assert torch.equal(lm, full)
    assert [p.weights["model.layers.1.mlp.experts.expert_map"].tolist()[4 * r] for r, p in enumerate(ranks)] == [0] * 4
    assert all(p.options["tp"] == 4 for p in ranks)
    with pytest.raises(ArtifactError, match=r"rank 4 does not exist; the artifact has 4 TP rank\(s\)"):
        load_artifact(tp_artifacts[4], rank=4)
    with pytest.raises(ArtifactError, match=r"rank 1 does not exist; the artifact has 1 TP rank"):
        load_artifact(tp_artifacts[1], rank=1)


def test_a_tampered_rank_file_is_caught_by_that_rank(tp_artifacts, tmp_path):
    art = shutil.copytree(tp_artifacts[2], tmp_path / "art")
    f = art / "weights/rank1-00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    load_artifact(art, rank=0)                        # rank 0 hashes only its own weights (and the rest)
    with pytest.raises(ArtifactError, match=r"weights/rank1-00000\.safetensors does not match its sha256"):
        load_artifact(art, rank=1)
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        read_manifest(art)                            # no rank given: every file


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(tp=4), r"tp is 4 but weights.ranks lists 2 weight sets"),
    (lambda m: m["weights"].pop("ranks"), r"tp is 2 but weights.ranks lists no weight sets"),
    (lambda m: m.update(format_version=1), r"format_version 1 artifacts have one rank, this one says tp 2"),
    (lambda m: m.update(format_version=99), r"format_version 99, this lingc reads 1 and 2"),
])
def test_inconsistent_tp_manifests_are_refused(tp_artifacts, tmp_path, edit, message):
    art = shutil.copytree(tp_artifacts[2], tmp_path / "art")
    manifest = json.loads((art / MANIFEST).read_text())
    edit(manifest)
    (art / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=message):
        read_manifest(art, check_hashes=False)


def test_a_rank_run_alone_refuses_instead_of_computing_partial_sums(tp_artifacts):
    program = load_artifact(tp_artifacts[2], rank=0).program
    with pytest.raises(RuntimeError, match=r"compiled for 2 tensor-parallel ranks.*open_tp_session"):
        Engine(program, spec="none").generate(Request([1, 2, 3], 2))


def test_diff_shows_the_tp_stage(tp_artifacts):
    d = pass_diff(read_manifest(tp_artifacts[2]), "tp", "decode", 1)
    assert "+    L0_attention_o_proj_linear_all_reduce = lingc.all_reduce(L0_attention_o_proj_linear, 2)" in d.diff
    assert d.op_counts["decode"]["lingc.all_reduce"] == (0, 12)
    assert d.op_counts["decode"]["lingc.all_gather"] == (0, 1)
