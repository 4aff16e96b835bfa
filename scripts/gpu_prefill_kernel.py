"""The paged prefill kernel on a GPU: against its torch reference at real shapes, then timed.

    PYTHONPATH=. python3 scripts/gpu_prefill_kernel.py [--sweep]

Checks: paged_prefill_triton vs paged_prefill_ref (float32 math) with Qwen3-8B's heads (32 query,
8 KV, D 128, bf16): a chunk of 8192 and one of 2048 after a 32K prefix, a first chunk, and chunks
of different lengths and offsets in one launch; SmolLM2's heads (9 / 3, D 64) in fp16 and fp32.
Each passes when the max abs error is under the dtype's tolerance and every output element was
written (outputs are NaN-poisoned first). Timing (triton.testing.do_bench, median): the kernel's
attention TFLOP/s (4 * Hq * D per visible query-key pair) for a 32K prompt in one chunk and the
last chunk of 8192 / 2048 after a prefix, beside torch SDPA's flash kernel on the same causal
attention over contiguous K/V, and the engine's former path (gather the prefix, SDPA with a mask).
--sweep times a few tile shapes. The table goes to stdout and, if $OUT is set, $OUT/prefill_kernel.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from oasiskv.kernels import cudnn_prefill
from oasiskv.kernels.paged_prefill import paged_prefill, paged_prefill_triton
from oasiskv.kernels.reference import paged_prefill_ref, random_paged_prefill

DEV = "cuda"
BS = 16
TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
results = {"checks": [], "timing": [], "sweep": []}


def make_inputs(spans, Hkv, G, D, dtype, seed=0):
    q, pool, table, _ = random_paged_prefill(spans, Hkv, G, D, dtype, BS, seed, DEV, spare_pages=7)
    return q, pool, table


def attention_flops(spans, Hq, D) -> int:
    return sum(4 * Hq * D * (length * prefix + length * (length + 1) // 2) for prefix, length in spans)


def check(name, spans, Hkv, G, D, dtype):
    q, pool, table = make_inputs(spans, Hkv, G, D, dtype, seed=len(name))
    out = torch.full_like(q, float("nan"))
    paged_prefill_triton(q, pool, table, Hkv, D ** -0.5, out=out)
    ref = paged_prefill_ref(q, pool, table.chunks, table.page_table, Hkv, D ** -0.5)
    err = (out.float() - ref.float()).abs().max().item()  # NaN if any element was left unwritten
    ok = err < TOL[dtype]
    row = {"case": name, "spans": spans, "heads": f"{G * Hkv}/{Hkv}", "head_dim": D,
           "dtype": str(dtype).removeprefix("torch."), "max_abs_err": err, "pass": ok}
    if cudnn_prefill.cudnn_usable(q):  # every chunk through cuDNN's path too
        os.environ["OASISKV_PREFILL_BACKEND"] = "cudnn"
        out = torch.full_like(q, float("nan"))
        out[:] = paged_prefill(q, pool, table, Hkv, D ** -0.5)
        row["cudnn_max_abs_err"] = (out.float() - ref.float()).abs().max().item()
        k, v = own_keys(pool, table, Hkv)  # the chunks' own keys as the engine passes them
        out[:] = paged_prefill(q, pool, table, Hkv, D ** -0.5, k, v)
        os.environ.pop("OASISKV_PREFILL_BACKEND")
        row["cudnn_own_kv_max_abs_err"] = (out.float() - ref.float()).abs().max().item()
        row["cudnn_gqa_native"] = cudnn_prefill._GQA_NATIVE.get(str(q.device))
        ok = row["pass"] = ok and max(row["cudnn_max_abs_err"], row["cudnn_own_kv_max_abs_err"]) < TOL[dtype]
    results["checks"].append(row)
    print(f"{'PASS' if ok else 'FAIL'} {name:34s} {row['heads']:>6s} D={D:<4d} {row['dtype']:9s} "
          f"max abs err {err:.2e}" + (f", cuDNN path {row['cudnn_max_abs_err']:.2e} / own keys given "
          f"{row['cudnn_own_kv_max_abs_err']:.2e}, GQA native {row['cudnn_gqa_native']}"
          if "cudnn_max_abs_err" in row else ""))
    del q, pool, table, out, ref
    torch.cuda.empty_cache()
    return ok


def own_keys(pool, table, Hkv):
    """Each chunk's own K and V [T, Hkv, D] out of the pages, as the layer hands them over."""
    own = [cudnn_prefill.gather_keys(pool, table.page_table[i], p + n, Hkv)[:, :, p:]
           for i, (_, n, p) in enumerate(table.spans)]
    return (torch.cat([o[j].transpose(0, 1) for o in own]).contiguous() for j in (0, 1))


