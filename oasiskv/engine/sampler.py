"""Turns a batch of logits into next tokens: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

import torch

from oasiskv.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], noise: torch.Tensor | None = None,
           processors: bool = True) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B] (long, on logits' device).

    noise: [B, V] Exp(1) draws to sample with instead of fresh ones (`draw_noise`). The sampled
    token is a deterministic function of the logits and the noise, so a lookahead drafter that
    draws a position's noise one step early can sample its draft with it and propose the very
    token sampling will pick there. processors=False skips the requests' logits processors
    (they belong to the real row, not to a draft row)."""
    if processors:
        logits = apply_logits_processors(logits, params)
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    dev = logits.device
    temps = on_device([p.temperature if not p.greedy else 1.0 for p in params], dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
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


def apply_logits_processors(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each request's processors see its row and may replace it (a copy: the caller's logits,
    e.g. the draft rows of a sparse step, stay as they are)."""
    if not any(p.logits_processors for p in params):
        return logits
    logits = logits.clone()
    for i, p in enumerate(params):
        for process in p.logits_processors:
            logits[i] = process(logits[i])
    return logits


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
