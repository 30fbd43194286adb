"""One-shot all-reduce over peer memory: `lingc.all_reduce` as one small Triton launch instead of NCCL's.

Reference op: `torch.ops.lingc.all_reduce` (lingc/ops/dist.py): the W partials summed in fp32 in rank order
(0, 1, ..., W-1), rounded once to the input dtype, the same bits on every rank. At batch 1 the operand is one
to sixteen tokens' hidden vectors (3-50 KB), where NCCL's all-reduce costs ~8 us inside a CUDA graph on the
two H200s (shared/docs/kernels.md 7b) and lingc's op ~11 us with its fp32 copy and cast, 48 times per
Ling-3.0-tiny decode step at TP2. This kernel is the custom all-reduce of vLLM / SGLang / TRT-LLM in one
program, with NCCL's low-latency ("LL") protocol: every rank writes its partial into its own slot of every rank's
peer-mapped workspace as 8-byte words that carry 4 bytes of data and the call's number (stores over NVLink,
posted), then waits until every word of every slot in its own memory carries this call's number and sums them.
No separate flag, no fence: a word is written by one aligned 8-byte store, so a reader that sees the call number
sees the data that came with it, and the one NVLink crossing per call is one-way.

Why our own kernel rather than torch's `symm_mem.one_shot_all_reduce`: the reference numerics (fp32 in rank
order, one rounding, so TP runs agree bit for bit with the CPU / gloo path and `passes.tp.run_lockstep`), a
PDL constexpr like every other launch, and a body a later pass can fuse with the residual add + RMSNorm that
reads it. torch's symmetric memory provides the peer mapping (`torch.distributed._symmetric_memory`: the
allocation, the IPC handle exchange, the mapped addresses), which we do not rewrite.

Measured on the two H200s ([1, 1536] bf16, 50 calls per CUDA graph, bench/device_tp.py): the reference op over
NCCL 10.7-11.0 us per call (fp32 copy, NCCL 8.0-8.4 us, cast); earlier versions of this kernel that signalled
with a flag after the data (release store, acquire spin) took 5.7 us pulling the peers' partials after the flag
and 5.4 us pushing them before it.

Workspace (per process, `enable(group)`): a symmetric uint8 buffer of 2 regions x REGION_BYTES, each region W
slots (one per source rank) of 8-byte words, a local int64 call counter and a local int32 timeout counter. Call c
(1, 2, ...; read from the counter, so it advances inside replayed CUDA graphs as well) uses region c % 2:

    for each rank p: word i of slot `rank` of p's region := (c << 32) | x_word[i]        (x viewed as int32)
    for each rank p = 0..W-1: poll slot p of my region (volatile loads) until every word's high half is c
                              [bounded: MAX_SPINS polls, then count a timeout and go on, never hang]
    out = sum over p of float(slot p's data) in rank order (bf16: two per word), cast once;  counter := c

Alternating regions make a reset or closing barrier unnecessary: a rank writes into region c % 2 again at call
c + 2, which it reaches only after reading every peer's call c + 1 words, and a peer writes those only after
finishing call c (its reads included: with PDL on, `gdc_wait` comes first and the trigger follows the last read).
Words left from call c - 2 carry c - 2 (and the zeroed buffer 0), never c. Every rank must run the same sequence
of one-shot calls: the tp pass makes the ranks' graphs identical and the runtime replays them in lockstep; the
size gate (MAX_BYTES) depends on shapes only, so it picks the same path on every rank. A dead peer makes the poll
time out after MAX_SPINS polls instead of hanging the GPU for good (`timeouts()` counts it; the TP runtime's
watchdog ends the process first, and rank 0's engine refuses a request's result if the count moved, runtime/tp.py).

all_reduce is one program: at batch 1 the operand is at most a few tens of KB and the cost is the NVLink latency,
not bandwidth. all_reduce_add_rmsnorm is one program per row (each row's words go through the protocol on their
own, so the row norms run in parallel; the last program to finish advances the counter, after every program has
read it). Operands above MAX_BYTES (prefill chunks), of other dtypes, and CPU tensors use the reference op
(NCCL / gloo), as does every call before `enable` (and `LINGC_ALL_REDUCE=nccl` keeps it off).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

import lingc.ops  # noqa: F401  (registers torch.ops.lingc.*, the fallback)
from lingc.kernels.pdl import pdl_supported
from lingc.kernels.rmsnorm import _add_rmsnorm_row, _num_warps
from lingc.kernels.rmsnorm import add_rmsnorm as _add_rmsnorm_launch

# Tunables (none changes an output bit)
REGION_BYTES = 512 * 1024     # one region of the workspace per call parity (W slots of 8-byte words)
MAX_BYTES = 64 * 1024         # operands up to this size take the one-shot kernel (decode / verify: 3-37 KB)
BLOCK = 1024                  # 4-byte words per step of the push and sum loops
NUM_WARPS = 4
MAX_SPINS = 1 << 30           # polls of one peer's block before giving up on it (minutes: a rank still compiling
                              # kernels must not time out; a dead one is ended by the TP watchdog long before)
ENV = "LINGC_ALL_REDUCE"      # "nccl": never enable the one-shot path
HIGH = tl.constexpr(-(1 << 32))  # int64 mask of a word's high half (the call number)
LOW = tl.constexpr((1 << 32) - 1)  # and of its low half (the data)


@triton.jit
def _push_and_sum(xw_ptr, dstw_ptr, bufs_ptr, calls_ptr, timeouts_ptr, first, words, region_words, slot_words, rank,
                  max_spins, WORLD: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """The protocol (module docstring) up to the sum, over words [first, words) of the operand: the summed words
    stored at dstw_ptr (same indices). Returns this call's number."""
    call = tl.load(calls_ptr) + 1                                          # int64: this call's number
    flag = (call & LOW) << 32                                              # ... in a word's high half
    base = (call % 2) * region_words
    for start in range(first, words, BLOCK):                               # push: (flag | data) words into slot
        offs = start + tl.arange(0, BLOCK)                                 # `rank` of every rank's region
        m = offs < words
        packed = flag | (tl.load(xw_ptr + offs, mask=m).to(tl.int64) & LOW)
        for p in tl.static_range(WORLD):
            dst = tl.load(bufs_ptr + p).to(tl.pointer_type(tl.int64)) + base + rank * slot_words
            tl.store(tl.multiple_of(dst, 16) + offs, packed, mask=m)
    mine = tl.multiple_of(tl.load(bufs_ptr + rank).to(tl.pointer_type(tl.int64)) + base, 16)
    for start in range(first, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < words
        for p in tl.static_range(WORLD):                                   # rank order, as fold_sum
            src = mine + p * slot_words + offs
            v = tl.load(src, mask=m, other=flag, volatile=True)
            ready = tl.min(((v & HIGH) == flag).to(tl.int32), axis=0)
            spins = 0
            while (ready == 0) & (spins < max_spins):                    # words still from call - 2 (or 0)
                v = tl.load(src, mask=m, other=flag, volatile=True)
                ready = tl.min(((v & HIGH) == flag).to(tl.int32), axis=0)
                spins += 1
            if ready == 0:
                tl.atomic_add(timeouts_ptr, 1)
            d = (v & LOW).to(tl.int32)
            if BF16:                                                       # two bf16 per word: low, high half
                lo = (d << 16).to(tl.float32, bitcast=True)
                hi = (d & -65536).to(tl.float32, bitcast=True)
                if p == 0:
                    acc_lo, acc_hi = lo, hi
                else:
                    acc_lo += lo
                    acc_hi += hi
            else:
                f = d.to(tl.float32, bitcast=True)
                if p == 0:
                    acc = f
                else:
                    acc += f
        if BF16:
            lo16 = acc_lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 65535
            hi16 = acc_hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
            tl.store(dstw_ptr + offs, hi16 | lo16, mask=m)
        else:
            tl.store(dstw_ptr + offs, acc.to(tl.int32, bitcast=True), mask=m)
    return call


@triton.jit
def _one_shot_kernel(xw_ptr, outw_ptr, bufs_ptr, calls_ptr, timeouts_ptr, words, region_words, slot_words, rank,
                     max_spins, WORLD: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    call = _push_and_sum(xw_ptr, outw_ptr, bufs_ptr, calls_ptr, timeouts_ptr, 0, words, region_words, slot_words,
                         rank, max_spins, WORLD, BLOCK, BF16)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(calls_ptr, call)


@triton.jit
def _one_shot_add_rmsnorm_kernel(xw_ptr, res_ptr, w_ptr, out_ptr, outw_ptr, res_out_ptr, bufs_ptr, calls_ptr,
                                 done_ptr, timeouts_ptr, rows, N, eps, region_words, slot_words, rank, max_spins,
                                 WORLD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BF16: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the row's words go through the protocol, its sum lands in `out` (the all_reduce's
    rounding), then the row's add + norm reads it back and overwrites it with kernels/rmsnorm.py's own row code, so
    the pair of kernels and this one agree bit for bit. The last program to finish advances the call counter."""
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)                        # a weight: before the wait
    if PDL:
        tl.extra.cuda.gdc_wait()
    row_words = N // 2 if BF16 else N
    call = _push_and_sum(xw_ptr, outw_ptr, bufs_ptr, calls_ptr, timeouts_ptr, r * row_words, (r + 1) * row_words,
                         region_words, slot_words, rank, max_spins, WORLD, BLOCK, BF16)
    tl.debug_barrier()                                                     # the summed row, for every thread
    res = tl.load(res_ptr + r * N + cols, mask=mask, other=0.0)
    x = tl.load(out_ptr + r * N + cols, mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _add_rmsnorm_row(res, x, w, out_ptr + r * N, res_out_ptr + r * N, cols, mask, N, eps)
    finished = tl.atomic_add(done_ptr, 1, sem="acq_rel")                  # every program has read the counter
    if finished == rows - 1:
        tl.store(done_ptr, 0)
        tl.store(calls_ptr, call)


@dataclass
class Workspace:
    """This rank's view of the peer-mapped workspace (see the module docstring)."""

    rank: int
    world: int
    device: torch.device
    bufs: torch.Tensor         # int64 [W]: every rank's data buffer address, as mapped in this process
    calls: torch.Tensor        # int64 [1]: calls made (local)
    timeouts: torch.Tensor     # int32 [1]: peers given up on (local)
    done: torch.Tensor         # int32 [1]: programs of the running fused call that finished (local, back to 0)
    region_bytes: int
    keep: tuple = ()           # the symmetric tensor and handle (the mapping lives as long as they do)

    @property
    def slot_words(self) -> int:
        """8-byte words per rank's slot of a region (a multiple of 2: 16-byte aligned)."""
        return self.region_bytes // 8 // self.world // 2 * 2

    @property
    def max_bytes(self) -> int:
        """The largest operand: one 4-byte data word per slot word."""
        return self.slot_words * 4


_WORKSPACE: Workspace | None = None


def _new(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised output (the kernels write every element; tests poison it here)."""
    return torch.empty_like(like)


def _peer_addresses(t: torch.Tensor, handle: Any, rank: int) -> list[int]:
    """t's address in every rank's mapping: each peer's buffer base + t's offset in this rank's buffer."""
    offset = t.data_ptr() - handle.buffer_ptrs[rank]
    if not 0 <= offset < handle.buffer_size:
        raise RuntimeError(f"symmetric tensor at offset {offset} outside its buffer of {handle.buffer_size} bytes")
    return [base + offset for base in handle.buffer_ptrs]


def enable(group: Any = None, region_bytes: int = REGION_BYTES) -> Workspace | None:
    """Map the workspace across the ranks of `group` (collective: every rank calls it) and route the lowered
    `all_reduce` through the one-shot kernel. Returns None (NCCL stays) without CUDA or an NCCL process group, with
    LINGC_ALL_REDUCE=nccl, or when the peer mapping fails on any rank (printed to stderr: the run goes on, slower);
    the ranks vote, so they all take the same path."""
    global _WORKSPACE
    import torch.distributed as dist
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend(group) != "nccl":
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    ws = None
    try:
        if os.environ.get(ENV, "").lower() == "nccl":
            raise RuntimeError(f"{ENV}=nccl")                 # still votes below: every rank takes one path
        import torch.distributed._symmetric_memory as symm_mem
        group = group or dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        data = symm_mem.empty(2 * region_bytes, dtype=torch.uint8, device=device)
        data.zero_()                                      # call numbers start at 1: no word looks ready
        torch.cuda.synchronize(device)                    # zeroed before any peer can write (rendezvous is collective)
        handle = symm_mem.rendezvous(data, group)
        ws = Workspace(rank, world, device,
                       torch.tensor(_peer_addresses(data, handle, rank), dtype=torch.int64, device=device),
                       torch.zeros(1, dtype=torch.int64, device=device),
                       torch.zeros(1, dtype=torch.int32, device=device),
                       torch.zeros(1, dtype=torch.int32, device=device), region_bytes, (data, handle))
    except Exception as e:                                # noqa: BLE001 -- optional fast path, reported
        if os.environ.get(ENV, "").lower() != "nccl":
            print(f"lingc: one-shot all-reduce unavailable ({type(e).__name__}: {e}); using NCCL", file=sys.stderr)
        ws = None
    # every rank must take the same path (a one-shot call waits for its peers' one-shot calls): one vote, over NCCL
    agreed = torch.tensor([0 if ws is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if int(agreed.item()) == 0:
        if ws is not None:
            print("lingc: one-shot all-reduce unavailable on another rank; using NCCL", file=sys.stderr)
        return None
    _WORKSPACE = ws
    return ws


def disable() -> Workspace | None:
    """Route `all_reduce` back to the reference op (NCCL); returns the workspace (`use` puts it back). Graphs
    captured before keep what they captured."""
    global _WORKSPACE
    ws, _WORKSPACE = _WORKSPACE, None
    return ws


def use(ws: Workspace | None) -> None:
    """Route `all_reduce` through `ws` (from `enable` / `disable`; None: the reference op)."""
    global _WORKSPACE
    _WORKSPACE = ws


def active() -> Workspace | None:
    return _WORKSPACE


def timeouts() -> int:
    """Peers the kernel gave up waiting for since `enable` (a host read: not for the step path)."""
    return int(_WORKSPACE.timeouts.item()) if _WORKSPACE is not None else 0


def launch(x: torch.Tensor, ws: Workspace, *, pdl: bool = False, max_spins: int = MAX_SPINS) -> torch.Tensor:
    """The one-shot kernel on x (bf16 or fp32, a whole number of 4-byte words, at most ws.max_bytes, on ws.device)
    -> the sum over the ranks."""
    if x.dtype not in (torch.bfloat16, torch.float32) or x.nbytes % 4:
        raise ValueError(f"all_reduce: the one-shot kernel takes bf16 / fp32 operands of whole 4-byte words, got "
                         f"{x.dtype} {list(x.shape)}")
    if x.nbytes > ws.max_bytes:
        raise ValueError(f"all_reduce: {x.nbytes} bytes do not fit a workspace slot ({ws.max_bytes} bytes)")
    x = x.contiguous()
    out = _new(x)
    _one_shot_kernel[(1,)](x.view(-1).view(torch.int32), out.view(-1).view(torch.int32), ws.bufs, ws.calls,
                           ws.timeouts, x.nbytes // 4, ws.region_bytes // 8, ws.slot_words, ws.rank, max_spins,
                           WORLD=ws.world, BLOCK=BLOCK, BF16=x.dtype == torch.bfloat16,
                           PDL=pdl and pdl_supported(x.device), num_warps=NUM_WARPS)
    return out


def _one_shot_ok(x: torch.Tensor, world_size: int, ws: Workspace | None) -> bool:
    return (ws is not None and world_size > 1 and ws.world == world_size and x.device == ws.device
            and x.dtype in (torch.bfloat16, torch.float32) and x.nbytes % 4 == 0
            and x.nbytes <= min(MAX_BYTES, ws.max_bytes))


def all_reduce(x: torch.Tensor, world_size: int, *, pdl: bool = False) -> torch.Tensor:
    """torch.ops.lingc.all_reduce through the one-shot kernel when a workspace for world_size ranks on x's device
    is enabled and x fits (MAX_BYTES, bf16 / fp32, whole words); otherwise the reference op."""
    if not _one_shot_ok(x, world_size, _WORKSPACE):
        return torch.ops.lingc.all_reduce(x, world_size)
    return launch(x, _WORKSPACE, pdl=pdl)


def launch_add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, ws: Workspace, *,
                       pdl: bool = False, max_spins: int = MAX_SPINS) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel: (rmsnorm(residual + sum), residual + sum), sum the one-shot all-reduce of x."""
    if residual.shape != x.shape or residual.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"all_reduce_add_rmsnorm: residual {list(residual.shape)} {residual.dtype}, x "
                         f"{list(x.shape)} {x.dtype}, weight {list(weight.shape)}; want residual and x alike and "
                         f"weight [{x.shape[-1]}]")
    if x.dtype not in (torch.bfloat16, torch.float32) or x.shape[-1] % 2 or x.nbytes > ws.max_bytes:
        raise ValueError(f"all_reduce_add_rmsnorm: the fused kernel takes bf16 / fp32 rows of even width up to "
                         f"{ws.max_bytes} bytes, got {x.dtype} {list(x.shape)}")
    x, residual = x.contiguous(), residual.contiguous()
    n = x.shape[-1]
    out, res_out = _new(x), _new(x)
    block_n = triton.next_power_of_2(n)
    rows = x.numel() // n
    _one_shot_add_rmsnorm_kernel[(rows,)](
        x.view(-1).view(torch.int32), residual, weight, out, out.view(-1).view(torch.int32), res_out, ws.bufs,
        ws.calls, ws.done, ws.timeouts, rows, n, eps, ws.region_bytes // 8, ws.slot_words, ws.rank, max_spins,
        WORLD=ws.world, BLOCK=BLOCK, BLOCK_N=block_n, BF16=x.dtype == torch.bfloat16,
        PDL=pdl and pdl_supported(x.device), num_warps=_num_warps(block_n))
    return out, res_out


def all_reduce_add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                           world_size: int, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops.lingc.all_reduce_add_rmsnorm: the fused one-shot kernel when `all_reduce` would take the one-shot
    path and the row is even; else the all_reduce launcher (reference op) then the add_rmsnorm kernel."""
    ws = _WORKSPACE
    if _one_shot_ok(x, world_size, ws) and x.shape[-1] % 2 == 0 and residual.shape == x.shape:
        return launch_add_rmsnorm(residual, x, weight, eps, ws, pdl=pdl)
    return _add_rmsnorm_launch(residual, all_reduce(x, world_size), weight, eps, pdl=pdl)


LOWERINGS = {"all_reduce": all_reduce, "all_reduce_add_rmsnorm": all_reduce_add_rmsnorm}
