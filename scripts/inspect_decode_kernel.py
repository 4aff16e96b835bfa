"""Compile the decode split kernel for an H100/H200 (sm_90) on this machine, no GPU needed, and
report what its software pipeline keeps in flight: how deep the K/V tile buffers are, the
shared memory and registers of one program, how many programs fit on one SM, and the K/V
bytes one program has in flight.

    .venv/bin/python scripts/inspect_decode_kernel.py            # the working-set shape, a few configs
    .venv/bin/python scripts/inspect_decode_kernel.py 8:4:5 4:4:6  # TILE_BLOCKS:WARPS:STAGES
    .venv/bin/python scripts/inspect_decode_kernel.py --fetch 4:8 16:32  # the transfer kernel, ITEMS:WARPS

--fetch: the transfer's fetch kernel (`copy_items._fetch_kernel`) instead, and whether a 5-stage
attention program (8:4:5) still fits on the SM beside one of its programs. Compiled on the CPU
(2026-12-02): 4 items, 8 warps (the default) take 48 registers x 256 threads, so an attention
program fits beside it; 16 items, 32 warps take 64 x 1,024 = the whole register file.

Ints are compiled as the JIT specializes them at the qwen3-8b working-set call (strides and
pointers divisible by 16); without that, Triton cannot vectorize or pipeline the loads.
Registers come from the ptxas that ships with Triton.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from oasiskv.kernels.copy_items import _fetch_kernel
from oasiskv.kernels.paged_decode import _decode_split_kernel

SM90 = GPUTarget("cuda", 90, 32)
SMEM_PER_SM, REGS_PER_SM, THREADS_PER_SM = 228 * 1024, 65536, 2048
POINTERS = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "slot_ptr": "*i32", "len_ptr": "*i32", "pm_ptr": "*fp32",
            "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16", "out_ptr": "*bf16",
            "count_ptr": "*i32"}
# Strides that are multiples of 16 at the working-set call (the others, e.g. the slot table's
# per-head stride of 133, are not).
ALIGNED = {"sq_b", "sq_q", "sq_h", "skv_slot", "skv_kv", "skv_tok", "skn_b", "skn_q", "skn_h",
           "svn_b", "svn_q", "svn_h", "so_b", "so_q", "so_h"}


def compile_sm90(kernel, pointers: dict, const: dict, aligned: set, **options):
    """`kernel` compiled for sm_90: pointers (name: type) and the `aligned` ints divisible by 16,
    `const` its constexprs, the other ints i32 (qk_scale fp32)."""
    names = kernel.arg_names
    sig = {n: pointers.get(n) or ("constexpr" if n in const else "fp32" if n == "qk_scale" else "i32")
           for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in pointers or n in aligned}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs, constexprs={(names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=SM90, options=options)


def compile_kernel(tile_blocks: int, num_warps: int, num_stages: int, single: bool = True):
    const = dict(G=4, Q=2, D=128, BS=16, M=16, TILE_BLKS=tile_blocks, UPCAST=False, PRECISION="tf32",
                 SINGLE=single, FUSED_MERGE=False, MS=8, SC=1)
    return compile_sm90(_decode_split_kernel, POINTERS, const, ALIGNED, num_warps=num_warps, num_stages=num_stages)


def registers(ptx: str) -> int:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", out).group(1))


def inspect(tile_blocks: int, num_warps: int, num_stages: int) -> dict:
    k = compile_kernel(tile_blocks, num_warps, num_stages)
    ttgir = k.asm["ttgir"]
    # K and V tiles land in shared buffers shaped [depth, tile tokens, D].
    depth = max(int(m) for m in re.findall(rf"memdesc<(\d+)x{tile_blocks * 16}x128xbf16", ttgir))
    regs, smem = registers(k.asm["ptx"]), k.metadata.shared
    threads = 32 * num_warps
    per_sm = min(SMEM_PER_SM // max(smem, 1), REGS_PER_SM // (regs * threads), THREADS_PER_SM // threads)
    tile_bytes = 2 * tile_blocks * 16 * 128 * 2  # K and V of one tile, bf16
    return {"tile_blocks": tile_blocks, "num_warps": num_warps, "num_stages": num_stages,
            "kv_buffers": depth, "shared_kb": round(smem / 1024), "registers": regs, "programs_per_sm": per_sm,
            "kv_kb_in_flight_per_program": depth * tile_bytes // 1024}


def inspect_fetch(items: int, num_warps: int) -> dict:
    """Registers, threads and shared memory of one fetch program (8 KiB bf16 items)."""
    pointers = {"host_ptr": "*bf16", "kv_ptr": "*bf16", "blk_ptr": "*i32", "slot_ptr": "*i32", "pages_ptr": "*i32",
                "ext_start_ptr": "*i64", "ext_blocks_ptr": "*i64"}
    k = compile_sm90(_fetch_kernel, pointers, dict(ITEM=4096, ITEMP=4096, ITEMS=items), set(), num_warps=num_warps)
    return {"items": items, "num_warps": num_warps, "registers": registers(k.asm["ptx"]),
            "threads": 32 * num_warps, "shared_kb": round(k.metadata.shared / 1024)}


def main_fetch(configs: list[str]) -> None:
    att = inspect(8, 4, 5)
    att_threads = 32 * att["num_warps"]
    att_regs = att["registers"] * att_threads
    print(f"beside a 5-stage attention program ({att_regs} registers, {att['shared_kb']} KB shared, "
          f"{att_threads} threads):")
    print(f"{'config':>8} {'regs':>5} {'threads':>7} {'register file':>13} {'shared KB':>9} {'attention fits':>14}")
    for text in configs:
        f = inspect_fetch(*(int(x) for x in text.split(":")))
        used = f["registers"] * f["threads"]
        fits = (used + att_regs <= REGS_PER_SM and f["threads"] + att_threads <= THREADS_PER_SM
                and (f["shared_kb"] + att["shared_kb"]) * 1024 <= SMEM_PER_SM)
        print(f"{text:>8} {f['registers']:>5} {f['threads']:>7} {used / REGS_PER_SM:>12.0%} {f['shared_kb']:>9} "
              f"{'yes' if fits else 'no':>14}")


def main():
    if sys.argv[1:2] == ["--fetch"]:
        main_fetch(sys.argv[2:] or ["4:8", "8:16", "16:32"])
        return
    configs = sys.argv[1:] or ["8:4:3", "8:4:4", "8:4:5", "4:4:4", "4:4:6", "8:8:5"]
    # A working set at batch 16 is 128 programs with one split: one a SM, whatever fits.
    print(f"{'config':>8} {'K/V buffers':>11} {'shared KB':>9} {'regs':>5} {'programs/SM':>11} "
          f"{'K/V KB in flight a program':>26}")
    for text in configs:
        r = inspect(*(int(x) for x in text.split(":")))
        print(f"{text:>8} {r['kv_buffers']:>11} {r['shared_kb']:>9} {r['registers']:>5} {r['programs_per_sm']:>11} "
              f"{r['kv_kb_in_flight_per_program']:>26}")


if __name__ == "__main__":
    main()
