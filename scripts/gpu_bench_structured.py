"""What a JSON-schema grammar costs a decode batch: 64 greedy rows of 128 new tokens each, once all
plain and once with half of them under a grammar, timed alternately (dummy weights: the grammar's
cost does not depend on them). Output tok/s of each and their ratio; one JSON line per model.

PYTHONPATH=.:.gpu_site python3 scripts/gpu_bench_structured.py --model .gpu_site/smollm2_dummy \
    --preset qwen3-8b --tokenizer .gpu_site/qwen_tokenizer --output-json $OUT/structured.json

--model: an HF directory with config.json and a tokenizer; --preset with --tokenizer: a preset's
shapes (Qwen3 family) with that tokenizer, written to a temporary directory. The schema needs more
tokens than any row may take (64 objects of at least 6 tokens), so every row runs to its limit.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import oasiskv.engine.llm_engine as llm_engine
from oasiskv.entrypoints.llm import LLM
from oasiskv.models.config import ModelConfig, preset
from oasiskv.sampling_params import SamplingParams, StructuredOutput

ITEM = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["id", "tag"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": ITEM, "minItems": 64}},
          "required": ["rows"], "additionalProperties": False}


def qwen3_dir(cfg: ModelConfig, tokenizer: Path) -> Path:
    """A directory holding `cfg` as a Qwen3 config.json beside the tokenizer's files."""
    assert cfg.qk_norm and not cfg.num_experts, "Qwen3 dense presets only"
    out = Path(tempfile.mkdtemp(prefix=f"{cfg.name}_"))
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids}))
    return out


WAITED = [0.0]  # seconds the host has waited for the device's tokens (async scheduling's reads)


def _timed_read_host(host, ready):
    t0 = time.perf_counter()
    try:
        return _read_host(host, ready)
    finally:
        WAITED[0] += time.perf_counter() - t0


_read_host, llm_engine.read_host = llm_engine.read_host, _timed_read_host


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, int, float]:
    """(seconds, output tokens, decode steps overlapped by async scheduling, seconds the host
    waited for the device) of one batch: a host that never waits is what bounds the step."""
    stats = llm.engine.step_stats
    before, waited, t0 = stats["overlapped_steps"], WAITED[0], time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    lengths = {len(o.token_ids) for o in outs}
    assert lengths == {params[0].max_tokens}, f"every row runs to its limit, got lengths {lengths}"
    return seconds, sum(len(o.token_ids) for o in outs), stats["overlapped_steps"] - before, WAITED[0] - waited


def bench(model_dir: str, name: str, rows: int, new_tokens: int, prompt_len: int, reps: int, **engine) -> dict:
    llm = LLM(model_dir, load_format="dummy", max_num_seqs=rows, max_model_len=prompt_len + new_tokens + 16, **engine)
    prompts = [[100 + (7 * r + j) % 5000 for j in range(prompt_len)] for r in range(rows)]
    plain = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    grammared = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                               structured=StructuredOutput("json_schema", SCHEMA))
    loads = {"plain": [plain] * rows, "half grammared": [grammared if r % 2 else plain for r in range(rows)]}
    for params in loads.values():  # warm-up: graphs captured, the schema compiled
        run(llm, prompts, params)
    times: dict[str, list[float]] = {name: [] for name in loads}
    waited: dict[str, list[float]] = {name: [] for name in loads}
    tokens, overlapped = {}, {}
    for _ in range(reps):
        for name, params in loads.items():
            seconds, tokens[name], overlapped[name], w = run(llm, prompts, params)
            times[name].append(seconds)
            waited[name].append(w)
    tok_s = {name: tokens[name] / statistics.median(t) for name, t in times.items()}
    host_waits = {name: sum(waited[name]) / sum(times[name]) for name in loads}
    return {"model": name, "device": device_name(), "rows": rows, "new_tokens": new_tokens, "prompt_len": prompt_len,
            "seconds": times, "tok_s": tok_s, "ratio": tok_s["half grammared"] / tok_s["plain"],
            "overlapped_steps": overlapped, "host_waiting_share": host_waits, **engine}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=[], help="HF directory (config.json + tokenizer); repeatable")
    p.add_argument("--preset", action="append", default=[], help="a Qwen3 preset's shapes, with --tokenizer")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory for --preset")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--output-json")
    args = p.parse_args()
    dirs = [(d, Path(d).name) for d in args.model]
    dirs += [(str(qwen3_dir(preset(name), args.tokenizer)), name) for name in args.preset]
    results = []
    for d, name in dirs:
        results.append(bench(d, name, args.rows, args.new_tokens, args.prompt_len, args.reps))
        r = results[-1]
        print(json.dumps(r))
        print(f"{r['model']}: plain {r['tok_s']['plain']:,.0f} tok/s, half grammared "
              f"{r['tok_s']['half grammared']:,.0f} tok/s: {r['ratio']:.3f}; the host waited for the device "
              f"{r['host_waiting_share']['plain']:.0%} / {r['host_waiting_share']['half grammared']:.0%} of the time",
              flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
