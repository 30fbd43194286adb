"""TP on the Triton kernels vs TP1 on the Triton kernels, on CPU in the Triton interpreter (test-tiny).

The TP2 run on the H200s gave bf16 greedy tokens that part from TP1's early (docs/tp.md). This check separates
the kernels from the arithmetic: the same seeded random inputs (passes.verify.random_inputs: a half-full cache,
random KDA state) through TP1 and TP2 (ranks in lockstep, all_reduce = fp32 sum in rank order, as in
passes.tp.run_lockstep) on the reference ops and on the Triton launchers, then the largest difference and
argmax agreement of every floating-point output between the four runs. bf16 uses the interpreter shims of
tests/kernels/conftest.py (round-to-nearest-even casts, widened bf16 dots), as the kernel tests do.

    python3 bench/cpu_tp_kernels.py fp32 decode,verify        (a few minutes per graph on 2 cores)
Measured 2026-11-30 (test-tiny, all passes, decode): fp32 TP2 == TP1 on the kernels within 5e-7; bf16 within
3.1e-2 on logits of max |2.56| (the same as on the reference ops), argmax equal.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _interpreter_shims() -> None:
    spec = importlib.util.spec_from_file_location("kernel_conftest", ROOT / "tests" / "kernels" / "conftest.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    mp = pytest.MonkeyPatch()
    for fixture in (conf._rne_bf16_casts, conf._bf16_dots):
        fn = getattr(fixture, "__wrapped__", None) or fixture._get_wrapped_function()
        fn(mp)


def lockstep(programs, graph: str, inputs: list[dict], backend: str) -> list:
    """passes.tp.run_lockstep with every op run by the given executor backend's kernel."""
    from lingc.passes.tp import run_lockstep
    from lingc.runtime.executor import kernel_for
    return run_lockstep(programs, graph, inputs, call=lambda target: kernel_for(target, backend)[0])


def main() -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "fp32"]
    graphs = (sys.argv[2] if len(sys.argv) > 2 else "decode").split(",")
    _interpreter_shims()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests" / "tp"))
    from lingc.init import write_random_checkpoint
    from lingc.passes.tp import rank_programs, shard_inputs
    from lingc.passes.verify import random_inputs
    from lingc.presets import preset
    from tp_support import compiled, with_tp

    ckpt = write_random_checkpoint(preset("test-tiny"), Path(tempfile.mkdtemp()), seed=0)
    before = compiled(ckpt, dtype, ["all"])
    result, ranks = with_tp(before, 2)
    tp2 = rank_programs(result.program, ranks)
    for graph in graphs:
        inputs = random_inputs(before.program, [graph])
        runs = {}
        for name, programs, backend in (("tp1_ref", [before.program], "reference"),
                                        ("tp1_triton", [before.program], "triton"),
                                        ("tp2_ref", tp2, "reference"), ("tp2_triton", tp2, "triton")):
            rank_in = ([{k: v.clone() for k, v in inputs.items()}] if len(programs) == 1 else
                       [shard_inputs({k: v.clone() for k, v in inputs.items()}, result.program, graph, r, 2)
                        for r in range(2)])
            out = lockstep(programs, graph, rank_in, backend)[0]
            runs[name] = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(o, torch.Tensor) and o.is_floating_point()]
        for a, b in (("tp1_ref", "tp1_triton"), ("tp1_ref", "tp2_ref"), ("tp1_triton", "tp2_triton")):
            cells = [f"max |d| {(x.float() - y.float()).abs().max().item():.2e} of max |x| "
                     f"{x.float().abs().max().item():.2f}, argmax equal {torch.equal(x.argmax(-1), y.argmax(-1))}"
                     for x, y in zip(runs[a], runs[b])]
            print(f"{graph}: {a} vs {b}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
