"""Constants and helpers shared by the server tests (conftest.py holds the fixtures)."""

from __future__ import annotations

import json

import httpx

KEY = "test-key"                    # plain_server's API key
MODEL = "tiny"                      # the served model name
PROMPTS = [[11, 22, 33], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [400, 3], [77]]
# system -> w1, user -> w2, assistant -> w3, then w4 asks for the answer
CHAT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}w1 {% elif m.role == 'user' %}w2 {% else %}w3 "
                 "{% endif %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}")


def word_level_tokenizer():
    """A WordLevel tokenizer over test-tiny's 512 ids: "w0" .. "w509", "<pad>", "<eos>"; unknown words are w0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(510)} | {"<pad>": 510, "<eos>": 511}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def words(ids: list[int]) -> str:
    """What the WordLevel tokenizer decodes ids to."""
    return " ".join({510: "<pad>", 511: "<eos>"}.get(i, f"w{i}") for i in ids)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent)."""
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name + want:
            return float(value)
    return 0.0


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response ("[DONE]" kept as the string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
