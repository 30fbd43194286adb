"""lingc draft-vocab / lingc.token_map: the draft_vocab token map counted from a corpus.

Against counts made by hand on a WordLevel tokenizer (one id a word): the N most frequent ids with ties to the
lower id, eos and special tokens always kept, sorted; the coverage; .jsonl "text" and "messages" rows; every bad
input fails with a message naming the file, line or value; the CLI writes a file that the compile path's own
check accepts, and a failed run leaves no file behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from lingc.cli import app
from lingc.config import LingConfig
from lingc.passes.draft_vocab import check_token_map
from lingc.token_map import TokenMapError, build_token_map, hot_ids, read_token_map, write_token_map

EOS = 511


@pytest.fixture(scope="module")
def ck(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json of test-tiny (vocab 512) with eos 511, and a WordLevel tokenizer: "w0".."w509" are ids 0..509,
    "<pad>" 510, "<eos>" 511 (a special token); unknown words are w0."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    root = tmp_path_factory.mktemp("token_map_ck")
    config = json.loads((tiny_ckpt / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(config | {"eos_token_id": EOS}))
    vocab = {f"w{i}": i for i in range(510)} | {"<pad>": 510, "<eos>": 511}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    tok.save(str(root / "tokenizer.json"))
    assert LingConfig.from_json(root / "config.json").vocab_size == 512
    return root


def _text(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return path


def test_hot_ids_take_the_most_frequent_ties_to_the_lower_id():
    counts = np.array([5, 0, 7, 5, 1, 5, 0])
    assert hot_ids(counts, 3) == [0, 2, 3]                  # 7, then the 5s by id: 0, 3 (5 left out)
    assert hot_ids(counts, 3, keep=[6]) == [0, 2, 6]        # kept first, whatever its count
    assert hot_ids(counts, 10) == [0, 2, 3, 4, 5]           # never an id that does not occur
    with pytest.raises(TokenMapError, match="smaller than the 2 ids always kept"):
        hot_ids(counts, 1, keep=[1, 6])


def test_map_and_coverage_match_counts_by_hand(ck: Path, tmp_path: Path):
    # w7 x4, w3 x3, w9 x3, w1 x1, <eos> x1: 12 tokens
    corpus = _text(tmp_path, "c.txt", "w7 w3 w9 w7\n\nw3 w9 w7 w1\nw7 w3 w9 <eos>\n")
    tm = build_token_map(ck, [corpus], 3)
    assert tm.ids == [3, 7, EOS]                            # eos kept; then w7 (4), w3 (3, lower id than w9)
    assert (tm.corpus_tokens, tm.covered_tokens, tm.distinct, tm.out_of_vocab) == (12, 8, 5, 0)
    assert tm.coverage == pytest.approx(8 / 12)
    assert tm.kept == [EOS]


def test_jsonl_rows_give_text_and_message_contents(ck: Path, tmp_path: Path):
    rows = [{"text": "w5 w5 w6"}, {"messages": [{"role": "user", "content": "w6 w6"},
                                                {"role": "assistant", "content": "w8"}]}, {"text": ""}]
    corpus = _text(tmp_path, "c.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    tm = build_token_map(ck, [corpus], 2)
    assert tm.corpus_tokens == 6
    assert tm.ids == [6, EOS]                               # w6 x3 beats w5 x2


def test_sharegpt_json_and_conversations_rows(ck: Path, tmp_path: Path):
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "w3 w3"}, {"from": "gpt", "value": "w4"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "w3"}]}]
    tm = build_token_map(ck, [_text(tmp_path, "share.json", json.dumps(rows))], 2)
    assert tm.ids == [3, EOS] and tm.corpus_tokens == 4
    line = json.dumps(rows[0]) + "\n"
    assert build_token_map(ck, [_text(tmp_path, "share.jsonl", line)], 3).ids == [3, 4, EOS]


def test_several_files_are_counted_together(ck: Path, tmp_path: Path):
    a = _text(tmp_path, "a.txt", "w2 w2\n")
    b = _text(tmp_path, "b.jsonl", json.dumps({"text": "w4 w4 w4"}) + "\n")
    tm = build_token_map(ck, [a, b], 3)
    assert tm.ids == [2, 4, EOS] and tm.corpus_tokens == 5


@pytest.mark.parametrize("case, needle", [
    ("size0", "--size 0: want 1 .. 512"),
    ("size_big", "--size 513: want 1 .. 512"),
    ("no_tokenizer", "tokenizer.json: not found"),
    ("bad_tokenizer", "tokenizer.json: cannot load the tokenizer"),
    ("no_corpus", "no corpus"),
    ("missing_file", "corpus file not found: "),
    ("bad_jsonl", "c.jsonl:2: not a JSON object"),
    ("jsonl_no_text", "c.jsonl:1: want an object with a \"text\" string"),
    ("json_not_list", "c.json: want a JSON list of rows, got a dict"),
    ("json_bad", "c.json: not a JSON document"),
    ("not_utf8", "c.txt: not UTF-8 text"),
    ("empty", "has no text to count"),
])
def test_bad_input_names_the_problem(ck: Path, tmp_path: Path, case: str, needle: str):
    root, size = ck, 4
    corpus = [_text(tmp_path, "c.txt", "w1 w2\n")]
    if case == "size0":
        size = 0
    elif case == "size_big":
        size = 513
    elif case in ("no_tokenizer", "bad_tokenizer"):
        root = tmp_path / "ck"
        root.mkdir()
        shutil.copy(ck / "config.json", root / "config.json")
        if case == "bad_tokenizer":
            (root / "tokenizer.json").write_text("{not json")
    elif case == "no_corpus":
        corpus = []
    elif case == "missing_file":
        corpus = [tmp_path / "nope.txt"]
    elif case == "bad_jsonl":
        corpus = [_text(tmp_path, "c.jsonl", json.dumps({"text": "w1"}) + "\n{oops\n")]
    elif case == "jsonl_no_text":
        corpus = [_text(tmp_path, "c.jsonl", json.dumps({"prompt": "w1"}) + "\n")]
    elif case == "json_not_list":
        corpus = [_text(tmp_path, "c.json", json.dumps({"text": "w1"}))]
    elif case == "json_bad":
        corpus = [_text(tmp_path, "c.json", "[{")]
    elif case == "not_utf8":
        (tmp_path / "c.txt").write_bytes(b"w1 \xff\xfe w2\n")
    elif case == "empty":
        corpus = [_text(tmp_path, "c.txt", "\n \n")]
    with pytest.raises(TokenMapError) as info:
        build_token_map(root, corpus, size)
    assert needle in str(info.value), str(info.value)


def test_cli_writes_a_map_the_compile_check_accepts(ck: Path, tmp_path: Path):
    corpus = _text(tmp_path, "c.txt", " ".join(f"w{i % 40}" for i in range(400)) + "\n")
    out = tmp_path / "map.json"
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["draft-vocab", str(ck), "--corpus", str(corpus),
                                                            "--size", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "16 ids covering" in result.output and "--draft-vocab" in result.output
    ids = json.loads(out.read_text())
    assert ids == check_token_map(ids, 512) and len(ids) == 16 and EOS in ids
    assert not (tmp_path / "map.json.tmp").exists()


def test_cli_error_is_clean_and_writes_nothing(ck: Path, tmp_path: Path):
    out = tmp_path / "map.json"
    result = CliRunner().invoke(app, ["draft-vocab", str(ck), "--corpus", str(tmp_path / "nope.txt"),
                                      "--size", "4", "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "corpus file not found" in result.output
    assert not out.exists()


def test_write_failure_leaves_no_temporary_file(ck: Path, tmp_path: Path):
    tm = build_token_map(ck, [_text(tmp_path, "c.txt", "w1\n")], 2)
    target = tmp_path / "missing_dir" / "map.json"
    with pytest.raises(TokenMapError, match="cannot write the token map"):
        write_token_map(tm, target)
    assert not target.exists() and not target.with_name("map.json.tmp").exists()


def test_read_token_map_formats(tmp_path: Path):
    """JSON, text, .npy and .safetensors maps read to the same ids; nothing is unpickled."""
    from safetensors.numpy import save_file
    ids = [5, 1, 300, 42]
    (tmp_path / "m.json").write_text(json.dumps(ids))
    (tmp_path / "m.txt").write_text("5, 1\n300 42\n")
    np.save(tmp_path / "m.npy", np.array(ids, dtype=np.int64))
    save_file({"token_map": np.array(ids, dtype=np.int32)}, str(tmp_path / "m.safetensors"))
    for name in ("m.json", "m.txt", "m.npy", "m.safetensors"):
        assert read_token_map(tmp_path / name) == ids, name


@pytest.mark.parametrize("name, write, needle", [
    ("d.json", lambda p: p.write_text(json.dumps({"ids": [1]})), "want a JSON list of token ids, got a dict"),
    ("f.json", lambda p: p.write_text("[1, 2.5]"), "a list with non-integers"),
    ("b.json", lambda p: p.write_text("[1, "), "cannot read a token map"),
    ("f.npy", lambda p: np.save(p, np.array([1.0, 2.0])), "1-D list of integer token ids, got an array"),
    ("o.npy", lambda p: np.save(p, np.array([{"a": 1}], dtype=object)), "cannot read a token map"),
    ("two.safetensors", None, "want one tensor of token ids, found ['a', 'b']"),
    ("m2.safetensors", None, "got tensor 'ids' of shape [2, 2]"),
    ("t.txt", lambda p: p.write_text("1 2 x3"), "found ['x3']"),
    ("missing.json", lambda p: None, "cannot read a token map"),
])
def test_read_token_map_errors_name_the_problem(tmp_path: Path, name: str, write, needle: str):
    from safetensors.numpy import save_file
    path = tmp_path / name
    if name == "two.safetensors":
        save_file({"a": np.array([1], dtype=np.int64), "b": np.array([2], dtype=np.int64)}, str(path))
    elif name == "m2.safetensors":
        save_file({"ids": np.array([[1, 2], [3, 4]], dtype=np.int64)}, str(path))
    else:
        write(path)
    with pytest.raises(TokenMapError) as info:
        read_token_map(path)
    assert needle in str(info.value) and str(path) in str(info.value), str(info.value)
