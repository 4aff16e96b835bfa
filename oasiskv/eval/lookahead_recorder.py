"""What the lookahead predicts against what the next step really needs, recorded per layer
inside the running sparse engine (the measurement behind `oasiskv eval agreement`).

Installed as an observer of the `LookaheadPipeline` (steps in order), it runs after each
layer's stages of a decode step. For a sparse request, at the step adding the token at position n:
  P[drafter] = the predict stage's top-K from the draft row's query for the step adding
               position n+1 (the current token's query for `prev`): what the engine used;
  P[prev]    = the same from the current token's query (the previous-token proxy), measured
               in every run because that row is always there;
and one step later the true token's own query, scored by the same predict stage over the same
summaries and the same sink/window exclusions, gives T. Agreement = |P ∩ T| / |T|, which is
|P ∩ T| / K once the context has K scorable blocks.

Attention mass: the true token's softmax over its whole context (every block must be held,
i.e. a full budget) gives each block's share; we record the share inside sink + window + S
for S = T (the summaries' own top-K), the K blocks with the most true mass (the best any
selection of K could do), and each prediction.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from oasiskv.sparse.block_scores import score_topk

if TYPE_CHECKING:
    from oasiskv.sparse.pipeline import LookaheadPipeline


class LookaheadRecorder:
    def __init__(self, num_layers: int, ks: list[int], drafter: str):
        self.ks = sorted(ks)
        self.drafter = drafter
        self.predictors = [drafter] if drafter == "prev" else [drafter, "prev"]
        nk = len(self.ks)
        self.agreement = {p: np.zeros((num_layers, nk)) for p in self.predictors}  # sums over steps
        self.coverage = {p: np.zeros((num_layers, nk)) for p in ["quest", "best"] + self.predictors}
        self.steps = np.zeros(num_layers, dtype=np.int64)
        self._pending: dict[tuple[int, int], tuple] = {}  # (id(ws), layer) -> (ws, cached, preds, draft)
        # One entry per checked step of a request: its index in the request's run, whether the
        # draft token was the real one (None without a draft token), the drafter's agreement
        # per K averaged over the layers (what tells a cold start from a chain that breaks).
        self.step_log: list[dict] = []
        self._open: dict[tuple[int, int], dict] = {}  # (id(ws), cached) -> the entry being filled
        self._runs: dict[int, tuple] = {}  # id(ws) -> (ws, index of its last checked step)

    def __call__(self, p: LookaheadPipeline, layer: int, q: torch.Tensor) -> None:
        """After layer l's stages: q [2 * rows, Hq, D], the token and draft rows of each pipeline row."""
        draft_row = 1 if p.drafted else 0
        active = p.active[:len(p.owners)].tolist()
        for row, ws in enumerate(p.owners):
            if not active[row]:
                continue
            cached, q_now = int(p.cached[row]), q[2 * row]
            key = (id(ws), layer)
            entry = self._pending.pop(key, None)
            # The ws reference held in `entry` keeps id(ws) from being reused by a new request.
            if entry is not None and entry[0] is ws and entry[1] == cached:
                truth = ranked_blocks(p, ws, layer, q_now, cached, self.ks[-1])
                mass = block_attention_mass(p, ws, layer, q_now, cached)
                self._score(layer, entry[2], truth, mass, p.S, ws.window_start(cached, p.bs))
                self._log_step(ws, cached, entry[3], entry[2][self.drafter], truth, int(p.history[row, -1]))
            preds = {self.drafter: ranked_blocks(p, ws, layer, q[2 * row + draft_row], cached + 1, self.ks[-1])}
            if "prev" not in preds:
                preds["prev"] = ranked_blocks(p, ws, layer, q_now, cached + 1, self.ks[-1])
            self._pending[key] = (ws, cached + 1, preds, ws.draft if draft_row else None)

    def _log_step(self, ws, cached: int, draft: int | None, pred: torch.Tensor, truth: torch.Tensor,
                  token: int) -> None:
        """Adds one layer's agreement to the step's entry (token: the real token this step
        processes, the newest of the row's history)."""
        entry = self._open.get((id(ws), cached))
        if entry is None:
            for done in [k for k in self._open if k[0] == id(ws)]:  # the request's last step
                self.step_log.append(self._close(self._open.pop(done)))
            seen, before = self._runs.get(id(ws), (None, -1))
            step = before + 1 if seen is ws else 0  # holding ws keeps its id from a new request
            self._runs[id(ws)] = (ws, step)
            right = None if draft is None else draft == token
            entry = self._open[(id(ws), cached)] = {"step": step, "draft_right": right,
                                                    "sums": np.zeros(len(self.ks)), "layers": 0}
        for i, k in enumerate(self.ks):
            entry["sums"][i] += overlap(pred[:, :k], truth[:, :k])
        entry["layers"] += 1

    def _close(self, entry: dict) -> dict:
        return {"step": entry["step"], "draft_right": entry["draft_right"],
                "agreement": {str(k): round(float(v / entry["layers"]), 4) for k, v in zip(self.ks, entry["sums"])}}

    def finish(self) -> list[dict]:
        """The step log, every open entry closed (call after the run)."""
        self.step_log += [self._close(e) for e in self._open.values()]
        self._open.clear()
        return self.step_log

    def _score(self, layer, preds, truth, mass, num_sink, window_start) -> None:
        static = mass[:, :num_sink].sum(1) + mass[:, window_start:].sum(1)  # always resident
        scored = mass[:, num_sink:window_start]
        best = scored.sort(dim=1, descending=True).values.cumsum(1)  # [H, n]
        for i, k in enumerate(self.ks):
            t = truth[:, :k]
            for name, p in preds.items():
                self.agreement[name][layer, i] += overlap(p[:, :k], t)
                self.coverage[name][layer, i] += covered(mass, static, p[:, :k])
            self.coverage["quest"][layer, i] += covered(mass, static, t)
            top = best[:, min(k, best.shape[1]) - 1] if best.shape[1] else torch.zeros(len(static))
            self.coverage["best"][layer, i] += float((static + top).mean())
        self.steps[layer] += 1

    def merge(self, other: "LookaheadRecorder") -> None:
        for mine, theirs in ((self.agreement, other.agreement), (self.coverage, other.coverage)):
            for name, arr in theirs.items():
                mine[name] = mine.get(name, 0) + arr
        self.steps = self.steps + other.steps

    def per_layer(self, table: str, name: str, k: int) -> list[float]:
        """Mean over the recorded steps, one value per layer."""
        col = self.ks.index(k)
        sums = getattr(self, table)[name][:, col]
        return [float(s / n) if n else float("nan") for s, n in zip(sums, self.steps)]


