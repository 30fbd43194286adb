"""What a kernel costs an H200 SM before it runs: registers, spills, shared memory, CTAs an SM, MMA instructions.

Compiles lingc's Triton kernels (the MoE GEMMs, the MLA split, the fused KDA kernels, the skinny GEMM, filtered_probs'
round kernel) offline for sm_90 (triton.compile with a GPUTarget: no GPU needed, the ptxas and cuobjdump that ship with
Triton do the rest) at Ling-3.0-tiny's shapes, with the launchers' 16-divisible pointers, and reads the cubin's
resource usage and SASS. Use it to
plan a device call: whether a tiling puts a verify's programs in one wave, whether a dot became a Hopper wgmma or
stayed an mma.sync (the MoE pair grid's swap-AB tiles are wgmma; `bench/results/kernels-moe-swap-h200-20261202.json`
is what that bought), whether a change spills, and how many SASS instructions each loop body issues (`sass_loops`: a
layout change can multiply a loop's work, as filtered_probs' binning step showed). Numbers are ptxas's, not a
measurement of speed.

    python3 bench/kernel_resources.py            # one JSON line per kernel variant

CTAs an SM are the minimum over the H200's limits: 64K registers (allocated per warp in units of 256), 228 KB of
shared memory (227 KB a block, 1 KB reserved a block), 2048 threads and 32 blocks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
REGS_PER_SM, REG_UNIT = 65536, 256        # registers an SM; a warp's allocation granularity
SMEM_PER_SM, SMEM_PER_BLOCK, SMEM_RESERVED = 228 * 1024, 227 * 1024, 1024
THREADS_PER_SM, BLOCKS_PER_SM = 2048, 32


def ctas_per_sm(regs: int, smem: int, num_warps: int) -> int:
    """Resident CTAs an SM for a kernel of `regs` registers a thread, `smem` bytes of shared memory, num_warps."""
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    by_regs = REGS_PER_SM // (per_warp * num_warps)
    by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED) if smem <= SMEM_PER_BLOCK else 0
    return min(by_regs, by_smem, THREADS_PER_SM // (32 * num_warps), BLOCKS_PER_SM)


def resources(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
              divisible: tuple[int, ...] = ()) -> dict:
    """Compile fn for sm_90 and read its cubin: registers, local memory (spills), shared memory, CTAs an SM, and
    the PTX's mma.sync / wgmma counts. `divisible`: argument indices the launcher's pointers and strides have
    16-divisible (Triton's specialisation; without it loads are not vectorised and the counts mislead)."""
    if os.environ.get("TRITON_INTERPRET") == "1":    # kernels decorated under the interpreter cannot be compiled
        raise RuntimeError("bench/kernel_resources.py compiles for sm_90: run it without TRITON_INTERPRET=1")
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=SM90,
                            options={"num_warps": num_warps, "num_stages": num_stages})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    field = lambda name: int(re.search(rf"{name}:(\d+)", usage).group(1))   # noqa: E731
    regs, smem, ptx = field("REG"), kernel.metadata.shared, kernel.asm["ptx"]
    return {"registers": regs, "local_bytes": field("LOCAL") + field("STACK"), "shared_bytes": smem,
            "num_warps": num_warps, "num_stages": num_stages, "ctas_per_sm": ctas_per_sm(regs, smem, num_warps),
            "mma_sync": ptx.count("mma.sync"), "wgmma": ptx.count("wgmma.mma_async"), "sass_loops": sass_loops(sass)}


def sass_loops(sass: str) -> list[int]:
    """The SASS instruction count of every loop body (a backward branch's target up to the branch), in code order:
    what one iteration of a loop issues a warp, before stalls."""
    pat = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
    insts = [(int(m.group(1), 16), m.group(2)) for m in map(pat.match, sass.splitlines()) if m]
    where = {addr: i for i, (addr, _) in enumerate(insts)}
    loops = []
    for i, (addr, text) in enumerate(insts):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in where:
            loops.append((where[int(m.group(1), 16)], i - where[int(m.group(1), 16)] + 1))
    return [n for _, n in sorted(loops)]


