"""H200 bench of the KDA kernel family (kernels/kda.py) at Ling-3.0-tiny decode shapes: H = 16, D = 128,
P = 2048, W = 4, B = 1, bf16 activations, decode T = 1 and verify T = 6.

For every kernel: max_abs_err and bit_exact against the torch reference op on the GPU, pdl=True == pdl=False bit
for bit, and CUDA-graph time (bench/timing.py) of the kernel and of the reference over `cold_copies` distinct
state pools / staging buffers / conv weights, so the recurrent state (1 MiB a layer) is cold in L2 as in a real
step; the activations (q, k, v, f, b: just written by the previous kernel in a real step) stay warm.
kda_fused_verify (T = 6) and kda_fused_decode (T = 1, several steps in a row, its head counters back at zero
after every launch) are checked bit for bit against the separate kernels they replace and timed beside them.
The recurrence is swept over BLOCK_V x num_warps at T = 1 and T = 6; each sweep row also checks row invariance
for its config (a T = 6 chain == six T = 1 decode steps, outputs and staged states vs pool states, bit for bit).
`kda_recurrent best T=..` rows name the fastest config per T (peer: fla-core fused_recurrent_kda, 4.5 us at T = 1
and 13.2 us at T = 6, H = 16, on this H200). Decode and verify must share one config to keep row invariance.
    python3 bench/kernel_kda.py            (JSON lines; or through bench/device_kernels.py's run_families)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_copies, graph_time_us  # noqa: E402

H, D, W = 16, 128, 4
P = H * D
LOWER_BOUND = -5.0
EPS = 1e-6
DTYPE = torch.bfloat16
DECODE_T, VERIFY_T = 1, 6
ACCEPT = 3                                   # accept_len used for the commit rows
DECODE_STEPS = 4                             # kda_fused_decode: consecutive steps checked bit for bit
BLOCK_V_SWEEP = (8, 16, 32, 64, 128)
WARPS_SWEEP = (2, 4, 8)
FUSED_BLOCK_V_SWEEP = (16, 32)
COMMIT_SWEEP = ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8))
PEER_US = {DECODE_T: 4.5, VERIFY_T: 13.2}   # fla-core fused_recurrent_kda, H = 16, this H200
STATE_BYTES = H * D * D * 4
BF16_TOL = dict(rtol=2.0 ** -7, atol=1e-2)
STATE_TOL = dict(rtol=1e-4, atol=1e-4)
# fused vs reference: the conv outputs are rounded to bf16 before the recurrence, and one flipped rounding there
# moves the state by about beta * ulp(v); the fused kernel's bits are checked against the separate kernels instead
FUSED_STATE_TOL = dict(rtol=2.0 ** -6, atol=2e-2)


def _row(kernel: str, shape: str, ok: bool, max_abs_err: float | None, bit_exact: bool | None,
         pdl_equal: bool | None, time_us: float | None, ref_time_us: float | None, nbytes: int, **extra) -> dict:
    gbps = nbytes / time_us / 1e3 if time_us else None
    return {"kernel": kernel, "shape": shape, "ok": bool(ok), "max_abs_err": max_abs_err, "bit_exact": bit_exact,
            "pdl_equal": pdl_equal, "time_us": time_us, "ref_time_us": ref_time_us, "bytes": nbytes, "gbps": gbps,
            **extra}


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


def _close(got: torch.Tensor, want: torch.Tensor, tol: dict) -> bool:
    return bool(torch.allclose(got.float(), want.float(), **tol))


def _equal(pairs) -> bool:
    return all(torch.equal(a, b) for a, b in pairs)


class Rec:
    """Recurrence inputs at T positions: warm activations, n cold slots of the state pool, n staging buffers."""

    def __init__(self, T: int, n: int, dev: torch.device, g: torch.Generator, staged: bool, B: int = 1):
        r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
        self.T, self.B, self.n = T, B, n
        self.q, self.k, self.v, self.f = (r(B, T, H, D).to(DTYPE) for _ in range(4))
        self.b = r(B, T, H).to(DTYPE)
        self.A_log = torch.log(torch.rand(H, device=dev, generator=g) * 15 + 1)
        self.dt_bias = 0.1 * r(P)
        self.pool = 0.1 * r(n * B, H, D, D)
        self.slots = [torch.arange(i * B, (i + 1) * B, device=dev, dtype=torch.int32) for i in range(n)]
        self.staging = [torch.empty(B, T, H, D, D, device=dev) for _ in range(n)] if staged else None

    def args(self, i: int = 0, pool: torch.Tensor | None = None) -> tuple:
        return (self.q, self.k, self.v, self.f, self.b, self.A_log, self.dt_bias,
                self.pool if pool is None else pool, self.slots[i])

    def step(self, t: int, pool: torch.Tensor, i: int = 0) -> tuple:
        """Position t alone (a decode step's inputs)."""
        one = lambda x: x[:, t:t + 1]  # noqa: E731
        return (one(self.q), one(self.k), one(self.v), one(self.f), one(self.b), self.A_log, self.dt_bias, pool,
                self.slots[i])

    def nbytes(self, staged: bool) -> int:
        acts = (4 * self.T * P + self.T * H) * 2 + self.T * P * 2          # q, k, v, f, b in; o out
        state = STATE_BYTES * (1 + self.T) if staged else 2 * STATE_BYTES
        return self.B * (acts + state) + H * 4 + P * 4


def _recurrent_rows(dev: torch.device, g: torch.Generator) -> list[dict]:
    from lingc.kernels import kda as K

    rows = []
    for T, staged in ((DECODE_T, False), (VERIFY_T, True)):
        n = cold_copies(STATE_BYTES * (1 + T if staged else 1))
        x = Rec(T, n, dev, g, staged)
        name = "kda_recurrent_staged" if staged else "kda_recurrent"
        shape = f"B=1 T={T} H={H} D={D}"
        ref = K.kda_recurrent_staged_ref if staged else K.kda_recurrent_ref

        def kern(i, pool=None, pdl=False, **cfg):
            extra = (x.staging[i],) if staged else ()
            fn = K.kda_recurrent_staged if staged else K.kda_recurrent
            return fn(*x.args(i, pool), *extra, LOWER_BOUND, pdl=pdl, **cfg)

        def refc(i, pool=None):
            extra = (x.staging[i],) if staged else ()
            return ref(*x.args(i, pool), *extra, LOWER_BOUND)

        # accuracy and PDL at the default config (slot 0); the timing loops below advance x.pool, so keep a copy
        pool0 = x.pool.clone()
        p_got, p_ref, p_pdl = pool0.clone(), pool0.clone(), pool0.clone()
        o = kern(0, p_got)
        st_got = x.staging[0].clone() if staged else p_got[x.slots[0].long()]
        o_ref = refc(0, p_ref)
        st_ref = x.staging[0].clone() if staged else p_ref[x.slots[0].long()]
        o_pdl = kern(0, p_pdl, pdl=True)
        st_pdl = x.staging[0].clone() if staged else p_pdl[x.slots[0].long()]
        err = max(_err(o, o_ref), _err(st_got, st_ref))
        exact = _equal([(o, o_ref), (st_got, st_ref)])
        pdl_eq = _equal([(o, o_pdl), (st_got, st_pdl), (p_got, p_pdl)])
        acc_ok = _close(o, o_ref, BF16_TOL) and _close(st_got, st_ref, STATE_TOL)
        ref_us = graph_time_us([lambda i=i: refc(i) for i in range(n)])
        rows.append(_row(name, shape, acc_ok and pdl_eq, err, exact, pdl_eq, graph_time_us(
            [lambda i=i: kern(i) for i in range(n)]), ref_us, x.nbytes(staged), config="default",
            block_v=K.BLOCK_V, num_warps=K.REC_WARPS,
            time_us_pdl=graph_time_us([lambda i=i: kern(i, pdl=True) for i in range(n)])))

        sweep = []
        for bv in BLOCK_V_SWEEP:
            for warps in WARPS_SWEEP:
                cfg = dict(block_v=bv, num_warps=warps)
                inv = _row_invariant(K, dev, g, cfg)
                o_c = kern(0, pool0.clone(), **cfg)
                acc = _close(o_c, o_ref, BF16_TOL)
                t_us = graph_time_us([lambda i=i: kern(i, **cfg) for i in range(n)])
                sweep.append(_row(name, shape, acc and inv, _err(o_c, o_ref), bool(torch.equal(o_c, o_ref)), None,
                                  t_us, ref_us, x.nbytes(staged), config=f"BV={bv} warps={warps}", block_v=bv,
                                  num_warps=warps, row_invariant=inv))
        rows += sweep
        best = min((r for r in sweep if r["ok"]), key=lambda r: r["time_us"], default=None)
        if best is not None:
            rows.append({**best, "kernel": f"kda_recurrent best T={T}", "peer_us": PEER_US[T],
                         "speedup_vs_peer": PEER_US[T] / best["time_us"]})
    return rows


def _row_invariant(K, dev: torch.device, g: torch.Generator, cfg: dict) -> bool:
    """T = 6 staged chain == six decode steps through the pool, same config: outputs and states, bit for bit."""
    x = Rec(VERIFY_T, 1, dev, g, staged=True)
    o_chain = K.kda_recurrent_staged(*x.args(0), x.staging[0], LOWER_BOUND, **cfg)
    pool = x.pool.clone()
    ok = True
    for t in range(VERIFY_T):
        o_t = K.kda_recurrent(*x.step(t, pool), LOWER_BOUND, **cfg)
        ok &= torch.equal(o_t, o_chain[:, t:t + 1]) and torch.equal(pool[x.slots[0].long()], x.staging[0][:, t])
    return bool(ok)


def _batch2_row(dev: torch.device, g: torch.Generator) -> dict:
    """B = 2 with scattered slots: staged recurrence vs the reference (correctness only)."""
    from lingc.kernels import kda as K

    x = Rec(VERIFY_T, 1, dev, g, staged=True, B=2)
    slots = torch.tensor([3, 1], device=dev, dtype=torch.int32)
    pool = 0.1 * torch.randn(5, H, D, D, device=dev, generator=g)
    st_ref = torch.empty_like(x.staging[0])
    args = (x.q, x.k, x.v, x.f, x.b, x.A_log, x.dt_bias, pool, slots)
    o = K.kda_recurrent_staged(*args, x.staging[0], LOWER_BOUND)
    o_ref = K.kda_recurrent_staged_ref(*args, st_ref, LOWER_BOUND)
    ok = _close(o, o_ref, BF16_TOL) and _close(x.staging[0], st_ref, STATE_TOL)
    return _row("kda_recurrent_staged", f"B=2 T={VERIFY_T} H={H} D={D} slots=[3,1]", ok,
                max(_err(o, o_ref), _err(x.staging[0], st_ref)), bool(torch.equal(o, o_ref)), None, None, None,
                x.nbytes(True))


def _conv_rows(dev: torch.device, g: torch.Generator) -> list[dict]:
    from lingc.kernels import kda as K

    rows = []
    for T, staged in ((DECODE_T, False), (VERIFY_T, True)):
        per_call = P * W * 4 + P * (W - 1) * 2 * (1 + (T if staged else 1)) + 2 * T * P * 2
        n = cold_copies(P * W * 4 + P * (W - 1) * 2)
        x = torch.randn(1, T, P, device=dev, generator=g).to(DTYPE)
        ws = [0.5 * torch.randn(P, 1, W, device=dev, generator=g) for _ in range(n)]
        pools = [torch.randn(1, P, W - 1, device=dev, generator=g).to(DTYPE) for _ in range(n)]
        stg = [torch.empty(1, T, P, W - 1, device=dev, dtype=DTYPE) for _ in range(n)] if staged else None
        slots = torch.zeros(1, device=dev, dtype=torch.int32)
        name = "kda_conv_staged" if staged else "kda_conv"

        def kern(i, pool=None, pdl=False):
            pool = pools[i] if pool is None else pool
            if staged:
                return K.kda_conv_staged(x, ws[i], pool, slots, stg[i], pdl=pdl)
            return K.kda_conv(x, ws[i], pool, slots, pdl=pdl)

        def refc(i, pool=None):
            pool = pools[i] if pool is None else pool
            if staged:
                return K.kda_conv_staged_ref(x, ws[i], pool, slots, stg[i])
            return K.kda_conv_ref(x, ws[i], pool, slots)

        p_got, p_ref, p_pdl = (pools[0].clone() for _ in range(3))
        y = kern(0, p_got)
        s_got = stg[0].clone() if staged else p_got
        y_ref = refc(0, p_ref)
        s_ref = stg[0].clone() if staged else p_ref
        y_pdl = kern(0, p_pdl, pdl=True)
        s_pdl = stg[0].clone() if staged else p_pdl
        exact = _equal([(y, y_ref), (s_got, s_ref)])
        pdl_eq = _equal([(y, y_pdl), (s_got, s_pdl)])
        # chain position t == decode step t (bits), from the same window
        inv = True if staged else None                  # a decode call has no chain to compare
        if staged:
            p = pools[0].clone()
            for t in range(T):
                y_t = K.kda_conv(x[:, t:t + 1], ws[0], p, slots)
                inv &= torch.equal(y_t, y[:, t:t + 1]) and torch.equal(p, s_got[:, t])
        ok = _close(y, y_ref, BF16_TOL) and torch.equal(s_got, s_ref) and pdl_eq and inv is not False
        rows.append(_row(name, f"B=1 T={T} P={P} W={W}", ok, _err(y, y_ref), exact, pdl_eq,
                         graph_time_us([lambda i=i: kern(i) for i in range(n)]),
                         graph_time_us([lambda i=i: refc(i) for i in range(n)]), per_call, row_invariant=inv,
                         time_us_pdl=graph_time_us([lambda i=i: kern(i, pdl=True) for i in range(n)])))
    return rows


def _commit_rows(dev: torch.device, g: torch.Generator) -> list[dict]:
    from lingc.kernels import kda as K

    rows = []
    accept = torch.full((1,), ACCEPT, device=dev, dtype=torch.int32)
    slots = torch.zeros(1, device=dev, dtype=torch.int32)
    for what, inner, dtype in (("state", (H, D, D), torch.float32), ("conv", (P, W - 1), DTYPE)):
        elems = 1
        for s in inner:
            elems *= s
        size = elems * torch.empty((), dtype=dtype).element_size()
        n = cold_copies(size * (VERIFY_T + 1))
        pools = [torch.randn(1, *inner, device=dev, generator=g).to(dtype) for _ in range(n)]
        stg = [torch.randn(1, VERIFY_T, *inner, device=dev, generator=g).to(dtype) for _ in range(n)]
        p_got, p_ref, p_pdl = (pools[0].clone() for _ in range(3))
        K.kda_commit(p_got, slots, stg[0], accept)
        K.kda_commit_ref(p_ref, slots, stg[0], accept)
        K.kda_commit(p_pdl, slots, stg[0], accept, pdl=True)
        exact, pdl_eq = torch.equal(p_got, p_ref), torch.equal(p_got, p_pdl)
        ref_us = graph_time_us([lambda i=i: K.kda_commit_ref(pools[i], slots, stg[i], accept) for i in range(n)])
        for blk, warps in COMMIT_SWEEP:
            t_us = graph_time_us([lambda i=i: K.kda_commit(pools[i], slots, stg[i], accept, block=blk,
                                                             num_warps=warps) for i in range(n)])
            rows.append(_row("kda_commit", f"{what} B=1 TS={VERIFY_T} accept={ACCEPT} {list(inner)}",
                             exact and pdl_eq, _err(p_got, p_ref), exact, pdl_eq, t_us, ref_us, 2 * size,
                             config=f"BLOCK={blk} warps={warps}"))
    return rows


def _norm_rows(dev: torch.device, g: torch.Generator) -> list[dict]:
    from lingc.kernels import kda as K

    rows = []
    weight = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(DTYPE)
    for T in (DECODE_T, VERIFY_T):
        n = cold_copies(2 * T * P * 2)
        xs = [torch.randn(1, T, H, D, device=dev, generator=g).to(DTYPE) for _ in range(n)]
        gates = [torch.randn(1, T, H, D, device=dev, generator=g).to(DTYPE) for _ in range(n)]
        out = K.gated_rmsnorm(xs[0], weight, gates[0], EPS)
        want = K.gated_rmsnorm_ref(xs[0], weight, gates[0], EPS)
        pdl_eq = torch.equal(out, K.gated_rmsnorm(xs[0], weight, gates[0], EPS, pdl=True))
        inv = all(torch.equal(K.gated_rmsnorm(xs[0][:, t:t + 1], weight, gates[0][:, t:t + 1], EPS), out[:, t:t + 1])
                  for t in range(T))
        rows.append(_row("gated_rmsnorm", f"B=1 T={T} H={H} D={D}", _close(out, want, BF16_TOL) and pdl_eq and inv,
                         _err(out, want), bool(torch.equal(out, want)), pdl_eq,
                         graph_time_us([lambda i=i: K.gated_rmsnorm(xs[i], weight, gates[i], EPS) for i in range(n)]),
                         graph_time_us([lambda i=i: K.gated_rmsnorm_ref(xs[i], weight, gates[i], EPS)
                                        for i in range(n)]),
                         3 * T * P * 2 + D * 2, row_invariant=inv))
    return rows


class Fused:
    """kda_fused_verify / kda_fused_decode inputs: raw q/k/v projections, three convs, n cold copies of every pool
    and staging (decode uses no staging)."""

    def __init__(self, T: int, n: int, dev: torch.device, g: torch.Generator):
        r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
        self.T, self.n = T, n
        self.raw = [r(1, T, P).to(DTYPE) for _ in range(3)]
        self.f, self.b = r(1, T, H, D).to(DTYPE), r(1, T, H).to(DTYPE)
        self.ws = [0.5 * r(P, 1, W) for _ in range(3)]
        self.A_log = torch.log(torch.rand(H, device=dev, generator=g) * 15 + 1)
        self.dt_bias = 0.1 * r(P)
        self.cpools = [[r(1, P, W - 1).to(DTYPE) for _ in range(3)] for _ in range(n)]
        self.state = [0.1 * r(1, H, D, D) for _ in range(n)]
        self.slots = torch.zeros(1, device=dev, dtype=torch.int32)
        self.stg = [[torch.empty(1, T, P, W - 1, device=dev, dtype=DTYPE) for _ in range(3)]
                    + [torch.empty(1, T, H, D, D, device=dev)] for _ in range(n)]

    def args(self, i: int) -> tuple:
        return (*self.raw, self.f, self.b, *self.ws, *self.cpools[i], self.A_log, self.dt_bias, self.state[i],
                self.slots)

    def nbytes(self, staged: bool = True) -> int:
        T = self.T
        windows = P * (W - 1) * 2 * ((1 + T) if staged else 2)                 # + staging, or read + write back
        conv = 3 * (P * W * 4 + windows + T * P * 2)                           # weight, windows, x
        state = STATE_BYTES * (1 + T) if staged else 2 * STATE_BYTES
        return conv + state + (T * P + T * H + T * P) * 2 + H * 4 + P * 4


def _fused_rows(dev: torch.device, g: torch.Generator) -> list[dict]:
    """kda_fused_verify at T = 6 vs the separate staged kernels (bits, time) and the reference ops."""
    from lingc.kernels import kda as K

    T = VERIFY_T
    n = cold_copies(STATE_BYTES * (1 + T))
    x = Fused(T, n, dev, g)
    hv = (1, T, H, D)
    shape = f"B=1 T={T} H={H} D={D} W={W}"

    def fused(i, pdl=False, **cfg):
        return K.kda_fused_verify(*x.args(i), *x.stg[i], LOWER_BOUND, pdl=pdl, **cfg)

    def separate(i, **cfg):
        qkv = [K.kda_conv_staged(r, w, p, x.slots, s).view(hv)
               for r, w, p, s in zip(x.raw, x.ws, x.cpools[i], x.stg[i])]
        return K.kda_recurrent_staged(*qkv, x.f, x.b, x.A_log, x.dt_bias, x.state[i], x.slots, x.stg[i][3],
                                      LOWER_BOUND, **cfg)

    def reference(i):
        return K.kda_fused_verify_ref(*x.args(i), *x.stg[i], LOWER_BOUND)

    def staged():
        return [s.clone() for s in x.stg[0]]

    o = fused(0)
    got = staged()
    pdl_eq = torch.equal(o, fused(0, pdl=True)) and _equal(zip(got, x.stg[0]))
    sep_equal = torch.equal(o, separate(0, block_v=K.BLOCK_V, num_warps=K.FUSED_WARPS)) and _equal(zip(got, x.stg[0]))
    o_ref = reference(0)
    want = staged()
    ok = (_close(o, o_ref, BF16_TOL) and _close(got[3], want[3], FUSED_STATE_TOL)
          and _equal(zip(got[:3], want[:3])))
    ref_us = graph_time_us([lambda i=i: reference(i) for i in range(n)])
    rows = [_row("kda_fused_verify", shape, ok and pdl_eq, max(_err(o, o_ref), _err(got[3], want[3])),
                 bool(torch.equal(o, o_ref)), pdl_eq, graph_time_us([lambda i=i: fused(i) for i in range(n)]), ref_us,
                 x.nbytes(), config="default", block_v=K.BLOCK_V, num_warps=K.FUSED_WARPS,
                 equal_to_separate_kernels=bool(sep_equal),
                 separate_kernels_us=graph_time_us([lambda i=i: separate(i) for i in range(n)]),
                 time_us_pdl=graph_time_us([lambda i=i: fused(i, pdl=True) for i in range(n)]))]
    for bv in FUSED_BLOCK_V_SWEEP:
        for warps in WARPS_SWEEP:
            cfg = dict(block_v=bv, num_warps=warps)
            o_c = fused(0, **cfg)
            rows.append(_row("kda_fused_verify", shape, _close(o_c, o_ref, BF16_TOL), _err(o_c, o_ref),
                             bool(torch.equal(o_c, o_ref)), None, graph_time_us([lambda i=i: fused(i, **cfg)
                                                                                 for i in range(n)]),
                             ref_us, x.nbytes(), config=f"BV={bv} warps={warps}", block_v=bv, num_warps=warps))
    return rows


def _fused_decode_rows(dev: torch.device, g: torch.Generator) -> list[dict]:
    """kda_fused_decode at T = 1 vs kda_conv_qkv + kda_recurrent over DECODE_STEPS steps from one set of pools (bits;
    the head counters back at zero after every launch and after the timed graph replays; time) and the
    reference ops."""
    from lingc.kernels import kda as K

    T = DECODE_T
    n = cold_copies(2 * STATE_BYTES)
    x = Fused(T, n, dev, g)
    hv = (1, T, H, D)
    shape = f"B=1 T={T} H={H} D={D} W={W}"
    counters = K.device_counters(dev)

    def pools(i, given):
        return given if given is not None else (x.cpools[i], x.state[i])

    def fused(i, given=None, pdl=False, **cfg):
        cp, st = pools(i, given)
        return K.kda_fused_decode(*x.raw, x.f, x.b, *x.ws, *cp, x.A_log, x.dt_bias, st, x.slots, LOWER_BOUND,
                                  pdl=pdl, **cfg)

    def separate(i, given=None, pdl=False):
        cp, st = pools(i, given)
        qkv = [y.view(hv) for y in K.kda_conv_qkv(*x.raw, *x.ws, *cp, x.slots, pdl=pdl)]
        return K.kda_recurrent(*qkv, x.f, x.b, x.A_log, x.dt_bias, st, x.slots, LOWER_BOUND, pdl=pdl,
                               block_v=K.BLOCK_V, num_warps=K.FUSED_WARPS)

    def reference(i, given=None):
        cp, st = pools(i, given)
        return K.kda_fused_decode_ref(*x.raw, x.f, x.b, *x.ws, *cp, x.A_log, x.dt_bias, st, x.slots, LOWER_BOUND)

    def copy0():
        return [p.clone() for p in x.cpools[0]], x.state[0].clone()

    def same(a, c) -> bool:
        return _equal(zip([*a[0], a[1]], [*c[0], c[1]]))

    got, with_pdl, sep, ref = copy0(), copy0(), copy0(), copy0()
    sep_equal = pdl_eq = zero = acc = exact = True
    err = 0.0
    for _ in range(DECODE_STEPS):
        o = fused(0, got)
        zero &= not bool(counters.any())
        o_pdl = fused(0, with_pdl, pdl=True)
        zero &= not bool(counters.any())
        o_sep, o_ref = separate(0, sep), reference(0, ref)
        sep_equal &= torch.equal(o, o_sep) and same(got, sep)
        pdl_eq &= torch.equal(o, o_pdl) and same(got, with_pdl)
        acc &= _close(o, o_ref, BF16_TOL) and _close(got[1], ref[1], FUSED_STATE_TOL) and _equal(zip(got[0], ref[0]))
        exact &= torch.equal(o, o_ref)
        err = max(err, _err(o, o_ref), _err(got[1], ref[1]))
    ref_us = graph_time_us([lambda i=i: reference(i) for i in range(n)])
    t_us = graph_time_us([lambda i=i: fused(i) for i in range(n)])
    zero_after_replays = not bool(counters.any())
    ok = acc and sep_equal and pdl_eq and zero and zero_after_replays
    rows = [_row("kda_fused_decode", shape, ok, err, bool(exact), pdl_eq, t_us, ref_us, x.nbytes(staged=False),
                 config="default", block_v=K.BLOCK_V, num_warps=K.FUSED_WARPS, steps=DECODE_STEPS,
                 equal_to_separate_kernels=bool(sep_equal), counters_zero=bool(zero and zero_after_replays),
                 separate_kernels_us=graph_time_us([lambda i=i: separate(i) for i in range(n)]),
                 time_us_pdl=graph_time_us([lambda i=i: fused(i, pdl=True) for i in range(n)]),
                 separate_kernels_us_pdl=graph_time_us([lambda i=i: separate(i, pdl=True) for i in range(n)]))]
    for bv in FUSED_BLOCK_V_SWEEP:
        for warps in WARPS_SWEEP:
            cfg = dict(block_v=bv, num_warps=warps)
            p_c, p_r = copy0(), copy0()
            o_c, o_r = fused(0, p_c, **cfg), reference(0, p_r)
            rows.append(_row("kda_fused_decode", shape, _close(o_c, o_r, BF16_TOL) and _equal(zip(p_c[0], p_r[0])),
                             _err(o_c, o_r), bool(torch.equal(o_c, o_r)), None,
                             graph_time_us([lambda i=i: fused(i, **cfg) for i in range(n)]), ref_us,
                             x.nbytes(staged=False), config=f"BV={bv} warps={warps}", block_v=bv, num_warps=warps))
    return rows


# kernels/kda_gluon.py (BLOCK_V, WARPS, FAST_MATH); the first is the default. (8, 4), (16, 8) and (8, 8) measured
# 17.1 / 17.2 / 30.8 us at T = 6 against 10.5 (2026-12-03): every V tile recomputes its head's convs and gates
GLUON_SWEEP = ((16, 4, False), (16, 4, True))   # LATE_TICKET as set (the step A/B varies it)


def _gluon_rows(dev: torch.device, g: torch.Generator) -> list[dict]:
    """kda_fused_verify (T = 6) and kda_fused_decode (T = 1) on the Gluon kernel (kernels/kda_gluon.py), the GPU
    default, per (BLOCK_V, WARPS) of GLUON_SWEEP: close to the Triton kernel and the reference ops (other fp32
    summation orders), PDL on == off bit for bit, row invariant (a verify chain == T Gluon decode steps from the same
    pools: outputs, staged states and staged windows against the pools after each step, bit for bit), the head
    counters back at zero; time against the Triton kernel (PDL on, cold state)."""
    from lingc.kernels import kda as K
    from lingc.kernels import kda_gluon as KG

    T = VERIFY_T
    n = cold_copies(STATE_BYTES * (1 + T))
    x = Fused(T, n, dev, g)
    shape = f"B=1 T={T} H={H} D={D} W={W}"
    counters = K.device_counters(dev)
    if not KG.eligible(dev, D, W, T):
        return [_row("kda_gluon", shape, False, None, None, None, None, None, 0, note="not eligible here",
                     failed=list(KG.FAILED))]
    default = (KG.BLOCK_V, KG.WARPS, KG.FAST_MATH)

    def verify(i, gluon=True, pdl=False):
        KG.ENABLED = gluon
        try:
            return K.kda_fused_verify(*x.args(i), *x.stg[i], LOWER_BOUND, pdl=pdl)
        finally:
            KG.ENABLED = True

    def decode(i, t, cp, st, gluon=True, pdl=False):
        KG.ENABLED = gluon
        one = lambda y: y[:, t:t + 1]  # noqa: E731
        try:
            return K.kda_fused_decode(*[one(r) for r in x.raw], one(x.f), one(x.b), *x.ws, *cp, x.A_log, x.dt_bias,
                                      st, x.slots, LOWER_BOUND, pdl=pdl)
        finally:
            KG.ENABLED = True

    def staged():
        return [s.clone() for s in x.stg[0]]

    o_t = verify(0, gluon=False)
    st_t = staged()
    o_ref = K.kda_fused_verify_ref(*x.args(0), *x.stg[0], LOWER_BOUND)
    st_ref = staged()
    rows = []
    for bv, warps, fast in GLUON_SWEEP:
        KG.BLOCK_V, KG.WARPS, KG.FAST_MATH = bv, warps, fast
        try:
            o_g = verify(0)
            st_g = staged()
            o_gp = verify(0, pdl=True)
            pdl_eq = torch.equal(o_g, o_gp) and _equal(zip(st_g, x.stg[0]))
            close_triton = _close(o_g, o_t, BF16_TOL) and _close(st_g[3], st_t[3], FUSED_STATE_TOL) \
                and _equal(zip(st_g[:3], st_t[:3]))
            close_ref = _close(o_g, o_ref, BF16_TOL) and _close(st_g[3], st_ref[3], FUSED_STATE_TOL) \
                and _equal(zip(st_g[:3], st_ref[:3]))
            # row invariance: T decode steps (Gluon) from the same pools give the chain's bits, position by position
            cp = [p.clone() for p in x.cpools[0]]
            st = x.state[0].clone()
            row_inv = True
            for t in range(T):
                o_d = decode(0, t, cp, st)
                row_inv &= torch.equal(o_d[:, 0], o_g[:, t]) and torch.equal(st[0], st_g[3][0, t])
                row_inv &= all(torch.equal(p[0], s[0, t]) for p, s in zip(cp, st_g[:3]))
            zero = not bool(counters.any())
            # decode against the Triton kernel: DECODE_STEPS steps from one set of pools
            pg = ([p.clone() for p in x.cpools[1]], x.state[1].clone())
            pt = ([p.clone() for p in x.cpools[1]], x.state[1].clone())
            dec_close = True
            dec_err = 0.0
            for _ in range(DECODE_STEPS):
                a = decode(1, 0, *pg, pdl=True)
                b = decode(1, 0, *pt, gluon=False, pdl=True)
                dec_close &= _close(a, b, BF16_TOL) and _close(pg[1], pt[1], FUSED_STATE_TOL) \
                    and _equal(zip(pg[0], pt[0]))
                dec_err = max(dec_err, _err(a, b), _err(pg[1], pt[1]))
            zero &= not bool(counters.any())
            ok = close_triton and close_ref and pdl_eq and row_inv and zero and not KG.FAILED
            rows.append(_row("kda_gluon", shape, ok, max(_err(o_g, o_t), _err(st_g[3], st_t[3])),
                             bool(torch.equal(o_g, o_t)), pdl_eq, None, None, x.nbytes(), block_v=bv,
                             num_warps=warps, fast_math=fast, default=(bv, warps, fast) == default,
                             close_to_triton=bool(close_triton),
                             close_to_reference=bool(close_ref),
                             err_vs_reference=max(_err(o_g, o_ref), _err(st_g[3], st_ref[3])),
                             row_invariant=bool(row_inv), decode_close_to_triton=bool(dec_close),
                             decode_err_vs_triton=dec_err, counters_zero=bool(zero), failed=list(KG.FAILED)))
        finally:
            KG.BLOCK_V, KG.WARPS, KG.FAST_MATH = default
    # times last: the decode timings update the pools they run on
    triton_us = {f"verify_T{T}_triton_us": graph_time_us([lambda i=i: verify(i, False, pdl=True) for i in range(n)])}
    for r in rows:
        KG.BLOCK_V, KG.WARPS, KG.FAST_MATH = r["block_v"], r["num_warps"], r["fast_math"]
        try:
            r["time_us"] = r[f"verify_T{T}_gluon_us"] = graph_time_us([lambda i=i: verify(i, pdl=True)
                                                                       for i in range(n)])
        finally:
            KG.BLOCK_V, KG.WARPS, KG.FAST_MATH = default
    triton_us["decode_T1_triton_us"] = graph_time_us([lambda i=i: decode(i, 0, x.cpools[i], x.state[i], False,
                                                                         pdl=True) for i in range(n)])
    for r in rows:
        KG.BLOCK_V, KG.WARPS, KG.FAST_MATH = r["block_v"], r["num_warps"], r["fast_math"]
        try:
            r["decode_T1_gluon_us"] = graph_time_us([lambda i=i: decode(i, 0, x.cpools[i], x.state[i], pdl=True)
                                                     for i in range(n)])
        finally:
            KG.BLOCK_V, KG.WARPS, KG.FAST_MATH = default
        r.update(triton_us, ref_time_us=triton_us[f"verify_T{T}_triton_us"])
        r["counters_zero"] = r["counters_zero"] and not bool(counters.any())
        r["ok"] = r["ok"] and r["counters_zero"]
    return rows


def _gluon_batch2_row(dev: torch.device, g: torch.Generator) -> dict:
    """The Gluon kernel at B = 2 with scattered slots [3, 1] (a serve batch): kda_fused_verify (T = 6) and one
    kda_fused_decode step, each batch row bit for bit against the same row run alone (B = 1, its slot), and close
    to the Triton kernel at B = 2 (other fp32 summation orders). Correctness only."""
    from lingc.kernels import kda as K
    from lingc.kernels import kda_gluon as KG

    T, B, slots_n = VERIFY_T, 2, 5
    shape = f"B=2 T={T} H={H} D={D} slots=[3,1]"
    if not KG.eligible(dev, D, W, T):
        return _row("kda_gluon_batch2", shape, False, None, None, None, None, None, 0, note="not eligible here")
    r = lambda *sh: torch.randn(*sh, device=dev, generator=g)  # noqa: E731
    raw = [r(B, T, P).to(DTYPE) for _ in range(3)]
    f, b = r(B, T, H, D).to(DTYPE), r(B, T, H).to(DTYPE)
    ws = [0.5 * r(P, 1, W) for _ in range(3)]
    A_log = torch.log(torch.rand(H, device=dev, generator=g) * 15 + 1)
    dt_bias = 0.1 * r(P)
    cpools = [r(slots_n, P, W - 1).to(DTYPE) for _ in range(3)]
    state = 0.1 * r(slots_n, H, D, D)
    slots = torch.tensor([3, 1], device=dev, dtype=torch.int32)

    def stg(n):
        return [torch.empty(n, T, P, W - 1, device=dev, dtype=DTYPE) for _ in range(3)] \
            + [torch.empty(n, T, H, D, D, device=dev)]

    def verify(rows, sl, st, gluon=True):
        enabled, KG.ENABLED = KG.ENABLED, gluon
        try:
            return K.kda_fused_verify(*[x[rows] for x in raw], f[rows], b[rows], *ws, *cpools, A_log, dt_bias, state,
                                      sl, *st, LOWER_BOUND, pdl=True)
        finally:
            KG.ENABLED = enabled

    def decode(rows, sl, cp, stt, gluon=True):
        enabled, KG.ENABLED = KG.ENABLED, gluon
        try:
            return K.kda_fused_decode(*[x[rows, :1] for x in raw], f[rows, :1], b[rows, :1], *ws, *cp, A_log,
                                      dt_bias, stt, sl, LOWER_BOUND, pdl=True)
        finally:
            KG.ENABLED = enabled

    st2, st2_t = stg(2), stg(2)
    o2, o2_t = verify(slice(0, 2), slots, st2), verify(slice(0, 2), slots, st2_t, gluon=False)
    alone = True
    for i in range(B):
        st1 = stg(1)
        o1 = verify(slice(i, i + 1), slots[i:i + 1], st1)
        alone &= torch.equal(o1[0], o2[i]) and all(torch.equal(a[0], c[i]) for a, c in zip(st1, st2))
    close = _close(o2, o2_t, BF16_TOL) and _close(st2[3], st2_t[3], FUSED_STATE_TOL) \
        and _equal(zip(st2[:3], st2_t[:3]))
    # one decode step at B = 2 (it commits into the pools) against each row alone from copies of the same pools
    cp2, s2 = [c.clone() for c in cpools], state.clone()
    d2 = decode(slice(0, 2), slots, cp2, s2)
    dec_alone = True
    for i in range(B):
        cp1, s1 = [c.clone() for c in cpools], state.clone()
        d1 = decode(slice(i, i + 1), slots[i:i + 1], cp1, s1)
        k = int(slots[i])
        dec_alone &= torch.equal(d1[0], d2[i]) and torch.equal(s1[k], s2[k]) \
            and all(torch.equal(a[k], c[k]) for a, c in zip(cp1, cp2))
    torch.cuda.synchronize()
    zero = not bool(K.device_counters(dev).any())
    ok = alone and close and dec_alone and zero and not KG.FAILED
    return _row("kda_gluon_batch2", shape, ok, max(_err(o2, o2_t), _err(st2[3], st2_t[3])),
                bool(torch.equal(o2, o2_t)), None, None, None, 0, rows_equal_alone=bool(alone),
                close_to_triton=bool(close), decode_rows_equal_alone=bool(dec_alone), counters_zero=zero,
                failed=list(KG.FAILED))


def run(device: torch.device) -> list[dict]:
    import lingc  # noqa: F401  (registers the reference ops)

    g = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    sections: list[Callable] = [_conv_rows, _recurrent_rows, _commit_rows, _norm_rows, _fused_rows,
                                _fused_decode_rows]
    from lingc.kernels import kda_gluon
    kda_gluon.ENABLED = False         # these rows check the Triton kernels' bits against each other
    try:
        for section in sections:
            rows += section(device, g)
        rows.append(_batch2_row(device, g))
    finally:
        kda_gluon.ENABLED = True
    rows += _gluon_rows(device, g)
    rows.append(_gluon_batch2_row(device, g))
    return rows


if __name__ == "__main__":
    if sys.argv[1:] == ["--gluon"]:   # only the Gluon kernel's rows
        import lingc  # noqa: F401
        gen = torch.Generator(device="cuda").manual_seed(0)
        for r in _gluon_rows(torch.device("cuda"), gen) + [_gluon_batch2_row(torch.device("cuda"), gen)]:
            print(json.dumps(r))
    else:
        for r in run(torch.device("cuda")):
            print(json.dumps(r))
