"""One-shot all-reduce over peer memory: `lingc.all_reduce` as one small Triton launch instead of NCCL's.

Reference op: `torch.ops.lingc.all_reduce` (lingc/ops/dist.py): the W partials summed in fp32 in rank order
(0, 1, ..., W-1), rounded once to the input dtype, the same bits on every rank. At batch 1 the operand is one
to sixteen tokens' hidden vectors (3-50 KB), where NCCL's all-reduce costs ~8 us inside a CUDA graph on the
two H200s (shared/docs/kernels.md 7b) and lingc's op ~11 us with its fp32 copy and cast, 48 times per
Ling-3.0-tiny decode step at TP2. This kernel is the custom all-reduce of vLLM / SGLang / TRT-LLM in one
program: every rank writes its partial into its own slot of every rank's peer-mapped workspace (stores over
NVLink, posted), signals every peer, waits for every peer's signal, then sums the W partials from its own memory.
Measured on the two H200s (bench/device_tp.py, [1, 1536] bf16, 50 calls per CUDA graph): 5.7 us per call when
each rank pulled the peers' partials after the signals (a remote-read round trip after the flag's), against
10.7 us for the reference op over NCCL.

Why our own kernel rather than torch's `symm_mem.one_shot_all_reduce`: the reference numerics (fp32 in rank
order, one rounding, so TP runs agree bit for bit with the CPU / gloo path and `passes.tp.run_lockstep`), a
PDL constexpr like every other launch, and a body a later pass can fuse with the residual add + RMSNorm that
reads it. torch's symmetric memory provides the peer mapping (`torch.distributed._symmetric_memory`: the
allocation, the IPC handle exchange, the mapped addresses), which we do not rewrite.

Workspace (per process, `enable(group)`): a symmetric uint8 buffer of 2 regions x REGION_BYTES, each region W
slots (one per source rank), a symmetric int64 flag vector [W] (flags[r] on a rank: the last call number rank r
has signalled it), a local int64 call counter and a local int32 timeout counter. Call c (1, 2, ...; read from the
counter, so it advances inside replayed CUDA graphs as well) uses region c % 2:

    for each rank p: x -> slot `rank` of p's region;  CTA barrier
    for each rank p: p's flags[rank] := c (release, system scope)
    for each rank p: spin until my flags[p] >= c (acquire, system scope)   [bounded: MAX_SPINS, then count a
                                                                            timeout and go on, never hang]
    CTA barrier;  out = sum over p = 0..W-1 of float(my region's slot p), cast once;  counter := c

Alternating regions replaces a closing barrier: a rank writes into region c % 2 again at call c + 2, which it reaches
only after call c + 1's signals, and every peer sends those only after finishing call c (its reads included: the
kernel waits for the previous kernel with PDL on, `gdc_wait` comes first, and it triggers its dependents only
after its last read). Flags only grow, so a peer that is already one call ahead is no problem (>= c). Every rank
must run the same sequence of one-shot calls: the tp pass makes the ranks' graphs identical and the runtime
replays them in lockstep; the size gate (MAX_BYTES) depends on shapes only, so it picks the same path on every
rank. A dead peer makes the spin time out (`timeouts()` counts it; the TP runtime's watchdog ends the process).

The slots are read with plain loads: the system-scope acquire load of the flag (`ld.acquire.sys`, which also
invalidates the SM's L1) followed by the CTA barrier orders them after the peers' released writes (the PTX memory
model; torch's symmetric-memory kernels use the same signal pattern: CTA barrier, then a release by one thread).

One program: at batch 1 the operand is at most a few tens of KB and the cost is the NVLink round trip of the
flags, not bandwidth. Operands above MAX_BYTES (or a slot) (prefill chunks) and CPU tensors use the reference
op (NCCL / gloo), as does every call before `enable` (and `LINGC_ALL_REDUCE=nccl` keeps it off).
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

# Tunables (none changes an output bit)
REGION_BYTES = 256 * 1024     # one region of the workspace per call parity
MAX_BYTES = 64 * 1024         # operands up to this size take the one-shot kernel (decode / verify: 3-37 KB)
BLOCK = 2048                  # elements per step of the copy and sum loops
NUM_WARPS = 4
MAX_SPINS = 1 << 26           # polls of one flag before the kernel gives up on a peer (seconds, not a hang)
ENV = "LINGC_ALL_REDUCE"      # "nccl": never enable the one-shot path


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, bufs_ptr, flags_ptr, calls_ptr, timeouts_ptr, numel, region_elems, slot_elems,
                     rank, max_spins, WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    dt = x_ptr.dtype.element_ty
    call = tl.load(calls_ptr) + 1                                          # int64: this call's number
    base = (call % 2) * region_elems
    for start in range(0, numel, BLOCK):                                   # push: my partial into slot `rank` of
        offs = start + tl.arange(0, BLOCK)                                 # every rank's region (stores to peers
        m = offs < numel                                                   # are posted, not waited for)
        x = tl.load(x_ptr + offs, mask=m)
        for p in tl.static_range(WORLD):
            dst = tl.multiple_of(tl.load(bufs_ptr + p).to(tl.pointer_type(dt)) + base + rank * slot_elems, 16)
            tl.store(dst + offs, x, mask=m)
    tl.debug_barrier()                                                     # every thread's stores are issued
    for p in tl.static_range(WORLD):
        peer_flags = tl.load(flags_ptr + p).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(peer_flags + rank, call, sem="release", scope="sys")
    my_flags = tl.load(flags_ptr + rank).to(tl.pointer_type(tl.int64))
    for p in tl.static_range(WORLD):
        seen = tl.atomic_add(my_flags + p, 0, sem="acquire", scope="sys")
        spins = 0
        while (seen < call) & (spins < max_spins):
            seen = tl.atomic_add(my_flags + p, 0, sem="acquire", scope="sys")
            spins += 1
        if seen < call:
            tl.atomic_add(timeouts_ptr, 1)
    tl.debug_barrier()                                                     # the acquire orders every thread's reads
    mine = tl.multiple_of(tl.load(bufs_ptr + rank).to(tl.pointer_type(dt)) + base, 16)
    for start in range(0, numel, BLOCK):                                   # every partial is local now
        offs = start + tl.arange(0, BLOCK)
        m = offs < numel
        acc = tl.load(mine + offs, mask=m).to(tl.float32)                  # rank 0's first, as fold_sum
        for p in tl.static_range(1, WORLD):
            acc += tl.load(mine + p * slot_elems + offs, mask=m).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dt), mask=m)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(calls_ptr, call)


@dataclass
class Workspace:
    """This rank's view of the peer-mapped workspace (see the module docstring)."""

    rank: int
    world: int
    device: torch.device
    bufs: torch.Tensor         # int64 [W]: every rank's data buffer address, as mapped in this process
    flags: torch.Tensor        # int64 [W]: every rank's flag vector address
    calls: torch.Tensor        # int64 [1]: calls made (local)
    timeouts: torch.Tensor     # int32 [1]: peers given up on (local)
    region_bytes: int
    keep: tuple = ()           # the symmetric tensors and handles (the mapping lives as long as they do)

    @property
    def slot_bytes(self) -> int:
        """Bytes per rank's slot of a region (16-byte aligned): the largest operand."""
        return self.region_bytes // self.world // 16 * 16


