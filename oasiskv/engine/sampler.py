"""Turns a batch of logits into next tokens: greedy, temperature, top-k, top-p, seeded; and,
around that, each request's own rules (logits processors, penalties, bias, min_tokens, its
grammar's mask) and logprobs, with a request whose own work fails failed alone."""
from __future__ import annotations

import torch

from oasiskv.engine.logprobs import record_token_logprobs
from oasiskv.engine.penalties import apply_rules
from oasiskv.engine.structured_output import apply_bitmask, batch_masks
from oasiskv.sampling_params import SamplingParams


def sample_requests(logits: torch.Tensor, seqs: list, noise: torch.Tensor | None = None,
                    appended: torch.Tensor | None = None) -> torch.Tensor:
    """The next token [B] (on logits' device) of each request's row of logits [B, V] (float32).

    Each request's own work, its logits processors and `apply_rules`, runs on its row alone: if it
    raises, the request is failed (`seq.error`, which the engine turns into its error output) and
    its row samples the raw logits, so the batch goes on. The batched sampling after that is
    retried row by row should it raise, with the same noise, to find the request at fault; if
    every row fails, the fault is not a request's (a device error) and propagates.
    Requests that ask get their sampled tokens' logprobs, from the raw logits.

    appended: the draft row of a lookahead step: [B] tokens taken as generated before these
    logits (each row's draft). Draft rows skip the processors (they belong to the real row),
    record nothing and fail nothing: a faulty rule leaves the draft row's logits raw."""
    params = [s.params for s in seqs]
    draft = appended is not None
    adjusted = logits
    if any(p.adjusts_logits for p in params):
        adjusted = logits.clone()
        for i, s in enumerate(seqs):
            if not s.params.adjusts_logits:
                continue
            try:
                row = adjusted[i]
                if not draft:
                    for process in s.params.logits_processors:
                        row = process(row)
                adjusted[i] = apply_rules(row, s, appended[i] if draft else None)
            except Exception as e:  # noqa: BLE001 - any fault of the request's own work fails only it
                adjusted[i] = logits[i]
                if not draft:
                    _fail(s, e)
    if any(s.grammar is not None for s in seqs):
        adjusted = adjusted.clone() if adjusted is logits else adjusted
        _apply_grammars(adjusted, seqs, appended)
    gens = [s.generator for s in seqs]
    if noise is None and not all(p.greedy for p in params):
        noise = draw_noise(gens, logits.shape[1], logits.device)
    try:
        tokens = sample(adjusted, params, gens, noise)
    except Exception:  # noqa: BLE001 - which request? each row alone tells
        rows, faults = zip(*(_sample_row(logits, adjusted, seqs, noise, i) for i in range(len(seqs))))
        if all(faults):
            raise
        if not draft:
            for s, fault in zip(seqs, faults):
                if fault is not None:
                    _fail(s, fault)
        tokens = torch.cat(rows)
    if not draft:
        record_token_logprobs(seqs, logits, tokens)
    return tokens


def _apply_grammars(adjusted: torch.Tensor, seqs: list, appended: torch.Tensor | None) -> None:
    """Each grammared row keeps only the tokens its grammar allows next (the batch's masks in
    parallel); a draft row those allowed after its draft (without advancing the grammar), or
    all if the draft breaks it."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    masks = None
    if appended is None:
        try:
            masks = batch_masks([seqs[i].grammar for i in rows], pin=adjusted.device.type == "cuda")
        except Exception:  # noqa: BLE001 - which request's grammar? each alone tells, below
            masks = None
    if masks is None:
        rows, masks = _masks_one_by_one(seqs, rows, appended.tolist() if appended is not None else None)
    if rows:
        index = on_device(rows, adjusted.device)
        constrained = adjusted[index]
        apply_bitmask(constrained, masks)
        adjusted[index] = constrained


def _masks_one_by_one(seqs: list, rows: list[int], drafts: list[int] | None) -> tuple[list[int], torch.Tensor | None]:
    """The rows that take a mask and their masks, one grammar at a time: a grammar that fails
    fails its request alone; a draft the grammar refuses leaves its row unconstrained."""
    kept, masks = [], []
    for i in rows:
        s = seqs[i]
        try:
            mask = s.grammar.draft_mask(drafts[i]) if drafts is not None else s.grammar.mask()
        except Exception as e:  # noqa: BLE001 - a fault of this request's grammar fails only it
            if drafts is None:
                _fail(s, e)
            continue
        if mask is not None:
            kept.append(i)
            masks.append(mask)
    return kept, torch.stack(masks) if masks else None


def _sample_row(logits, adjusted, seqs, noise, i: int) -> tuple[torch.Tensor, Exception | None]:
    """Row i sampled alone, or its raw argmax and the fault that stopped it."""
    s = seqs[i]
    try:
        return sample(adjusted[i:i + 1], [s.params], [s.generator], None if noise is None else noise[i:i + 1]), None
    except Exception as e:  # noqa: BLE001
        return logits[i:i + 1].argmax(dim=-1), e


def _fail(seq, e: Exception) -> None:
    if seq.error is None:
        seq.error = f"sampling failed: {type(e).__name__}: {e}"


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B] (long, on logits' device).

    noise: [B, V] Exp(1) draws to sample with instead of fresh ones (`draw_noise`). The sampled
    token is a deterministic function of the logits and the noise, so a lookahead drafter that
    draws a position's noise one step early can sample its draft with it and propose the very
    token sampling will pick there."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    dev = logits.device
    temps = on_device([p.temperature if not p.greedy else 1.0 for p in params], dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = on_device([p.min_p for p in params], dev)
        probs = probs * (probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True))
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        probs = _top_k_top_p(probs, params)
    if noise is None:
        noise = draw_noise(generators, probs.shape[1], dev)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = on_device([p.greedy for p in params], dev)
    return torch.where(is_greedy, greedy, sampled)


def draw_noise(generators: list[torch.Generator | None], vocab: int, dev: torch.device) -> torch.Tensor:
    """[B, vocab] Exp(1) draws, one row per request; seeded requests draw from their own stream."""
    noise = torch.empty(len(generators), vocab, device=dev).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = torch.empty(vocab, device=dev).exponential_(generator=g)
    return noise


def on_device(values: list, dev: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the device: `torch.tensor(...,
    device=cuda)` copies from pageable memory, which waits for the work already queued (the step
    in flight, under async scheduling); pinned staging and an async copy do not."""
    t = torch.tensor(values)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Device values to pinned host memory without waiting: the copy and the event that marks
    it done (None on CPU, where the tensor itself is returned). `.tolist()` on the device
    tensor would queue behind whatever is launched after it and wait for that too."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def read_host(host: torch.Tensor, ready: torch.cuda.Event | None) -> list:
    """`to_host`'s copy as a list, once its event has fired."""
    if ready is not None:
        ready.synchronize()
    return host.tolist()


def _top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev, V = probs.device, probs.shape[1]
    top_k = on_device([p.top_k if p.top_k > 0 else V for p in params], dev)
    top_p = on_device([p.top_p for p in params], dev)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=dev)[None, :]
    # Keep a token if it is within the top k and the mass before it is below top_p.
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = (rank < top_k[:, None]) & (mass_before < top_p[:, None])
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)
