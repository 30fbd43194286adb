"""lingc's KDA ops against fla-core 0.6.0's naive reference (`fla/ops/kda/naive.py`).

fla's naive functions take already L2-normalised q/k, a precomputed log-gate g and beta, so the test
computes those here, straight from architecture.md section 4.3 (not with lingc's helpers):
    g    = lower_bound * sigmoid(exp(A_log)[h] * (f + dt_bias[h, d]))
    beta = sigmoid(b)
    q, k = x / sqrt(sum_d x^2 + 1e-6)          (eps inside the root), and q is scaled by D^-1/2
while torch.ops.lingc.kda_recurrent / kda_chunk take the raw projections and update the fp32 states
[H, K, V] of the request slots they are given in a state pool [S, H, K, V], in place. `import fla` needs triton, so naive.py is loaded by file path.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*)

LOWER_BOUND = -5.0
OUT_ATOL = 1e-5          # fp32 outputs, max abs
STATE_RTOL = 1e-4        # fp32 final states, max abs error relative to the state's max magnitude

_NAIVE_REL = Path("fla") / "ops" / "kda" / "naive.py"


def _naive_path() -> Path | None:
    candidates = [os.environ.get("LINGC_FLA_NAIVE"),
                  Path(__file__).resolve().parents[1] / ".venv" / "fla-core" / _NAIVE_REL,
                  Path(sys.prefix) / "fla-core" / _NAIVE_REL]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    return None


@pytest.fixture(scope="module")
def fla_naive():
    """fla's naive.py module (naive_recurrent_kda, naive_chunk_kda), loaded by path."""
    path = _naive_path()
    if path is None:
        pytest.skip(f"fla-core's {_NAIVE_REL} not found (expected under .venv/fla-core/, "
                    "or set LINGC_FLA_NAIVE); the setup script unpacks fla-core 0.6.0 there")
    pytest.importorskip("einops")
    spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- inputs and the preprocessing of architecture.md 4.3, written out here -------------------------

def make_inputs(B: int, T: int, H: int, D: int, seed: int, qk_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Raw KDA inputs as the layer hands them to the op, plus a random initial state."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dt = torch.exp(torch.rand(H * D, generator=g) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3)))
                   + torch.log(torch.tensor(1e-3)))
    return dict(
        q=rn(B, T, H, D) * qk_scale, k=rn(B, T, H, D) * qk_scale, v=rn(B, T, H, D),
        f=4.0 * rn(B, T, H, D) + 4.0, b=rn(B, T, H),                   # gates spread over (-5, 0)
        A_log=torch.log(1.0 + 15.0 * torch.rand(H, generator=g)),        # decay rates in [1, 16)
        dt_bias=dt + torch.log(-torch.expm1(-dt)),                         # inverse softplus of dt
        state=rn(B, H, D, D) * 0.5,
    )


def safe_gate(f, A_log, dt_bias, lower_bound=LOWER_BOUND):
    """g[b,t,h,d] = lower_bound * sigmoid(exp(A_log[h]) * (f[b,t,h,d] + dt_bias[h*D + d]))."""
    H, D = f.shape[-2:]
    return lower_bound * torch.sigmoid(A_log.exp()[:, None] * (f + dt_bias.reshape(H, D)))


def l2norm_eps_inside(x, eps=1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def fla_args(inp):
    """The arguments fla's naive functions take: normalised q/k, v, g, beta, scale, initial state."""
    D = inp["q"].shape[-1]
    return dict(q=l2norm_eps_inside(inp["q"]), k=l2norm_eps_inside(inp["k"]), v=inp["v"],
                g=safe_gate(inp["f"], inp["A_log"], inp["dt_bias"]), beta=torch.sigmoid(inp["b"]),
                scale=D ** -0.5, initial_state=inp["state"].clone(), output_final_state=True)


def slot_pool(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A state pool [B + 1, H, K, V] holding request b's state in slot B - b (slot 0 unused, filled with 7),
    and slots [B] int32: the ops read and update pool[slots] in place."""
    B = state.shape[0]
    slots = torch.arange(B, 0, -1, dtype=torch.int32)
    pool = torch.full((B + 1, *state.shape[1:]), 7.0)
    pool[slots.long()] = state
    return pool, slots


def run_lingc(op, inp):
    """(output, final state) of torch.ops.lingc.<op>; the op mutates the slots' rows of the pool it is given."""
    pool, slots = slot_pool(inp["state"].clone())
    o = getattr(torch.ops.lingc, op)(inp["q"], inp["k"], inp["v"], inp["f"], inp["b"], inp["A_log"],
                                     inp["dt_bias"], pool, slots, LOWER_BOUND)
    assert torch.equal(pool[0], torch.full_like(pool[0], 7.0)), f"{op} wrote a slot it was not given"
    return o, pool[slots.long()]


def naive_chunk_padded(fla_naive, args, chunk=64):
    """fla's naive_chunk_kda needs T % 64 == 0: pad the end with k = v = beta = g = 0 steps, which
    neither write nor decay the state, then drop the padded outputs."""
    T = args["q"].shape[1]
    pad = (-T) % chunk
    a = dict(args)
    if pad:
        padT = lambda x: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))  # noqa: E731
        for name in ("q", "k", "v", "g", "beta"):
            a[name] = padT(a[name])
    o, S = fla_naive.naive_chunk_kda(**a, chunk_size=chunk)
    return o[:, :T], S


