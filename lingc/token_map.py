"""Build the draft_vocab token map (`lingc compile --draft-vocab FILE`) from a text corpus: the N most frequent ids.

The draft_vocab pass lets the MTP draft propose only from a hot subset of the vocabulary (FR-Spec; SGLang's
`--speculative-token-map`), so its lm_head reads N rows instead of V. Which N decides how often the draft can
propose the target's token at all; the usual choice is the ids a tokenizer emits most on text like the traffic.
This module counts them:

    counts  = token frequencies of the corpus under the checkpoint's tokenizer.json (ids >= the model's vocab_size,
              which a padded tokenizer may emit, are counted apart and never chosen)
    map     = the eos ids of config.json and the tokenizer's special tokens, then the most frequent ids (ties to the
              lower id) up to N, sorted; never more ids than occur (or are always kept)
    coverage = the fraction of the corpus's tokens whose id is in the map: an upper bound on how often a draft
              restricted to the map can propose the next token

Corpus files: `.jsonl` (one JSON object a line: its "text", the "content" strings of its "messages" (OpenAI-style
chat datasets) or the "value" strings of its "conversations" (ShareGPT)), `.json` (a list of such objects, loaded
whole: ShareGPT's files are one JSON array), or anything else as UTF-8 text. The result is written as a JSON list
of ints, the format `--draft-vocab` reads, through a temporary file and a rename (a failed run leaves no half-written
map).

Why not a library: it is a bincount over `tokenizers` output; SGLang / EAGLE ship the maps as torch pickles,
which lingc never loads.

`read_token_map(path)` reads a map for `--draft-vocab` from a JSON list, a text file of ids (whitespace or comma
separated), a `.npy` integer array (numpy, no pickles) or a `.safetensors` file holding one 1-D integer tensor. An
FR-Spec / SGLang `.pt` map converts with one line of the user's own torch, on a file they trust:
    python -c "import torch, json; json.dump(torch.load('freq_32768.pt').tolist(), open('map.json', 'w'))"
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
BATCH_LINES = 512           # lines encoded per tokenizers.encode_batch call (it runs them on its own threads)


class TokenMapError(ValueError):
    """A bad input to the token-map builder; the message names the file, line or value."""


@dataclass
class TokenMap:
    ids: list[int]            # sorted, unique, < vocab_size: what --draft-vocab reads
    corpus_tokens: int        # tokens counted (ids >= vocab_size included)
    covered_tokens: int       # of them, the ones whose id is in `ids`
    distinct: int             # distinct ids seen below vocab_size
    out_of_vocab: int         # occurrences of ids >= vocab_size (never chosen)
    kept: list[int]           # ids kept whatever their count (eos, special tokens), sorted

    @property
    def coverage(self) -> float:
        return self.covered_tokens / self.corpus_tokens if self.corpus_tokens else 0.0


def _row_texts(row, where: str) -> Iterator[str]:
    """The texts of one corpus row: "text", or the turns of "messages" (content) / "conversations" (value)."""
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        yield row["text"]
    elif isinstance(row, dict) and isinstance(row.get("messages") or row.get("conversations"), list):
        for m in row.get("messages") or row["conversations"]:
            text = m.get("content", m.get("value")) if isinstance(m, dict) else None
            if isinstance(text, str):
                yield text
    else:
        raise TokenMapError(f"{where}: want an object with a \"text\" string or a \"messages\" / \"conversations\" "
                            "list")


def _jsonl_texts(path: Path, line: str, number: int) -> Iterator[str]:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise TokenMapError(f"{path}:{number}: not a JSON object ({e})") from None
    yield from _row_texts(row, f"{path}:{number}")


def _json_texts(path: Path, f) -> Iterator[str]:
    try:
        rows = json.load(f)
    except ValueError as e:
        raise TokenMapError(f"{path}: not a JSON document ({e})") from None
    if not isinstance(rows, list):
        raise TokenMapError(f"{path}: want a JSON list of rows, got a {type(rows).__name__}")
    for i, row in enumerate(rows):
        yield from _row_texts(row, f"{path}: row {i}")


def corpus_texts(paths: Iterable[Path], advance: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """The corpus's texts, file by file; advance(bytes) after each line (a progress bar over the files' sizes)."""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                if path.suffix == ".json":
                    yield from _json_texts(path, f)
                    advance(path.stat().st_size)
                    continue
                for number, line in enumerate(f, start=1):
                    advance(len(line.encode("utf-8")))
                    if path.suffix == ".jsonl":
                        if line.strip():
                            yield from _jsonl_texts(path, line, number)
                    elif line.strip():
                        yield line
        except UnicodeDecodeError as e:
            raise TokenMapError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise TokenMapError(f"{path}: cannot read the corpus file ({e.strerror or e})") from None


def count_tokens(tokenizer, texts: Iterable[str], vocab_size: int) -> tuple[np.ndarray, int, int]:
    """(counts [vocab_size] int64, tokens counted, occurrences of ids >= vocab_size) of the texts' encodings."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    total = out_of_vocab = 0
    batch: list[str] = []

    def flush() -> None:            # one bincount a batch: an O(vocab) pass per line would dominate a large corpus
        nonlocal total, out_of_vocab
        encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
        ids = np.concatenate([np.asarray(enc.ids, dtype=np.int64) for enc in encodings] or [np.zeros(0, np.int64)])
        inside = ids[ids < vocab_size]
        total += ids.size
        out_of_vocab += ids.size - inside.size
        counts[:] += np.bincount(inside, minlength=vocab_size)
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == BATCH_LINES:
            flush()
    if batch:
        flush()
    return counts, total, out_of_vocab


