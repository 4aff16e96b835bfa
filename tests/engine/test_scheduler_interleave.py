"""A long prompt's chunks alternate with decode steps of the requests already running, so their
next token waits one chunk, not the whole prefill; with nothing decoding, chunks run back to back."""
from oasiskv.engine.block_hash import engine_salt
from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.scheduler import Scheduler
from oasiskv.engine.sequence import Sequence
from oasiskv.sampling_params import SamplingParams


def run_step(sched: Scheduler) -> str:
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_tokens):
        s.num_cached_tokens += n
        if s.num_cached_tokens == s.num_tokens:  # the step samples a token
            s.output_token_ids.append(7)
    return "P" if batch.is_prefill else "D"


def test_chunks_alternate_with_decode_steps():
    sched = Scheduler(BlockManager(64, 4, enable_caching=False, salt=engine_salt("t")),
                      max_num_seqs=4, max_num_batched_tokens=16)
    running = Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=100))
    sched.add(running)
    assert run_step(sched) == "P"  # its whole prompt, one chunk
    long_prompt = Sequence("b", list(range(1, 65)), SamplingParams(max_tokens=100))
    sched.add(long_prompt)
    kinds = [run_step(sched) for _ in range(8)]
    assert kinds == ["D", "P"] * 4 or kinds == ["P", "D"] * 4
    assert not long_prompt.in_prefill and len(running.output_token_ids) == 1 + 4


def test_chunks_back_to_back_when_nothing_decodes():
    sched = Scheduler(BlockManager(64, 4, enable_caching=False, salt=engine_salt("t")),
                      max_num_seqs=4, max_num_batched_tokens=16)
    sched.add(Sequence("b", list(range(1, 65)), SamplingParams(max_tokens=100)))
    assert [run_step(sched) for _ in range(5)] == ["P"] * 4 + ["D"]
