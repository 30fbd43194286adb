"""Gate 6 (techniques.md section 1): host run-ahead.

- The whole `generate` (request set-up, prefill, first token and the step loop) reads no device value on
  the host except through the documented one-step-late copy (`LateCopy.consume`): `NoHostReads` finds none.
- The guard is not blind: a deliberate `.item()` on the step path raises HostReadError. Reads inside the
  reference ops (allowed: they stand in for device kernels) are listed and pinned to today's known ones.
- The loop really runs ahead: step k + 1 is enqueued (and its copy started) before step k's tokens are
  read, at most one step beyond the one being read, and at most one step is left unread at the end.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lingc.ops
from lingc.runtime.engine import Engine, LateCopy, Request, SamplingParams
from lingc.runtime.host_reads import HostReadError, NoHostReads
from rt_support import PROMPTS

OPS_DIR = str(Path(lingc.ops.__file__).parent)

REQUESTS = {
    "greedy": lambda: Request(PROMPTS["long37"], 16, ignore_eos=True),
    "sampled": lambda: Request(PROMPTS["short3"], 16, SamplingParams(0.8, top_k=40, top_p=0.95, seed=9),
                               ignore_eos=True),
    "stop": lambda: Request(PROMPTS["chunk16"], 16, stop_token_ids=(7, 8, 9)),      # EOS + stop ids
}


@pytest.mark.parametrize("spec", ["nextn", "none"])
@pytest.mark.parametrize("kind", list(REQUESTS))
def test_generate_reads_nothing_but_the_late_copy(rt_engine, spec, kind):
    engine = rt_engine(spec)
    engine.generate(Request(PROMPTS["short3"], 4, ignore_eos=True))          # warm-up
    with NoHostReads() as guard:
        r = engine.generate(REQUESTS[kind]())
    assert guard.violations == []
    assert r.tokens


# host reads inside the reference ops, which stand in for device kernels (allowed by default): they sync the
# GPU wherever the reference ops run eagerly there. The list may only shrink; a new entry fails this test.
KNOWN_OP_READS = {"moe.py:moe_align", "moe.py:_grouped_gemm"}


@pytest.mark.parametrize("spec", ["nextn", "none"])
def test_reads_inside_reference_ops_are_the_known_ones(rt_engine, spec):
    engine = rt_engine(spec)
    with NoHostReads(strict=False, allow_ops=False) as guard:
        engine.generate(REQUESTS["sampled"]())
    where = {re.search(r"/([^/]+\.py):\d+ in (\w+)$", v) for v in guard.violations}
    assert None not in where, guard.violations
    offenders = {f"{m.group(1)}:{m.group(2)}" for m in where}
    assert all(v.split(" at ")[1].startswith(OPS_DIR) for v in guard.violations), "reads outside the ops"
    assert offenders <= KNOWN_OP_READS, offenders - KNOWN_OP_READS


def test_the_guard_catches_an_item_on_the_step_path(rt_engine, monkeypatch):
    engine = rt_engine("nextn")
    step = Engine._enqueue_step

    def reads_back(self):
        step(self)
        return self.relay["seq_len"][0].item()      # a host read of a device value, as a careless edit would

    monkeypatch.setattr(Engine, "_enqueue_step", reads_back)
    with pytest.raises(HostReadError, match=r"Tensor.item .*test_run_ahead.py.* in reads_back"):
        with NoHostReads():
            engine.generate(Request(PROMPTS["short3"], 8, ignore_eos=True))
    with NoHostReads(strict=False) as guard:                       # non-strict: recorded, one per step
        r = engine.generate(Request(PROMPTS["short3"], 8, ignore_eos=True))
    assert len(guard.violations) in (r.steps, r.steps + 1)         # every enqueued step; one may be unread
    assert all("reads_back" in v for v in guard.violations)


@pytest.mark.parametrize("read", [lambda t: t.tolist(), lambda t: int(t[0]), lambda t: bool(t[0] > 0),
                                  lambda t: float(t[0]), lambda t: t.cpu(), lambda t: t.numpy()],
                         ids=["tolist", "int", "bool", "float", "cpu", "numpy"])
def test_the_guard_sees_every_read_method(read):
    with pytest.raises(HostReadError):
        with NoHostReads():
            read(torch.ones(3))


def test_only_the_late_copy_is_allowed():
    """Allowed by qualified name: another function that happens to be called `consume` is not."""
    def consume(t):
        return t.tolist()

    with pytest.raises(HostReadError):
        with NoHostReads():
            consume(torch.ones(2))
    late = LateCopy(torch.zeros(2, 6, dtype=torch.int64), torch.ones(2, dtype=torch.int32))
    late.start(0)
    with NoHostReads():
        assert late.consume(0, 1) == [0]


@pytest.mark.parametrize("spec", ["nextn", "none"])
@pytest.mark.parametrize("n", [1, 2, 3, 20])
def test_step_k_plus_one_is_enqueued_before_step_k_is_read(rt_engine, monkeypatch, spec, n):
    engine, log = rt_engine(spec), []
    step, consume = Engine._enqueue_step, LateCopy.consume

    def logged_step(self):
        log.append("enqueue")
        step(self)

    def logged_consume(self, k, slot):
        log.append(("read", k))
        return consume(self, k, slot)

    monkeypatch.setattr(Engine, "_enqueue_step", logged_step)
    monkeypatch.setattr(LateCopy, "consume", logged_consume)
    r = engine.generate(Request(PROMPTS["short3"], n, ignore_eos=True))
    assert len(r.tokens) == n and r.steps == len(r.accept_lens)

    enqueued, reads = 0, []
    for event in log:
        if event == "enqueue":
            enqueued += 1
        else:
            reads.append((event[1], enqueued))            # (step read, steps enqueued by then)
    assert reads[0] == (0, 0), "the first token is read before any step (TTFT)"
    steps_read = [k for k, _ in reads[1:]]
    assert steps_read == list(range(1, r.steps + 1))
    for k, enq in reads[1:-1]:
        assert enq == k + 1, f"when step {k} was read, {enq} steps were enqueued (want {k + 1}: one ahead)"
    if r.steps:
        k, enq = reads[-1]
        assert enq in (k, k + 1)
        assert enqueued - r.steps <= 1, "at most one step is left in flight unread"
