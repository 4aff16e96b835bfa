"""GPU checks of disaggregated decode on the batched pipeline (docs/disaggregation.md, "On the
batched pipeline"):

1. the transfer and write-through kernels over a batch of extent and mapped rows, host items
   pinned and read through UVA, against plain loops;
2. tests/disagg/test_disagg_pipeline.py on CUDA (a pytest run): with full admissions the captured
   pipeline decodes the in-line path's tokens; with RPF reads, after every step no dynamic slot
   holds a block that is not local and every slot holds its local item's bytes, each wanted
   item crosses once, the host items all come back; a dead peer fails only its request;
3. speed: 4 RPF requests (the default model, 1,210-token prompts, K = 8, 128 tokens out, reads
   over the socket transport) decoded on the pipeline and on the in-line path (what a decode
   server ran before), output tokens per second of each.

    PYTHONPATH=.:.gpu_site python3 scripts/gpu_check_disagg_pipeline.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path[:0] = ["tests", "tests/disagg"]  # the test module and the helpers it imports
import test_disagg_pipeline as t  # noqa: E402

from oasiskv import SamplingParams  # noqa: E402


def decode_speed(handed: dict, pipeline: bool, requests: int, tokens: int) -> dict:
    engine, reads = t.decode_engine(pipeline)
    peer = reads.transport.add_peer(handed["owner"].metadata())
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t.run(engine, reads, [("warm", handed["rpf"], peer)], params=SamplingParams(temperature=0, max_tokens=8,
                                                                                   ignore_eos=True))
    t0 = time.perf_counter()
    outs = t.run(engine, reads, [(f"r{i}", handed["rpf"], peer) for i in range(requests)], params=params)
    seconds = time.perf_counter() - t0
    reads.transport.close()
    assert all(o.finish_reason == "length" for o in outs.values())
    made = sum(len(o.token_ids) for o in outs.values())  # the model's length may end them early
    return {"seconds": round(seconds, 3), "output_tokens": made, "output_tok_s": round(made / seconds, 1),
            "remote_reads": reads.totals.reads, "remote_bytes": reads.totals.bytes_read}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(0)}
    results["mixed_rows_kernels"] = t.mixed_rows_copies("cuda")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["tests", os.environ.get("PYTHONPATH", ".")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-s", "-p", "no:cacheprovider",
                           "tests/disagg/test_disagg_pipeline.py"], env=env, capture_output=True, text=True, timeout=420)
    results["pytest_rc"] = proc.returncode
    results["pytest_tail"] = proc.stdout[-3000:] + proc.stderr[-2000:]
    print(results["pytest_tail"], flush=True)
    handed = t.hand_over_one()
    requests = t.CONFIG["max_num_seqs"]
    for name, pipeline in (("pipeline", True), ("in_line", False)):
        results[f"speed_{name}"] = decode_speed(handed, pipeline, requests, 128)
        print(name, results[f"speed_{name}"], flush=True)
    handed["owner"].close()
    ok = all(results["mixed_rows_kernels"].values()) and proc.returncode == 0
    results["ok"] = ok
    print(json.dumps({k: v for k, v in results.items() if k != "pytest_tail"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
