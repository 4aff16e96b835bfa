"""The chunked prefill attention (kernels/paged_prefill.py) against `paged_prefill_ref`, on random
inputs: chunk offsets 0, mid-block and block-aligned, GQA ratios 1, 3, 4 and 7, head dims 64 and
128, several chunks of different lengths in one call.

The torch path is compared directly. The Triton kernel runs under Triton's CPU interpreter in a
subprocess (this file executed as a script with TRITON_INTERPRET=1, as tests/kernels/test_kernels.py),
at tiny shapes and with float16/float32 only: the interpreter's bf16 tl.dot is wrong, so bf16
is checked on the GPU machine (scripts/gpu_prefill_kernel.py). A second subprocess runs the
engine's chunked prefill of the default model through the kernel, against the torch path.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from triton_interpreter import run_under_interpreter

from oasiskv.kernels.reference import paged_prefill_ref, random_paged_prefill

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_prefill_inputs(spans, Hkv, G, D, dtype, bs=16, seed=0):
    """`random_paged_prefill`'s inputs, with the unused page-table entries -1: a kernel that
    reads them fails the comparison."""
    q, kv_cache, table, pages = random_paged_prefill(spans, Hkv, G, D, dtype, bs, seed)
    table.page_table.fill_(-1)  # the padding entries; then each row's own pages
    for i, own in enumerate(pages):
        table.page_table[i, :len(own)] = torch.tensor(own, dtype=torch.int32)
    return q, kv_cache, table


def reference(q, kv_cache, table, Hkv, scale):
    return paged_prefill_ref(q, kv_cache, table.chunks, table.page_table, Hkv, scale)


def test_page_table_rows_are_padded_to_a_multiple_of_16_pages():
    """One row stride class whatever the prompts' lengths: the kernel compiles once."""
    from oasiskv.kernels.paged_prefill import PrefillTable
    for pages in ([[3]], [[1] * 16], [[2] * 17, [5]]):
        n = len(pages)
        t = PrefillTable.build([0] * n, [1] * n, [0] * n, pages, torch.device("cpu"))
        assert t.page_table.shape[1] % 16 == 0 and t.page_table.shape[1] >= max(map(len, pages))
        assert [t.page_table[i, :len(p)].tolist() for i, p in enumerate(pages)] == pages


# ----------------------------------------------------------------- torch path vs reference

TORCH_CASES = {  # id: (spans, Hkv, G, D, dtype)
    "first_chunks_g1_d64": ([(0, 37), (0, 5)], 2, 1, 64, torch.float32),
    "offsets_g3_d128": ([(16, 20), (23, 9), (0, 31)], 2, 3, 128, torch.float32),
    "long_prefix_g7_d64": ([(100, 12), (48, 40)], 1, 7, 64, torch.float32),
    "bf16_g4_d128": ([(5, 27), (32, 16)], 2, 4, 128, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_paged_prefill_torch_matches_ref(name):
    from oasiskv.kernels.paged_prefill import paged_prefill
    spans, Hkv, G, D, dtype = TORCH_CASES[name]
    q, kv_cache, table = make_prefill_inputs(spans, Hkv, G, D, dtype, seed=len(name))
    got = paged_prefill(q, kv_cache, table, Hkv, D ** -0.5)  # CPU tensors: the torch path
    want = reference(q, kv_cache, table, Hkv, D ** -0.5)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_reference_is_plain_causal_attention_for_a_first_chunk():
    """prefix_len 0: the reference equals SDPA's causal attention over the chunk's own K/V."""
    Hkv, G, D = 2, 2, 64
    q, kv_cache, table = make_prefill_inputs([(0, 21)], Hkv, G, D, torch.float32, seed=3)
    pages = table.page_table[0, :2].long()
    kv = kv_cache.view(-1, Hkv, 2, 16, D)[pages].permute(2, 1, 0, 3, 4).reshape(2, Hkv, -1, D)[:, :, :21]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kv[0][None], kv[1][None], is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(reference(q, kv_cache, table, Hkv, D ** -0.5), sdpa, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- Triton under the interpreter

KERNEL_CASES = {  # id: (spans, Hkv, G, D, dtype, kernel options); tiny: the interpreter is slow
    # chunk offsets 0, block-aligned (16) and mid-block (23) in one launch; tiles of 16 rows
    "g1_d64_fp32_offsets": ([(0, 20), (16, 9), (23, 17)], 2, 1, 64, torch.float32,
                            dict(rows=16, block_n=16)),
    # 3 heads a group: 5 tokens (15 of 16 rows) a tile; key tiles of two pages
    "g3_d128_fp16": ([(0, 6), (40, 13)], 2, 3, 128, torch.float16, dict(rows=16, block_n=32)),
    # 7 heads a group: 2 tokens a tile (14 of 16 rows); key tiles of half a page
    "g7_d64_fp16_half_page_tiles": ([(5, 7), (32, 4)], 1, 7, 64, torch.float16, dict(rows=16, block_n=16, bs=32)),
    # 32 rows, 8 tokens of 4 heads; a long prefix walks the unmasked loop over several tiles
    "g4_d128_fp32_long_prefix": ([(70, 11), (0, 3)], 1, 4, 128, torch.float32, dict(rows=32, block_n=16)),
}


def run_interpreter_cases() -> dict[str, float]:
    """Runs in the TRITON_INTERPRET=1 subprocess: max abs error of each case vs its reference."""
    from oasiskv.kernels.paged_prefill import paged_prefill_triton
    errors = {}
    for name, (spans, Hkv, G, D, dtype, options) in KERNEL_CASES.items():
        options = dict(options)
        bs = options.pop("bs", 16)
        q, kv_cache, table = make_prefill_inputs(spans, Hkv, G, D, dtype, bs=bs, seed=len(name))
        want = reference(q, kv_cache, table, Hkv, D ** -0.5)
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        paged_prefill_triton(q, kv_cache, table, Hkv, D ** -0.5, out=out, num_warps=1, num_stages=1, **options)
        errors[name] = (out.float().nan_to_num(1e4) - want.float()).abs().max().item()
    return errors


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_under_interpreter(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_paged_prefill_triton_interpreter(interpreter_errors, name):
    assert interpreter_errors[name] < TOL[KERNEL_CASES[name][4]]


# ----------------------------------------------------------------- the engine's prefill through the kernel

PROMPT = ("The history of the Roman Empire spans many centuries. It began when Augustus became the "
          "first emperor, and in the west it ended when the last emperor was deposed")


def engine_prefill_logits() -> list[float]:
    """The default model's logits after its prompt, prefilled in chunks of 13 tokens (offsets
    0, 13, 26, ...: mid-block), through whichever path `paged_prefill` takes in this process."""
    from oasiskv import LLM, SamplingParams
    llm = LLM(max_num_batched_tokens=13)
    model, seen = llm.engine.runner.model, []
    original = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(original(hidden)) or seen[-1]
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(ids) > 26
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=1))
    return seen[0][0].tolist()


@pytest.mark.slow
def test_engine_prefill_through_the_kernel_matches_the_torch_path():
    """Under the interpreter every prefill chunk of the engine runs the Triton kernel: its logits
    equal those of the torch path (float32), which tests/engine/test_engine_vs_hf.py holds to HF."""
    got = torch.tensor(run_under_interpreter(__file__, "engine")["logits"])
    want = torch.tensor(engine_prefill_logits())
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert got.argmax() == want.argmax()


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    if sys.argv[1:] == ["engine"]:
        print(json.dumps({"logits": engine_prefill_logits()}))
    else:
        print(json.dumps(run_interpreter_cases()))
