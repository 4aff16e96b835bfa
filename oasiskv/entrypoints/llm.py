"""Offline batch API: `LLM(model).generate(prompts, sampling_params)`."""
from __future__ import annotations

from tqdm import tqdm

from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine, RequestOutput
from oasiskv.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """engine_args: EngineConfig's settings, sparse decode's flat (`sparse=True, top_k_blocks=32`)."""
        self.engine = LLMEngine(EngineConfig.from_flat(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of those."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        params = [p or SamplingParams() for p in params]
        # Check every request before adding any, so a bad one leaves the engine untouched.
        token_ids = [self.engine.tokenize(p) for p in prompts]
        for ids, p in zip(token_ids, params):
            self.engine.validate(ids, p)
        rids = [self.engine.add_request(ids, p) for ids, p in zip(token_ids, params)]
        for rid, prompt in zip(rids, prompts):
            if isinstance(prompt, str):
                self.engine.seqs[rid].prompt = prompt
        done: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(prompts) > 8
        with tqdm(total=len(rids), desc="generating", disable=not show) as bar:
            while len(done) < len(rids) and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in rids:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[r] for r in rids]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        return self.generate(self.apply_chat_template(messages), sampling_params)[0]

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