def assert_out_close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= OUT_ATOL, f"{what}: max abs output error {err:.3g} > {OUT_ATOL}"


def assert_state_close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= STATE_RTOL * max(scale, 1e-30), f"{what}: max state error {err:.3g} vs |state| {scale:.3g}"


# ---- cases --------------------------------------------------------------------------------------------

CASES = [  # (B, T, H, D)
    pytest.param(1, 1, 2, 16, id="B1-T1-H2-D16"),
    pytest.param(2, 7, 3, 32, id="B2-T7-H3-D32"),
    pytest.param(1, 64, 4, 16, id="B1-T64-H4-D16"),
    pytest.param(2, 130, 2, 32, id="B2-T130-H2-D32"),
]


@pytest.mark.parametrize("B,T,H,D", CASES)
def test_recurrent_matches_fla_naive_recurrent(fla_naive, B, T, H, D):
    """lingc kda_recurrent (raw inputs) vs fla naive_recurrent_kda (preprocessed here): output and state."""
    inp = make_inputs(B, T, H, D, seed=T * 100 + H * 10 + D)
    o, S = run_lingc("kda_recurrent", inp)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(**fla_args(inp))
    assert_out_close(o, o_ref, "kda_recurrent vs naive_recurrent_kda")
    assert_state_close(S, S_ref, "kda_recurrent vs naive_recurrent_kda")


@pytest.mark.parametrize("B,T,H,D", CASES)
def test_chunk_matches_fla_naive(fla_naive, B, T, H, D):
    """lingc kda_chunk vs fla naive_chunk_kda (end-padded to a multiple of 64) and vs naive_recurrent_kda."""
    inp = make_inputs(B, T, H, D, seed=T * 100 + H * 10 + D + 1)
    o, S = run_lingc("kda_chunk", inp)
    args = fla_args(inp)
    o_chunk, S_chunk = naive_chunk_padded(fla_naive, args)
    assert_out_close(o, o_chunk, "kda_chunk vs naive_chunk_kda")
    assert_state_close(S, S_chunk, "kda_chunk vs naive_chunk_kda")
    o_rec, S_rec = fla_naive.naive_recurrent_kda(**args)
    assert_out_close(o, o_rec, "kda_chunk vs naive_recurrent_kda")
    assert_state_close(S, S_rec, "kda_chunk vs naive_recurrent_kda")


@pytest.mark.parametrize("B,T,H,D", CASES)
def test_chunk_matches_recurrent(B, T, H, D):
    """lingc kda_chunk vs lingc kda_recurrent on the same raw inputs (prefill form = decode form)."""
    inp = make_inputs(B, T, H, D, seed=T * 100 + H * 10 + D + 2)
    o_c, S_c = run_lingc("kda_chunk", inp)
    o_r, S_r = run_lingc("kda_recurrent", inp)
    assert_out_close(o_c, o_r, "kda_chunk vs kda_recurrent")
    assert_state_close(S_c, S_r, "kda_chunk vs kda_recurrent")


@pytest.mark.parametrize("op", ["kda_recurrent", "kda_chunk"])
def test_small_qk_l2norm_eps_inside_root(fla_naive, op):
    """With tiny q/k (sum x^2 comparable to the 1e-6 eps) the eps placement matters: lingc must match
    x / sqrt(sum x^2 + 1e-6), and must differ measurably from F.normalize (eps outside)."""
    inp = make_inputs(2, 9, 2, 16, seed=5, qk_scale=1e-3)
    o, S = run_lingc(op, inp)
    args = fla_args(inp)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(**args)
    assert_out_close(o, o_ref, f"{op} vs naive_recurrent_kda (small q/k)")
    assert_state_close(S, S_ref, f"{op} vs naive_recurrent_kda (small q/k)")
    wrong = dict(args, q=torch.nn.functional.normalize(inp["q"], dim=-1, eps=1e-6),
                 k=torch.nn.functional.normalize(inp["k"], dim=-1, eps=1e-6), initial_state=inp["state"].clone())
    o_wrong, _ = fla_naive.naive_recurrent_kda(**wrong)
    assert (o_wrong - o_ref).abs().max().item() > 100 * OUT_ATOL, "test inputs do not discriminate the eps placement"


def test_chained_calls_continue_the_state(fla_naive):
    """Prefill with kda_chunk then decode token by token with kda_recurrent on the mutated state equals
    one naive_recurrent_kda pass over the whole sequence."""
    B, T, H, D, split = 2, 80, 2, 16, 70
    inp = make_inputs(B, T, H, D, seed=11)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(**fla_args(inp))
    pool, slots = slot_pool(inp["state"].clone())
    raw = lambda sl: [inp[n][:, sl] for n in ("q", "k", "v", "f", "b")]  # noqa: E731
    outs = [torch.ops.lingc.kda_chunk(*raw(slice(0, split)), inp["A_log"], inp["dt_bias"], pool, slots,
                                      LOWER_BOUND)]
    for t in range(split, T):
        outs.append(torch.ops.lingc.kda_recurrent(*raw(slice(t, t + 1)), inp["A_log"], inp["dt_bias"], pool, slots,
                                                  LOWER_BOUND))
    assert_out_close(torch.cat(outs, dim=1), o_ref, "chunk prefill + recurrent decode vs naive_recurrent_kda")
    assert_state_close(pool[slots.long()], S_ref, "chunk prefill + recurrent decode vs naive_recurrent_kda")