def hot_ids(counts: np.ndarray, size: int, keep: Iterable[int] = ()) -> list[int]:
    """`keep` (ids < len(counts)), then the most frequent ids with a non-zero count, ties to the lower id, until
    there are `size`; sorted."""
    kept = sorted({int(i) for i in keep if 0 <= int(i) < counts.size})
    if len(kept) > size:
        raise TokenMapError(f"--size {size} is smaller than the {len(kept)} ids always kept (eos and special "
                            f"tokens: {kept[:8]}{' ...' if len(kept) > 8 else ''})")
    order = np.lexsort((np.arange(counts.size), -counts))       # count descending, then id ascending
    order = order[(counts[order] > 0) & ~np.isin(order, kept)]
    return sorted(kept + order[: size - len(kept)].tolist())


def special_ids(tokenizer) -> list[int]:
    """Ids of the tokenizer's special added tokens (<eos>, chat markers, ...)."""
    decoder = tokenizer.get_added_tokens_decoder() if hasattr(tokenizer, "get_added_tokens_decoder") else {}
    return sorted(i for i, tok in decoder.items() if getattr(tok, "special", False))


def build_token_map(checkpoint: str | Path, corpus: list[Path], size: int, *,
                    progress: bool = False) -> TokenMap:
    """The `size` most frequent ids of `corpus` under the checkpoint's tokenizer (see the module docstring)."""
    from tokenizers import Tokenizer

    from lingc.config import LingConfig
    from lingc.progress import progress_bar

    checkpoint = Path(checkpoint)
    config = LingConfig.from_json(checkpoint / "config.json")
    if not 0 < size <= config.vocab_size:
        raise TokenMapError(f"--size {size}: want 1 .. {config.vocab_size} (the model's vocab_size)")
    tok_file = checkpoint / TOKENIZER_FILE
    if not tok_file.is_file():
        raise TokenMapError(f"{tok_file}: not found; the token map is counted with the checkpoint's tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(tok_file))
    except Exception as e:                                       # tokenizers raises a bare Exception on bad JSON
        raise TokenMapError(f"{tok_file}: cannot load the tokenizer ({e})") from None
    if not corpus:
        raise TokenMapError("no corpus: give one or more --corpus FILE (text, or .jsonl with \"text\" / \"messages\")")
    missing = [str(p) for p in corpus if not Path(p).is_file()]
    if missing:
        raise TokenMapError(f"corpus file not found: {', '.join(missing)}")
    corpus = [Path(p) for p in corpus]
    with progress_bar("counting tokens (bytes)", sum(p.stat().st_size for p in corpus), enabled=progress) as advance:
        counts, total, out_of_vocab = count_tokens(tokenizer, corpus_texts(corpus, advance), config.vocab_size)
    if total == 0:
        raise TokenMapError(f"the corpus ({', '.join(map(str, corpus))}) has no text to count")
    keep = [i for i in (*config.eos_token_ids, *special_ids(tokenizer)) if i < config.vocab_size]
    ids = hot_ids(counts, size, keep)
    return TokenMap(ids=ids, corpus_tokens=total, covered_tokens=int(counts[ids].sum()),
                    distinct=int(np.count_nonzero(counts)), out_of_vocab=out_of_vocab, kept=sorted(set(keep)))


def _ints(values, path: Path, what: str) -> list[int]:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TokenMapError(f"{path}: want a 1-D list of integer token ids, got {what} of shape {list(arr.shape)} "
                            f"and dtype {arr.dtype}")
    return [int(x) for x in arr]


def read_token_map(path: str | Path) -> list[int]:
    """The token ids of a map file (module docstring: .json, .npy, .safetensors, else text); never unpickles.
    Range, duplicates and sorting are checked where the map is used (passes/draft_vocab.py check_token_map)."""
    path = Path(path)
    try:
        if path.suffix == ".npy":
            return _ints(np.load(path, allow_pickle=False), path, "an array")
        if path.suffix == ".safetensors":
            from safetensors.numpy import load_file
            tensors = load_file(str(path))
            if len(tensors) != 1:
                raise TokenMapError(f"{path}: want one tensor of token ids, found {sorted(tensors) or 'none'}")
            (name, arr), = tensors.items()
            return _ints(arr, path, f"tensor {name!r}")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            ids = json.loads(text)
            if not isinstance(ids, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in ids):
                got = f"a {type(ids).__name__}" if not isinstance(ids, list) else "a list with non-integers"
                raise TokenMapError(f"{path}: want a JSON list of token ids, got {got}")
            return ids
        words = text.replace(",", " ").split()
        bad = [w for w in words if not w.lstrip("-").isdigit()]
        if bad:
            raise TokenMapError(f"{path}: want token ids separated by spaces, commas or newlines; found {bad[:3]}")
        return [int(w) for w in words]
    except TokenMapError:
        raise
    except (OSError, ValueError, UnicodeDecodeError) as e:      # unreadable, bad JSON / npy / safetensors header
        raise TokenMapError(f"{path}: cannot read a token map ({e})") from None
    except Exception as e:                                      # safetensors raises its own error types
        raise TokenMapError(f"{path}: cannot read a token map ({type(e).__name__}: {e})") from None


def write_token_map(token_map: TokenMap, out: str | Path) -> None:
    """The map as the JSON list --draft-vocab reads, written to a temporary file and renamed into place."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(json.dumps(token_map.ids) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise TokenMapError(f"{out}: cannot write the token map ({e.strerror or e})") from None
