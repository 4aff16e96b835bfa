"""The proxy's fan-out: a request of several prompts or choices (`n`, `best_of`, a prompt list)
goes to the role servers as single requests, whose answers are merged back into the one a plain
server gives: whole (`merge`) or as one event stream (`merged_events`: each part's events as they
come, their choice index renumbered, one id, usage summed, one [DONE])."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from fastapi.responses import JSONResponse

from oasiskv.entrypoints.openai.protocol import error_body


def split(body: dict) -> list[tuple[dict, tuple]]:
    """A request of several prompts or choices as single ones (prompt-major, choice-minor), each
    `n` 1, with its group (prompt index, n, best_of, logprobs asked) for `merge`; best_of keeps
    the n best by cumulative logprob."""
    prompts = body.get("prompt")
    many = isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))
    prompts = prompts if many else [prompts]
    n = body.get("n") or 1
    best_of = body.get("best_of") or n
    if len(prompts) == 1 and best_of == 1:
        return [(body, None)]
    one = {k: v for k, v in body.items() if k not in ("n", "best_of")}
    if best_of > n:
        one["logprobs"] = one.get("logprobs") if one.get("logprobs") is not None else 0
    seed = body.get("seed")
    return [({**one, **({"prompt": p} if "prompt" in body else {}), **({"seed": seed + j} if seed is not None else {})},
             (i, n, best_of, body.get("logprobs")))
            for i, p in enumerate(prompts) for j in range(best_of)]


def merge(answers: list[JSONResponse], groups_of: list[tuple]) -> JSONResponse:
    """Single answers back into one (`split`'s order): the first error as it is; else the choices
    renumbered, the n best of each prompt's best_of, usage summed."""
    bodies = []
    for a in answers:
        if a.status_code != 200:
            return a
        bodies.append(json.loads(a.body))
    groups: dict[int, list] = {}
    for b, (i, n, best_of, logprobs) in zip(bodies, groups_of):
        groups.setdefault(i, []).append((b["choices"][0], n, best_of, logprobs))
    choices = []
    for i in sorted(groups):
        group = groups[i]
        n, best_of, logprobs = group[0][1], group[0][2], group[0][3]
        picked = [c for c, *_ in group]
        if best_of > n:
            picked = sorted(picked, key=lambda c: sum(x for x in (c.get("logprobs") or {}).get("token_logprobs") or []
                                                      if x is not None), reverse=True)[:n]
            if logprobs is None:
                picked = [{**c, "logprobs": None} for c in picked]
        choices += picked
    out = {**bodies[0], "choices": [{**c, "index": k} for k, c in enumerate(choices)]}
    out["usage"] = _usage([b.get("usage") for b in bodies], groups_of)
    out.pop("kv_transfer_params", None)
    return JSONResponse(out)


def _usage(usages: list[dict | None], groups_of: list[tuple]) -> dict:
    """The parts' usage as one: each prompt's tokens once, the completions' summed."""
    first: dict[int, dict] = {}
    for u, g in zip(usages, groups_of):
        first.setdefault(g[0], u or {})
    prompt_tokens = sum(u.get("prompt_tokens", 0) for u in first.values())
    completion = sum((u or {}).get("completion_tokens", 0) for u in usages)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    cached = [u["prompt_tokens_details"].get("cached_tokens", 0) for u in first.values() if u.get("prompt_tokens_details")]
    return out | ({"prompt_tokens_details": {"cached_tokens": sum(cached)}} if cached else {})


def broke_off(e: BaseException) -> dict:
    """The error event that ends a client's stream when a decode server's stream breaks off."""
    return error_body(f"the decode server's stream broke off ({type(e).__name__})", "server_error",
                      code="bad_gateway")


async def _events(k: int, response: aiohttp.ClientResponse, queue: asyncio.Queue) -> None:
    """Part k's `data:` payloads onto the queue as (k, payload), then (k, None) at its end."""
    try:
        async for line in response.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                await queue.put((k, json.loads(line[len(b"data: "):])))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        await queue.put((k, broke_off(e)))
    finally:
        await queue.put((k, None))


async def merged_events(responses: list[aiohttp.ClientResponse], groups_of: list[tuple]):
    """One stream out of the parts' streams (`split`'s order; streamed, best_of is n): a part's
    choice k is choice k of the whole; the first error event ends it."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_events(k, r, queue)) for k, r in enumerate(responses)]
    usages: list[dict | None] = [None] * len(responses)
    head: dict = {}
    try:
        open_parts = len(responses)
        while open_parts:
            k, event = await queue.get()
            if event is None:
                open_parts -= 1
                continue
            if "error" in event:
                yield f"data: {json.dumps(event)}\n\n".encode()
                break
            head = head or {key: event[key] for key in ("id", "object", "created", "model") if key in event}
            if event.get("usage"):
                usages[k] = event["usage"]
            if not event.get("choices"):
                continue  # a part's final usage: the whole's comes once at the end
            event = {**event, **head, "choices": [{**c, "index": k} for c in event["choices"]]}
            if event.get("usage"):
                event["usage"] = _usage(usages, groups_of)
            yield f"data: {json.dumps(event)}\n\n".encode()
        else:
            if any(usages):
                final = {**head, "choices": [], "usage": _usage(usages, groups_of)}
                yield f"data: {json.dumps(final)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:  # ended, failed or the client went away: every part's decode server sees its close
        for t in tasks:
            t.cancel()
        for r in responses:
            r.close()
