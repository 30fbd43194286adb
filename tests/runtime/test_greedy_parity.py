"""Gate 1 (techniques.md section 13): greedy NEXTN output is byte-identical to plain decoding (`--spec none`)
on the same program and to the reference model's `generate`, for 256 new tokens, over three prompts
(shorter than, equal to and longer than a prefill chunk) and every pass combination that declares numerics
unchanged (`COMBOS`: the four the gate names, plus all such passes registered today).

Cells run by default: the full combination partition+fuse_swiglu+pdl with every prompt, and every other
combination with the 37-token prompt, which runs all six programs a pass can change (prefill chunks,
decode-fed tail, MTP prefill and decode, the step graphs); the shorter prompts add only host-side paths.
The full cross product (another ~2 minutes on one CPU core) runs with LINGC_FULL_MATRIX=1.
"""

from __future__ import annotations

import os

import pytest

from rt_support import COMBOS, FULL, NEW_TOKENS, OPTIONS, PROMPTS, first_difference

FULL_MATRIX = os.environ.get("LINGC_FULL_MATRIX") == "1"
COVERING = "long37"


def cells():
    for combo in COMBOS:
        for prompt in PROMPTS:
            default = combo == FULL or prompt == COVERING
            marks = () if default else pytest.mark.skipif(not FULL_MATRIX, reason="set LINGC_FULL_MATRIX=1")
            yield pytest.param(combo, prompt, marks=marks, id=f"{combo}-{prompt}")


def test_prompts_cover_the_chunk_boundary():
    lengths = sorted(len(p) for p in PROMPTS.values())
    chunk = OPTIONS.prefill_tokens
    assert lengths[0] < chunk and chunk in lengths and lengths[-1] > chunk
    assert len(PROMPTS[COVERING]) > 2 * chunk and len(PROMPTS[COVERING]) % chunk, \
        "the covering prompt needs several prefill chunks and a decode-fed tail"


@pytest.mark.parametrize("combo,prompt", list(cells()))
def test_nextn_greedy_is_byte_identical(greedy_run, rt_reference, combo, prompt):
    ref = rt_reference(prompt)
    assert len(ref) == NEW_TOKENS and len(set(ref)) > 1, "a constant reference would make the gate vacuous"
    # the --spec none baseline: this combination's own plain decoding (the full combination's in the covering
    # subset, where every combination's `step` graph is already checked bit for bit by the pass tests)
    base = combo if FULL_MATRIX or combo == FULL else FULL
    plain, nextn = greedy_run(base, "none", prompt), greedy_run(combo, "nextn", prompt)
    assert plain.tokens == ref, f"--spec none vs model.generate ({base}): {first_difference(plain.tokens, ref)}"
    assert nextn.tokens == plain.tokens, \
        f"--spec nextn ({combo}) vs --spec none ({base}): {first_difference(nextn.tokens, plain.tokens)}"
    assert nextn.finish_reason == plain.finish_reason == "length"
    assert plain.steps == NEW_TOKENS - 1                      # the first token comes from prefill
    assert 1 <= nextn.steps <= NEW_TOKENS - 1