def former_path(q, pool, table, Hkv, scale, prefix, length):
    """The engine's prefill before this kernel: gather the prefix, SDPA with a boolean mask."""
    D = q.shape[-1]
    pages = table.page_table[0, :(prefix + length + BS - 1) // BS].long()
    prev = pool.view(-1, Hkv, 2, BS, D)[pages]
    keys = prev[:, :, 0].transpose(0, 1).reshape(Hkv, -1, D)[:, :prefix + length][None]
    vals = prev[:, :, 1].transpose(0, 1).reshape(Hkv, -1, D)[:, :prefix + length][None]
    i = torch.arange(length, device=DEV)[:, None]
    j = torch.arange(prefix + length, device=DEV)[None, :]
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals, attn_mask=j <= prefix + i,
                                          scale=scale, enable_gqa=True)


def time_case(name, prefix, length, Hkv=8, G=4, D=128, dtype=torch.bfloat16, configs=None):
    spans = [(prefix, length)]
    q, pool, table = make_inputs(spans, Hkv, G, D, dtype)
    pool = pool.nan_to_num_(0.0)
    flops = attention_flops(spans, G * Hkv, D)
    scale = D ** -0.5
    row = {"case": name, "prefix": prefix, "length": length}
    ms = triton.testing.do_bench(lambda: paged_prefill_triton(q, pool, table, Hkv, scale))
    row["kernel_ms"], row["kernel_tflops"] = ms, flops / ms / 1e9
    # Flash SDPA on contiguous K/V (no pages), where it applies: a first chunk (plain causal).
    if prefix == 0:
        k = torch.randn(1, G * Hkv, length, D, device=DEV, dtype=dtype)
        qq = q.transpose(0, 1)[None].contiguous()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qq, k, k, is_causal=True))
        row["sdpa_flash_ms"], row["sdpa_flash_tflops"] = ms, flops / ms / 1e9
    else:
        ms = triton.testing.do_bench(lambda: former_path(q, pool, table, Hkv, scale, prefix, length))
        row["former_ms"] = ms
    if cudnn_prefill.cudnn_usable(q):
        own = tuple(own_keys(pool, table, Hkv))
        run = lambda: cudnn_prefill.chunk_attention(q, pool, table.page_table[0], prefix, Hkv, scale,  # noqa: E731
                                                    own_kv=own)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()  # the first call at a shape builds cuDNN's plan
        torch.cuda.synchronize()
        row["cudnn_first_call_ms"] = 1e3 * (time.perf_counter() - t0)
        ms = triton.testing.do_bench(run)
        row["cudnn_ms"], row["cudnn_tflops"] = ms, flops / ms / 1e9
        print(f"{name:28s} cuDNN path {ms:7.2f} ms ({row['cudnn_tflops']:4.0f} TFLOP/s), first call "
              f"{row['cudnn_first_call_ms']:.0f} ms")
    results["timing"].append(row)
    extra = (f"flash SDPA {row['sdpa_flash_ms']:.2f} ms ({row['sdpa_flash_tflops']:.0f} TFLOP/s)" if prefix == 0
             else f"former gather + masked SDPA {row['former_ms']:.2f} ms")
    print(f"{name:28s} kernel {row['kernel_ms']:7.2f} ms ({row['kernel_tflops']:4.0f} TFLOP/s)   {extra}")
    for rows, block_n, warps, stages in configs or []:
        try:
            ms = triton.testing.do_bench(lambda: paged_prefill_triton(
                q, pool, table, Hkv, scale, rows=rows, block_n=block_n, num_warps=warps, num_stages=stages))
        except Exception as e:  # noqa: BLE001 - a shape that does not fit (shared memory) is reported
            print(f"   rows={rows} block_n={block_n} warps={warps} stages={stages}: {type(e).__name__}")
            continue
        results["sweep"].append({"case": name, "rows": rows, "block_n": block_n, "num_warps": warps,
                                 "num_stages": stages, "ms": ms, "tflops": flops / ms / 1e9})
        print(f"   rows={rows:3d} block_n={block_n:3d} warps={warps} stages={stages}: {ms:7.2f} ms "
              f"({flops / ms / 1e9:4.0f} TFLOP/s)")