def _moe_rows() -> list[dict]:
    import lingc.kernels.moe as M
    sig = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
               total_ptr="*i32", num_pairs="i32", num_experts="i32", N="i32", K="i32", stride_am="i32",
               stride_we="i32", stride_wn="i32", stride_om="i32", limit="fp32")
    base = dict(TOP_K=9, BLOCK_M=16, TILE_M=16, EVEN_K=True, SWIGLU=True, HAS_LIMIT=False, IEEE_DOT=False,
                LIBDEVICE_EXP=True, PDL=True, PREFETCH=False, K_LINES=32, LINE=64, K_CHUNKS=0, BY_IDS=False,
                PAIR_ROWS=1, PR_BLOCK=16)
    up_pairs, down = dict(BY_IDS=True, PAIR_ROWS=9), dict(SWIGLU=False, TOP_K=1)
    cases = [("moe_up_act (decode, aligned)", M.UP_CONFIG, {}),
             ("moe_up_act_pairs (verify)", M.UP_PAIRS_CONFIG, up_pairs),
             ("moe_down (decode, preload)", M.DOWN_CONFIG, dict(down, K_CHUNKS=4)),
             ("moe_down_pairs (verify)", M.DOWN_PAIRS_CONFIG, dict(down, BY_IDS=True, PAIR_ROWS=9))]
    rows = []
    for name, cfg, over in cases:
        const = dict(base, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP_AB=cfg.swap_ab, **over)
        rows.append({"kernel": name, "config": cfg._asdict(),
                     **resources(M._moe_gemm_kernel, sig, const, cfg.num_warps, cfg.num_stages,
                                 divisible=(0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13))})
    return rows


def _mla_rows() -> list[dict]:
    import lingc.kernels.mla as K
    sig = dict(qlat_ptr="*bf16", qrope_ptr="*bf16", kv_ptr="*bf16", pages_ptr="*i32", pos_ptr="*i32",
               part_o_ptr="*fp32", part_ml_ptr="*fp32", T="i32", S="i32", CAP="i32", qk_scale="fp32",
               stride_rb="i32", stride_rt="i32", stride_rh="i32", stride_page="i32", stride_row="i32",
               stride_pages_b="i32", stride_pos_b="i32", stride_pos_t="i32")
    const = dict(PS=16, H=16, R=512, RR=64, BLOCK_H=16, BLOCK_R=512, BLOCK_E=64, SPLIT=K.SPLIT_ROWS, BLOCK_N=K.BLOCK_N,
                 IEEE=False, PDL=True, PREFETCH=False, NUM_PAGES=1024, L_LINES=16, CHUNKS=K._split_chunks(512),
                 EARLY_POS=K.EARLY_POS)
    rows = []
    for tile in sorted({K.SPLIT_TILE_ROWS, 64}):       # the default, and the packed tile (4 queries a program)
        qpp, warps = K.split_shape(16, 512, False, tile)
        name = "mla_attention split" + ("" if tile == K.SPLIT_TILE_ROWS else f" (tile {tile})")
        rows.append({"kernel": name, "config": {"split_rows": K.SPLIT_ROWS, "block_n": K.BLOCK_N, "tile_rows": tile},
                     **resources(K._split_kernel, sig, dict(const, QPP=qpp), warps, K.SPLIT_STAGES,
                                 divisible=(0, 1, 2, 3, 4, 5, 6, 12, 13, 14, 15, 16))})
    return rows


def _signature(fn, constexprs: dict, types: dict[str, str]) -> dict:
    """fn's runtime arguments typed: `types` where given, else *_ptr -> *bf16, anything else i32."""
    return {a: types.get(a, "*bf16" if a.endswith("_ptr") else "i32") for a in fn.arg_names if a not in constexprs}