def ranked_blocks(p: LookaheadPipeline, ws, layer: int, query: torch.Tensor, cached: int, k: int) -> torch.Tensor:
    """The predict stage's best-first blocks [Hkv, k] (-1: none) for the step adding token
    `cached`, from the request's summaries in the pipeline (query [Hq, D]). The engine runs
    with a full budget, so its K covers every block and the first k of its ranking are the top-k."""
    dev = p.device
    ids, _ = score_topk(query[None], p.kmin[layer], p.kmax[layer], p.summary_offset[ws.row:ws.row + 1],
                        torch.tensor([cached // p.bs + 1], device=dev), p.G, p.K, max_blocks=p.max_blocks,
                        num_sink=p.S, window_start=torch.tensor([ws.window_start(cached, p.bs)], device=dev))
    assert p.K >= k, "the agreement run needs --top-k-blocks >= the largest K measured"
    return ids[0, :, :k].cpu()


def overlap(pred: torch.Tensor, truth: torch.Tensor) -> float:
    """|P ∩ T| / |T| over all heads ([H, k] block ids, -1 padding)."""
    hit = ((pred[:, :, None] == truth[:, None, :]) & (truth >= 0)[:, None, :]).any(1)  # [H, k]
    n = int((truth >= 0).sum())
    return float(hit.sum()) / n if n else 1.0


def covered(mass: torch.Tensor, static: torch.Tensor, blocks: torch.Tensor) -> float:
    """Attention mass inside sink + window + `blocks` ([H, k], -1 padding), mean over heads."""
    picked = torch.where(blocks >= 0, mass.gather(1, blocks.clamp_min(0).long()), 0.0)
    return float((static + picked.sum(1)).mean())


def block_attention_mass(p: LookaheadPipeline, ws, layer: int, query: torch.Tensor, cached: int) -> torch.Tensor:
    """[Hkv, blocks] share of the attention of the token at position `cached` (its K/V already
    stored) on each logical block, averaged over the kv group's query heads. Reads the keys
    from the working set, which must hold every block (a full budget). A block may be held
    twice: this layer's prefetch for the next step has already admitted the block about to
    leave the window, which the window ring still holds; each block counts once."""
    bs, H, G, D = p.bs, p.H, p.G, p.D
    blocks = p.working_set_of(ws, adding=True)[0][layer].long()  # [H, P]
    P = blocks.shape[1]
    # Drop repeats, keeping each block's first position: a position repeats if an earlier one holds its block.
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, None, :] >= 0)  # [H, P, P]
    blocks = blocks.masked_fill((same & torch.ones(P, P, dtype=torch.bool).tril(-1)).any(-1), -1)
    nb = cached // bs + 1
    held = torch.zeros(H, nb + 1, dtype=torch.long).scatter_add_(
        1, torch.where(blocks >= 0, blocks, nb), torch.ones_like(blocks))[:, :nb]
    if not bool((held == 1).all()):
        raise ValueError("attention mass needs every block held: run with a full budget")
    pages = torch.tensor(ws.pages)
    slots = (pages[None, :] * H + torch.arange(H)[:, None]).reshape(-1).to(p.device)
    keys = p.kv[layer][slots, 0].view(H, P, bs, D).float()
    pos = blocks[:, :, None] * bs + torch.arange(bs)
    valid = ((blocks[:, :, None] >= 0) & (pos <= cached)).to(p.device)  # [H, P, bs]
    logits = torch.einsum("hgd,hpjd->hgpj", query.float().view(H, G, D), keys) * D ** -0.5
    logits = logits.masked_fill(~valid[:, None], float("-inf"))
    probs = torch.softmax(logits.reshape(H, G, -1), -1).view(H, G, P, bs).sum(-1).mean(1).cpu()
    mass = torch.zeros(H, nb + 1)
    return mass.scatter_add_(1, torch.where(blocks >= 0, blocks, nb), probs)[:, :nb]
