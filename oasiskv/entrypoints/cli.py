"""`oasiskv` command line: generate, bench."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from oasiskv.entrypoints.args import add_engine_args, engine_config


def _generate(args) -> int:
    from oasiskv.engine.llm_engine import LLMEngine
    from oasiskv.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    engine = LLMEngine(engine_config(args))
    prompt = args.prompt
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompt = f.read()
    if prompt is None:
        raise ValueError("give --prompt TEXT or --prompt-file PATH")
    if args.chat:
        tok = engine.tokenizer
        if tok is None or not tok.chat_template:
            raise ValueError("--chat needs a model with a chat template")
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    rid = engine.add_request(prompt, params)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    if args.json:
        d = asdict(out)
        d.pop("prompt", None)
        print(json.dumps(d))
    else:
        print(out.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oasiskv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print it")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    add_engine_args(g)
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    from oasiskv.bench.throughput import add_throughput_args, run_throughput
    t = bsub.add_parser("throughput", help="offline throughput (vLLM's bench throughput)")
    add_throughput_args(t)
    add_engine_args(t)
    t.set_defaults(func=run_throughput)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