_WORKSPACE: Workspace | None = None


def _peer_addresses(t: torch.Tensor, handle: Any, rank: int) -> list[int]:
    """t's address in every rank's mapping: each peer's buffer base + t's offset in this rank's buffer."""
    offset = t.data_ptr() - handle.buffer_ptrs[rank]
    if not 0 <= offset < handle.buffer_size:
        raise RuntimeError(f"symmetric tensor at offset {offset} outside its buffer of {handle.buffer_size} bytes")
    return [base + offset for base in handle.buffer_ptrs]


def enable(group: Any = None, region_bytes: int = REGION_BYTES) -> Workspace | None:
    """Map the workspace across the ranks of `group` (collective: every rank calls it) and route the lowered
    `all_reduce` through the one-shot kernel. Returns None (NCCL stays) when LINGC_ALL_REDUCE=nccl, on CPU, or
    when the peer mapping fails (printed to stderr: the run goes on, slower)."""
    global _WORKSPACE
    import torch.distributed as dist
    if os.environ.get(ENV, "").lower() == "nccl":
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is None or dist.get_backend(group) != "nccl":
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        group = group or dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        data = symm_mem.empty(2 * region_bytes, dtype=torch.uint8, device=device)
        flags = symm_mem.empty(world, dtype=torch.int64, device=device)
        flags.zero_()
        torch.cuda.synchronize(device)                    # zeroed before any peer can signal (rendezvous is collective)
        h_data = symm_mem.rendezvous(data, group)
        h_flags = symm_mem.rendezvous(flags, group)
        ws = Workspace(rank, world, device,
                       torch.tensor(_peer_addresses(data, h_data, rank), dtype=torch.int64, device=device),
                       torch.tensor(_peer_addresses(flags, h_flags, rank), dtype=torch.int64, device=device),
                       torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int32, device=device),
                       region_bytes, (data, flags, h_data, h_flags))
        dist.barrier(group)
    except Exception as e:                                # noqa: BLE001 -- optional fast path, reported
        print(f"lingc: one-shot all-reduce unavailable ({type(e).__name__}: {e}); using NCCL", file=sys.stderr)
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
    """The one-shot kernel on x (contiguous, on ws.device, at most ws.region_bytes) -> the sum over ranks."""
    if x.nbytes > ws.slot_bytes:
        raise ValueError(f"all_reduce: {x.nbytes} bytes do not fit a {ws.slot_bytes}-byte workspace slot")
    x = x.contiguous()
    out = torch.empty_like(x)
    _one_shot_kernel[(1,)](x, out, ws.bufs, ws.flags, ws.calls, ws.timeouts, x.numel(),
                           ws.region_bytes // x.element_size(), ws.slot_bytes // x.element_size(), ws.rank,
                           max_spins, WORLD=ws.world, BLOCK=BLOCK, PDL=pdl and pdl_supported(x.device),
                           num_warps=NUM_WARPS)
    return out


def all_reduce(x: torch.Tensor, world_size: int, *, pdl: bool = False) -> torch.Tensor:
    """torch.ops.lingc.all_reduce through the one-shot kernel when a workspace for world_size ranks on x's device
    is enabled and x is at most MAX_BYTES; otherwise the reference op."""
    ws = _WORKSPACE
    if (ws is None or world_size == 1 or ws.world != world_size or x.device != ws.device
            or x.nbytes > min(MAX_BYTES, ws.slot_bytes)):
        return torch.ops.lingc.all_reduce(x, world_size)
    return launch(x, ws, pdl=pdl)


LOWERINGS = {"all_reduce": all_reduce}
