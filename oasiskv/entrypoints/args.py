"""Command-line flags shared by every entrypoint, mapped onto EngineConfig (vLLM's spellings)."""
from __future__ import annotations

import argparse
import json

from oasiskv.config import EngineConfig
from oasiskv.sparse.drafters import drafter_names


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF directory, .gguf file, a downloaded model (oasiskv download NAME) or a preset "
                        "(qwen3-8b, ...); default: embedded SmolLM2-135M")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--rope-scaling", type=_json_object, default=None,
                   help='RoPE scaling over the model\'s own, as JSON; Qwen2.5 to 128K: '
                        '\'{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}\'')
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--kv-cache-gb", type=float, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the K/V of cached leading blocks shared with earlier requests (on by default)")
    g.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="launch decode step t+1 before reading step t's tokens (auto: on CUDA)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N devices, one process each (KV heads partitioned)")
    g.add_argument("--distributed-timeout-s", type=float, default=300.0,
                   help="the longest a collective between tensor-parallel ranks waits: a dead or "
                        "hung rank ends the engine with an error after it")
    sp = p.add_argument_group("sparse decode (KV beyond GPU memory)")
    sp.add_argument("--sparse", action="store_true", help="decode long requests from a head-wise working set")
    sp.add_argument("--top-k-blocks", type=int, default=128)
    sp.add_argument("--sink-blocks", type=int, default=1)
    sp.add_argument("--window-blocks", type=int, default=4)
    sp.add_argument("--sparse-threshold", type=int, default=None,
                    help="context length at which a request converts to sparse (default: 4096, or twice "
                         "the working set's tokens if more: 4256 at K=128)")
    sp.add_argument("--fetch-ratio", type=float, default=0.05,
                    help="cap: ceil(ratio * K) new blocks per KV head per step")
    sp.add_argument("--fetch-all", action="store_true", help="no cap (fetch ratio 1.0)")
    sp.add_argument("--fetch-budget", default="auto",
                    help="host->GPU bytes a decode step may move, shared by predicted value and never "
                         "more than the cap per head: auto (what the measured link carries during the "
                         "step's foreground; on CPU a nominal 50 GB/s x 6 ms), a number of MB, or off "
                         "(the fixed cap alone)")
    sp.add_argument("--drafter", default="self", help=" | ".join(drafter_names()))
    sp.add_argument("--host-kv-gb", type=float, default=4.0)
    sp.add_argument("--summary-dtype", default="auto", choices=["auto", "kv", "fp8"],
                    help="block min/max summaries: fp8 e4m3 (half the bytes each step scans), kv (the KV "
                         "dtype), or auto (fp8 on CUDA, kv elsewhere)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_flat(
        model=args.model, load_format=args.load_format, rope_scaling=args.rope_scaling,
        dtype=args.dtype, device=args.device,
        seed=args.seed, block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gb=args.kv_cache_gb, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager, sparse=args.sparse, top_k_blocks=args.top_k_blocks,
        sink_blocks=args.sink_blocks, window_blocks=args.window_blocks,
        sparse_threshold=args.sparse_threshold, fetch_ratio=1.0 if args.fetch_all else args.fetch_ratio,
        drafter=args.drafter, host_kv_gb=args.host_kv_gb, summary_dtype=args.summary_dtype,
        fetch_budget=getattr(args, "fetch_budget", "auto"),
        enable_prefix_caching=args.enable_prefix_caching, async_scheduling=args.async_scheduling,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        distributed_timeout_s=getattr(args, "distributed_timeout_s", 300.0))
