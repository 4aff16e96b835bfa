"""`oasiskv eval json-schema`: grammar-constrained JSON on a real model.

Fifty chat prompts (ten schemas x five subjects: nested objects, enums, arrays, arrays of
objects, numbers, booleans, patterns, anyOf; `strict`, every property required), greedy, in one
batch with a few unconstrained prompts. Every constrained output is parsed and validated with
the `jsonschema` package; each unconstrained output must be token for token what it is when the
batch holds no grammar. With `--sparse`, prompts are padded with prose past the sparse threshold
so that every request decodes sparse. Then the tool loop (tool_loop.py) against a server of the
same model (run first), unless `--no-tool-loop`. Prints a table, writes `--output-json`.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace

NAME = {"type": "string", "minLength": 1, "maxLength": 24}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = {
    "flat": _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": NAME}),
    "nested": _obj({"name": NAME, "address": _obj({"street": NAME, "city": NAME,
                                                   "zip": {"type": "integer", "minimum": 0, "maximum": 99999}})}),
    "enums": _obj({"item": NAME, "status": {"enum": ["open", "closed", "pending"]},
                   "priority": {"enum": ["low", "medium", "high"]}}),
    "string-array": _obj({"title": NAME, "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4}}),
    "object-array": _obj({"name": NAME, "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
        "name": NAME, "count": {"type": "integer", "minimum": 1, "maximum": 100}})}}),
    "numbers": _obj({"product": NAME, "price": {"type": "number", "minimum": 0, "maximum": 10000},
                     "in_stock": {"type": "boolean"}}),
    "deep": _obj({"organization": _obj({"name": NAME, "head": _obj({"name": NAME, "years": {
        "type": "integer", "minimum": 0, "maximum": 80}})})}),
    "enum-array": _obj({"place": NAME, "weather": {"type": "array", "minItems": 1, "maxItems": 3,
                                                   "items": {"enum": ["sunny", "rainy", "cloudy", "snowy"]}}}),
    "pattern": _obj({"event": NAME, "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                     "attendees": {"type": "integer", "minimum": 1, "maximum": 100000}}),
    "any-of": _obj({"label": NAME, "kind": {"const": "record"},
                    "value": {"anyOf": [{"type": "integer", "minimum": -1000, "maximum": 1000000},
                                        {"type": "string", "maxLength": 16}]}}),
}
SUBJECTS = ["a librarian in Lisbon", "a bakery in Kyoto", "a football club in Buenos Aires",
            "a software startup in Nairobi", "a museum in Oslo"]
PLAIN = [f"Describe {s} in two sentences." for s in SUBJECTS]


def add_json_schema_args(p) -> None:
    p.add_argument("--max-tokens", type=int, default=200, help="generated tokens at most per prompt")
    p.add_argument("--pad-tokens", type=int, default=None,
                   help="prose tokens before each question (default: the sparse threshold + 128 with --sparse, "
                        "else 0)")
    p.add_argument("--no-tool-loop", action="store_true", help="skip the tool loop against a server")
    p.add_argument("--output-json", default=None)


def _messages(task: str, filler: str) -> list[dict]:
    head = f"Here is a document.\n\n{filler}\n\nThe document above is unrelated. " if filler else ""
    return [{"role": "system", "content": "You answer with JSON only."}, {"role": "user", "content": head + task}]


def run_json_schema(args) -> int:
    import jsonschema

    from oasiskv.entrypoints.args import engine_config
    from oasiskv.entrypoints.llm import LLM
    from oasiskv.eval.texts import text_tokens
    from oasiskv.sampling_params import SamplingParams, StructuredOutput

    tool_loop = None
    if not args.no_tool_loop:  # first, while no engine of this process holds the memory
        from oasiskv.eval.tool_loop import run_tool_loop
        tool_loop = run_tool_loop(args)
        print(json.dumps(tool_loop, indent=1), flush=True)
    cfg = engine_config(args)
    pad = args.pad_tokens if args.pad_tokens is not None else (
        cfg.sparse.sparse_threshold + 128 if cfg.sparse.enabled else 0)
    cfg = replace(cfg, max_model_len=cfg.max_model_len or pad + 1024)
    llm = LLM.from_config(cfg)
    tok = llm.tokenizer
    filler = tok.decode(text_tokens(tok, "prose", pad)) if pad else ""
    cases = [(name, subject) for name in SCHEMAS for subject in SUBJECTS]
    prompts = [llm.apply_chat_template(_messages(
        f"Describe {subject} as a JSON object matching this JSON schema: {json.dumps(SCHEMAS[name])}", filler))
        for name, subject in cases]
    plain = [llm.apply_chat_template(_messages(p, filler)) for p in PLAIN]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    grammared = [replace(greedy, structured=StructuredOutput("json_schema", SCHEMAS[name], strict=True))
                 for name, _ in cases]

    start = time.perf_counter()
    alone = llm.generate(plain, greedy, use_tqdm=False)
    mixed = llm.generate(prompts + plain, grammared + [greedy] * len(plain), use_tqdm=False)
    elapsed = time.perf_counter() - start
    rows = []
    for (name, subject), out in zip(cases, mixed):
        row = {"schema": name, "subject": subject, "prompt_tokens": len(out.prompt_token_ids),
               "generated_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
               "sparse_steps": out.stats.get("sparse_steps", 0), "text": out.text, "parsed": False,
               "valid": False, "error": None}
        try:
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
            row["parsed"] = row["valid"] = True
        except json.JSONDecodeError as e:
            row["error"] = f"not JSON: {e}"
        except jsonschema.ValidationError as e:
            row["parsed"], row["error"] = True, f"invalid: {e.message}"
        rows.append(row)
    unchanged = [a.token_ids == b.token_ids for a, b in zip(alone, mixed[len(prompts):])]
    results = {"model": cfg.model, "sparse": cfg.sparse.enabled, "sparse_threshold": cfg.sparse.sparse_threshold,
               "top_k_blocks": cfg.sparse.top_k_blocks, "pad_tokens": pad, "max_tokens": args.max_tokens,
               "prompts": len(rows),
               "parsed": sum(r["parsed"] for r in rows), "valid": sum(r["valid"] for r in rows),
               "stopped": sum(r["finish_reason"] == "stop" for r in rows),
               "sparse_steps": sum(r["sparse_steps"] for r in rows), "plain_unchanged": sum(unchanged),
               "plain": len(unchanged), "elapsed_s": round(elapsed, 1), "per_prompt": rows}
    if tool_loop is not None:
        results["tool_loop"] = tool_loop
    print_json_schema_table(results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def print_json_schema_table(r: dict) -> None:
    mode = f"sparse (threshold {r['sparse_threshold']}, K = {r.get('top_k_blocks')})" if r["sparse"] else "dense"
    print(f"\njson-schema: {r['model']}, {mode}, prompts padded with {r['pad_tokens']} prose tokens, greedy, "
          f"at most {r['max_tokens']} tokens")
    print("| run | valid / prompts | parsed | ended by the grammar | sparse steps | unconstrained unchanged | s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {mode} | {r['valid']}/{r['prompts']} | {r['parsed']} | {r['stopped']} | {r['sparse_steps']} "
          f"| {r['plain_unchanged']}/{r['plain']} | {r['elapsed_s']} |")
    for row in r["per_prompt"]:
        if not row["valid"]:
            print(f"  {row['schema']} / {row['subject']}: {row['error']} ({row['finish_reason']})")
    if "tool_loop" in r:
        print("\n| tool_choice | stream | called | id | arguments valid | answered in text |")
        print("|---|---|---|---|---|---|")
        for t in r["tool_loop"]:
            print(f"| {t['tool_choice']} | {t['stream']} | {t['called']} | {t['id_ok']} | {t['arguments_valid']} "
                  f"| {t['answered_in_text']} |")
