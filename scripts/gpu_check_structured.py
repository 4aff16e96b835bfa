"""Structured output on CUDA: the grammar's mask applied after the captured dense decode graph and
after the sparse pipeline's captured step (draft rows masked after their drafts).

PYTHONPATH=.:.gpu_site python3 scripts/gpu_check_structured.py MODEL_DIR
MODEL_DIR: an HF directory with config.json and the tokenizer (weights are random: no real
checkpoint travels to the GPU machine). The schema bounds every string, number and array, so
any token the grammar allows leads to a complete value: random weights must still produce
outputs that parse and match it, in a batch with an unconstrained greedy request whose tokens
must equal its tokens alone. Prints one JSON line per engine; exits 1 on a failure.
"""
from __future__ import annotations

import json
import sys

from oasiskv.entrypoints.llm import LLM
from oasiskv.sampling_params import SamplingParams, StructuredOutput

WORD = {"type": "string", "maxLength": 6}
SCHEMA = {"type": "object", "properties": {
    "name": WORD, "role": {"enum": ["admin", "user"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": WORD, "maxItems": 2}, "ok": {"type": "boolean"}},
    "required": ["name", "role", "age", "tags", "ok"], "additionalProperties": False}


def matches(value) -> bool:
    """SCHEMA, checked by hand (the GPU machine has no jsonschema)."""
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"]) and isinstance(value["name"], str)
            and len(value["name"]) <= 6 and value["role"] in ("admin", "user") and isinstance(value["age"], int)
            and 0 <= value["age"] <= 99 and isinstance(value["tags"], list) and len(value["tags"]) <= 2
            and all(isinstance(t, str) and len(t) <= 6 for t in value["tags"]) and isinstance(value["ok"], bool))


def check(name: str, llm: LLM, prompt: list[int]) -> bool:
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], [plain])[0].token_ids
    params = [SamplingParams(temperature=t, seed=i, max_tokens=200, structured=StructuredOutput("json_schema", SCHEMA))
              for i, t in enumerate((0, 0.8, 1.0))]
    outs = llm.generate([prompt] * 4, params + [plain])
    valid = []
    for o in outs[:3]:
        try:
            valid.append(o.finish_reason == "stop" and matches(json.loads(o.text)))
        except ValueError:
            valid.append(False)
    ok = all(valid) and outs[3].token_ids == alone
    print(json.dumps({"engine": name, "ok": ok, "valid": valid, "plain_unchanged": outs[3].token_ids == alone,
                      "texts": [o.text for o in outs[:3]], "sparse_steps": [o.stats.get("sparse_steps") for o in outs[:3]]}))
    return ok


def main(model: str) -> int:
    common = dict(load_format="dummy", max_model_len=2048)
    prompt = list(range(100, 1100))  # past the sparse threshold below
    ok = check("dense, CUDA graphs", LLM(model, **common), prompt)
    ok &= check("sparse pipeline", LLM(model, sparse=True, sparse_threshold=512, top_k_blocks=8, window_blocks=2,
                                       sink_blocks=1, host_kv_gb=1, **common), prompt)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
