"""Per-request sampling settings (the names, defaults and bounds users know from vLLM)."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5  # below it logits / temperature overflow to inf and sampling turns NaN
MAX_SEED = 2**63  # torch generators take a signed 64-bit seed
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "lark")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (oasiskv.engine.structured_output compiles it):
    json_object: any JSON object (spec None); json_schema: spec is the schema (a dict), `strict`
    refuses keywords the grammar cannot enforce instead of ignoring them; regex: spec is the
    pattern; choice: spec is the list of allowed outputs; lark: spec is a grammar in llguidance's
    Lark syntax (the server's tool-call grammars)."""
    kind: str
    spec: dict | str | list[str] | None = None
    strict: bool = False

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        want = {"json_object": type(None), "json_schema": dict, "regex": str, "choice": list, "lark": str}[self.kind]
        if not isinstance(self.spec, want):
            raise ValueError(f"structured {self.kind} takes a {want.__name__} spec, got {type(self.spec).__name__}")
        if self.kind == "choice" and (not self.spec or any(not isinstance(c, str) or not c for c in self.spec)):
            raise ValueError("structured choice takes a non-empty list of non-empty strings")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # keep tokens at least min_p x the likeliest one's probability (0 = off)
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Over the generated tokens: logits -= presence * (count > 0) + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Over prompt and generated tokens: a positive logit is divided by it, a negative one multiplied.
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # Per generated (prompt) token: its logprob and the top-n tokens' (0: only its own). The
    # model's raw distribution, before penalties, bias and temperature (vLLM v1's default).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # vLLM's name: callables row [V] -> row [V] applied to this request's logits before
    # sampling, once per generated token, in order (evaluations use one to force given tokens
    # and keep the distributions: oasiskv.eval.teacher_forcing).
    logits_processors: list = field(default_factory=list)
    # Constrained decoding: each token is sampled among those the grammar allows next.
    structured: StructuredOutput | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not _is_number(self.temperature) or not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be positive and finite, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to biases")
            for tok, bias in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {tok!r}")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {tok}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError("structured must be a StructuredOutput")
        if self.structured is not None and self.min_tokens:  # it could hold back the only token allowed
            raise ValueError("min_tokens does not go with structured output: the grammar decides where it ends")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Its logits depend on the tokens so far (not only on how many there are)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Anything between the model's logits and temperature: processors, penalties, bias, min_tokens."""
        return bool(self.logits_processors or self.logit_bias or self.min_tokens) or self.has_penalties


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
