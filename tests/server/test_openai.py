"""/v1/models, /v1/completions and /v1/chat/completions through the `openai` client: text and token-id prompts,
streaming, chat templates, stop strings, seeded sampling; every output equals a fresh Engine's."""

from __future__ import annotations

import openai
import pytest

from srv_support import KEY, MODEL, words

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
SYSTEM_USER = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w11 w22"}]
SYSTEM_USER_IDS = [1, 9, 2, 11, 22, 4]                  # "w1 w9 w2 w11 w22 w4" through CHAT_TEMPLATE


@pytest.fixture(scope="module")
def oai(tok_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tok_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_name(oai):
    assert [m.id for m in oai.models.list()] == [MODEL]


@pytest.mark.parametrize("prompt", ["w11 w22 w33", ["w11 w22 w33"], [11, 22, 33], [[11, 22, 33]]],
                         ids=["text", "text-list", "ids", "ids-list"])
def test_completion_prompt_forms(oai, reference, prompt):
    want = reference([11, 22, 33], 5)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **GREEDY)
    choice = r.choices[0]
    assert choice.text == words(want) and choice.model_extra["token_ids"] == want
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)


def test_streaming_completion_with_usage(oai, reference):
    want = reference([11, 22, 33], 5)
    chunks = list(oai.completions.create(model=MODEL, prompt="w11 w22 w33", max_tokens=5, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) >= 5                                    # a chunk per decode step, then the finish
    assert "".join(c.choices[0].text for c in with_choices) == words(want)
    assert sum((c.choices[0].model_extra["token_ids"] for c in with_choices), []) == want
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_chat_applies_the_template(oai, reference):
    want = words(reference(SYSTEM_USER_IDS, 4))
    r = oai.chat.completions.create(model=MODEL, messages=SYSTEM_USER, max_tokens=4, **GREEDY)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(SYSTEM_USER_IDS) and r.choices[0].finish_reason == "length"
    parts = [{"role": "system", "content": [{"type": "text", "text": "w9"}]}, SYSTEM_USER[1]]
    r = oai.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=4, **GREEDY)
    assert r.choices[0].message.content == want


def test_streaming_chat(oai, reference):
    want = words(reference(SYSTEM_USER_IDS, 4))
    chunks = list(oai.chat.completions.create(model=MODEL, messages=SYSTEM_USER, max_tokens=4, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_ends_the_output(oai, reference, stream):
    full_ids = reference([11, 22, 33], 8)
    full, stop = words(full_ids), words(full_ids[2:4])               # ends with the 4th token
    kw = dict(model=MODEL, prompt=[11, 22, 33], max_tokens=8, stop=[stop], **GREEDY)
    if stream:
        chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        r = oai.completions.create(**kw)
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    assert text == full[:full.index(stop)] and finish == "stop"
    assert usage.completion_tokens == 4                               # up to the token that completed the stop


def test_seeded_sampling_is_reproducible(oai, reference):
    want = reference([11, 22, 33], 6, temperature=0.8, seed=7, top_p=0.9)
    for _ in range(2):
        r = oai.completions.create(model=MODEL, prompt=[11, 22, 33], max_tokens=6, temperature=0.8, top_p=0.9, seed=7,
                                   extra_body={"ignore_eos": True})
        assert r.choices[0].model_extra["token_ids"] == want


def test_wrong_model_name_is_404(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="not-a-model", prompt=[1], max_tokens=1)
    assert "'not-a-model' not found" in str(e.value) and f"'{MODEL}'" in str(e.value)


def test_without_tokenizer_files(plain_server, reference):
    """No chat template -> a clear 400; token-id prompts still work (text is empty, ids in token_ids)."""
    c = openai.OpenAI(base_url=plain_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=SYSTEM_USER, max_tokens=2)
    assert "no chat template" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="w11", max_tokens=2)
    assert "no tokenizer.json" in str(e.value)
    r = c.completions.create(model=MODEL, prompt=[11, 22, 33], max_tokens=4, **GREEDY)
    assert r.choices[0].text == "" and r.choices[0].model_extra["token_ids"] == reference([11, 22, 33], 4)