def silu_mul_case(rows=32768, width=12288):
    """The MLP's SiLU-and-multiply at a prefill's size: torch.compile's kernel against
    kernels/silu_mul.py, each checked against eager torch and timed (bytes moved / time)."""
    from oasiskv.kernels.silu_mul import silu_mul_triton
    from oasiskv.layers.fused import _silu_mul
    x = torch.randn(rows, 2 * width, device=DEV, dtype=torch.bfloat16)
    ref = (F.silu(x[:, :width].float()) * x[:, width:].float())
    moved = 3 * rows * width * x.element_size()
    row = {"case": f"silu_mul {rows} x {width}"}
    ok = True
    for name, fn in (("compiled", _silu_mul), ("triton", silu_mul_triton)):
        err = (fn(x).float() - ref).abs().max().item()
        ms = triton.testing.do_bench(lambda: fn(x))
        row[f"{name}_ms"], row[f"{name}_TBps"], row[f"{name}_max_abs_err"] = ms, moved / ms / 1e9, err
        ok &= err <= 2 ** -7 * ref.abs().max().item()  # one bf16 rounding of the largest output
        print(f"{row['case']:28s} {name:9s} {ms:6.3f} ms ({moved / ms / 1e9:4.2f} TB/s), max abs err {err:.2e}")
    results["timing"].append(row)
    return ok


SWEEP = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3),
         (64, 64, 4, 3), (64, 128, 4, 3), (256, 64, 8, 2), (128, 128, 8, 2)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="time a few tile shapes too")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    ok = True
    ok &= check("qwen3 chunk 8192 after 32K", [(32768, 8192)], 8, 4, 128, torch.bfloat16)
    ok &= check("qwen3 chunk 2048 after 32K", [(32768, 2048)], 8, 4, 128, torch.bfloat16)
    ok &= check("qwen3 first chunk 4096", [(0, 4096)], 8, 4, 128, torch.bfloat16)
    ok &= check("qwen3 5 chunks in one launch", [(0, 1000), (4096, 2048), (777, 333), (12345, 64), (16, 1)],
                8, 4, 128, torch.bfloat16)
    ok &= check("qwen3 fp16 mid-block offsets", [(1000, 3000), (23, 517)], 8, 4, 128, torch.float16)
    ok &= check("smollm2 fp16 chunk 2048 after 4K", [(4096, 2048), (0, 700)], 3, 3, 64, torch.float16)
    ok &= check("smollm2 fp32 offsets", [(8, 300), (100, 40)], 3, 3, 64, torch.float32)
    ok &= check("G=7 D=64 bf16", [(2048, 1024), (0, 129)], 2, 7, 64, torch.bfloat16)
    ok &= silu_mul_case()
    configs = SWEEP if args.sweep else None
    time_case("32K prompt in one chunk", 0, 32768, configs=configs)
    time_case("chunk 8192 after 24K", 24576, 8192, configs=configs)
    time_case("chunk 2048 after 30K", 30720, 2048, configs=configs)
    time_case("chunk 4096 after 28K", 28672, 4096)
    time_case("chunk 4096 after 4K", 4096, 4096)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "prefill_kernel.json"), "w") as f:
            json.dump(results, f, indent=2)
    print("all checks pass" if ok else "SOME CHECKS FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
