"""The multi-process TP runtime on CPU (gloo): TP2 and TP4 generate the same greedy tokens as TP1, `lingc
generate` starts the ranks of a TP artifact itself, a killed worker stops the session with an error naming it
(no hang), a rank that cannot start is reported, and open_tp_session checks the degree.

The artifacts are fp32 with every pass (the lm_head is bf16 after bf16_router, so TP moves logits by ~2e-3:
greedy equality is a property of these prompts and weights, and it is deterministic run to run).
On the 2-core test machine a TP4 step (4 processes) is ~4x slower than TP1, so the runs are short."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from lingc.artifact import load_artifact
from lingc.cli import app
from lingc.runtime.engine import Engine, EngineError, Request, SamplingParams
from lingc.runtime.tp import TPError, open_tp_session

PROMPT = [7, 99, 123, 4, 250, 31, 8, 77, 300, 12, 5, 66, 401, 2, 19, 88, 140, 9, 3]   # a 16-token chunk + a tail
NEW = {2: 16, 4: 8}
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def tp1_tokens(tp_artifacts):
    engine = Engine(load_artifact(tp_artifacts[1]).program, spec="nextn")
    return engine.generate(Request(PROMPT, max(NEW.values()), ignore_eos=True)).tokens


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_greedy_tokens_equal_tp1(tp_artifacts, tp1_tokens, tp):
    t0 = time.perf_counter()
    with open_tp_session(tp_artifacts[tp], tp, spec="nextn", timeout_s=TIMEOUT_S) as session:
        assert session.tp == tp and session.runtime.procs.keys() == set(range(1, tp))
        streamed: list[int] = []
        result = session.engine.generate(Request(PROMPT, NEW[tp], ignore_eos=True), streamed.extend)
        assert result.tokens == tp1_tokens[:NEW[tp]] == streamed
        if tp == 2:                                   # a sampled request in between leaves no state behind
            sampled = Request(PROMPT[:5], 6, SamplingParams(temperature=0.8, top_p=0.9, seed=3), ignore_eos=True)
            first = session.engine.generate(sampled).tokens
            assert session.engine.generate(sampled).tokens == first
            again = session.engine.generate(Request(PROMPT, NEW[tp], ignore_eos=True))
            assert again.tokens == result.tokens
        procs = list(session.runtime.procs.values())
    assert all(p.exitcode == 0 for p in procs)        # shut down cleanly, not killed
    assert time.perf_counter() - t0 < 90


def test_a_killed_worker_stops_the_session_with_a_clear_error(tp_artifacts):
    session = open_tp_session(tp_artifacts[2], spec="nextn", timeout_s=TIMEOUT_S)
    try:
        pid = session.runtime.procs[1].pid
        calls = []

        def kill_after_two_steps(tokens):
            calls.append(tokens)
            if len(calls) == 2:
                os.kill(pid, signal.SIGKILL)

        t0 = time.perf_counter()
        with pytest.raises(TPError, match=rf"TP rank 1 \(pid {pid}\) was killed by signal 9.*TP session is stopped"):
            session.engine.generate(Request(PROMPT, 30, ignore_eos=True), kill_after_two_steps)
        assert time.perf_counter() - t0 < TIMEOUT_S / 2        # the watchdog / gloo, not the timeout
        t0 = time.perf_counter()
        with pytest.raises(TPError, match="TP rank 1"):
            session.engine.generate(Request(PROMPT, 2))
        assert time.perf_counter() - t0 < 0.5
    finally:
        t0 = time.perf_counter()
        session.close()
        assert time.perf_counter() - t0 < 5


def test_a_rank_that_cannot_start_is_reported(tp_artifacts, tmp_path):
    art = shutil.copytree(tp_artifacts[2], tmp_path / "art")
    f = art / "weights/rank1-00000.safetensors"
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    with pytest.raises(TPError, match=r"(?s)TP rank 1 .*rank1-00000\.safetensors does not match its sha256"):
        open_tp_session(art, 2, timeout_s=TIMEOUT_S)


def test_open_tp_session_checks_the_degree(tp_artifacts):
    with pytest.raises(EngineError, match=r"compiled for --tp 2, not 4"):
        open_tp_session(tp_artifacts[2], 4)
    with pytest.raises(EngineError, match=r"not a tensor-parallel artifact"):
        open_tp_session(tp_artifacts[1])


def test_lingc_generate_starts_the_ranks_of_a_tp_artifact(tp_artifacts, tp1_tokens):
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    result = runner.invoke(app, ["generate", str(tp_artifacts[2]), "--prompt-ids", ",".join(map(str, PROMPT)),
                                 "--max-new-tokens", "8", "--ignore-eos", "--spec", "none", "--json"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["tokens"] == tp1_tokens[:8] and summary["spec"] == "none"


BLOCKED_RANK0 = """
import os, signal, sys, time
from lingc.runtime.tp import open_tp_session
if __name__ == "__main__":
    session = open_tp_session(sys.argv[1], spec="none", timeout_s=120.0, hard_exit_s=1.0)
    os.kill(session.runtime.procs[1].pid, signal.SIGKILL)
    print("killed", flush=True)
    time.sleep(60)           # rank 0's thread never looks again: as if blocked in an NCCL collective
    print("still here", flush=True)
"""


def test_a_blocked_rank0_exits_with_the_error_after_hard_exit_s(tp_artifacts, tmp_path):
    """NCCL collectives do not fail when a peer dies, so rank 0 can stay blocked; after hard_exit_s the watchdog
    prints the error and ends the process (exit code 1) instead of leaving a hung server."""
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_RANK0)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), str(tp_artifacts[2])], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "killed" in proc.stdout and "still here" not in proc.stdout
    assert re.search(r"lingc: TP rank 1 \(pid \d+\) was killed by signal 9.*exits now", proc.stderr), proc.stderr[-2000:]
    assert time.perf_counter() - t0 < 60