def _pointers(fn, also: tuple[str, ...] = ()) -> tuple[int, ...]:
    """Indices of fn's pointer arguments (torch allocations: 16-byte aligned) and of the named ones."""
    return tuple(i for i, a in enumerate(fn.arg_names) if a.endswith("_ptr") or a in also)


def _kda_rows() -> list[dict]:
    import lingc.kernels.kda as K
    fn = K._kda_fused_kernel
    fp32 = ("wq_ptr", "wk_ptr", "wv_ptr", "a_log_ptr", "dt_bias_ptr", "pool_ptr", "staging_ptr")
    types = {**{a: "*fp32" for a in fp32}, "slots_ptr": "*i32", "count_ptr": "*i32", "scale": "fp32",
             "lower_bound": "fp32"}
    rows = []
    for name, T, staged in (("kda_fused_decode (T = 1)", 1, False), ("kda_fused_verify (T = 6)", 6, True)):
        const = dict(T=T, D=128, DB=128, BV=K.BLOCK_V, W=4, STAGED=staged, PRECISE=True, PDL=True)
        rows.append({"kernel": name, "config": {"block_v": K.BLOCK_V},
                     **resources(fn, _signature(fn, const, types), const, K.FUSED_WARPS, 1, _pointers(fn))})
    return rows


def _linear_rows() -> list[dict]:
    import lingc.kernels.linear as L
    fn = L._linear_dot_kernel
    cfg = L.CONFIG_TABLE[1][2]                       # bf16 weights past 1 MiB: the projections, MLP, lm_head
    types = {"part_ptr": "*fp32", "count_ptr": "*i32", "eps": "fp32"}
    const = dict(BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=1, EVEN_K=True, IEEE=False,
                 LINE=64, PDL=True, NORM=False, HAS_RESIDUAL=False, WRITE_NORMED=False, NORM_BLOCK=cfg.block_k,
                 GATED=False, HEAD_D=128, PRECISE=True)
    return [{"kernel": "linear dot (bf16, unsplit)", "config": dataclasses.asdict(cfg),
             **resources(fn, _signature(fn, const, types), const, cfg.num_warps, cfg.num_stages,
                         _pointers(fn, ("K", "K_PER_SPLIT", "stride_xm", "stride_wn", "stride_ym")))}]


def _filtered_probs_rows() -> list[dict]:
    """filtered_probs' round kernel at V = 157184 (77 slices): a phase's first round (32 bins over every token) and a
    later one (256 bins). Its first loop is the binning step (SUB = cell / bins tokens an iteration)."""
    import lingc.kernels.filtered_probs as F
    fn, cfg = F._round_kernel, F.DEFAULT_CONFIG
    types = {"logits_ptr": "*fp32", "temp_ptr": "*fp32", "topk_ptr": "*i64", "topp_ptr": "*fp32", "ticket_ptr": "*i32",
             "totals_ptr": "*i64"}
    rows = []
    for nb, first in ((32, True), (256, False)):
        const = dict(PHASE=1, FIRST=first, NB=nb, LOG2NB=nb.bit_length() - 1, NB_MAX=256, SUB=cfg.cell // nb,
                     CHUNK=cfg.chunk, EXACT=cfg.exact, NCHUNK_PAD=128, GJ=max(1, F.PAIR_TILE // cfg.exact),
                     LAST=False, SCAN_MAX=cfg.scan_max, FINISH=True, PDL=True)
        sig = {a: types.get(a, "*fp32" if a.endswith("_ptr") else "i32") for a in fn.arg_names if a not in const}
        name = f"filtered_probs round ({nb} bins{', first' if first else ''})"
        rows.append({"kernel": name, "config": {"bins": nb, "sub": cfg.cell // nb, "chunk": cfg.chunk},
                     **resources(fn, sig, const, cfg.num_warps, 1, _pointers(fn, ("V", "stride_b", "stride_t")))})
    return rows


def run() -> list[dict]:
    return _moe_rows() + _mla_rows() + _kda_rows() + _linear_rows() + _filtered_probs_rows()


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row), flush=True)
    sys.exit(0)
