"""Turns a batch of logits into next tokens: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

import torch

from oasiskv.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B] (long, on logits' device)."""
    logits = apply_logits_processors(logits, params)
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    dev = logits.device
    temps = on_device([p.temperature if not p.greedy else 1.0 for p in params], dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        probs = _top_k_top_p(probs, params)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; seeded rows use their own stream.
    noise = torch.empty_like(probs).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = torch.empty(probs.shape[1], device=dev).exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = on_device([p.greedy for p in params], dev)
    return torch.where(is_greedy, greedy, sampled)


def on_device(values: list, dev: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the device: `torch.tensor(...,
    device=cuda)` copies from pageable memory, which waits for the work already queued (the step
    in flight, under async scheduling); pinned staging and an async copy do not."""
    t = torch.tensor(values)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


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
