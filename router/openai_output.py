"""OpenAI response bodies from the router's token streams: one choice per generation (`n` samples
of each prompt, choice index = prompt x n + sample, as vLLM numbers them), gathered into one JSON
body or streamed as server-sent events ending with [DONE].

The generations of one HTTP request run side by side. Whatever ends the request early (an error
in one of them, a client that disconnects) stops all of them, so no worker keeps computing for
a body nobody will read."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from aiohttp import web

from pdcommon.v1 import router_pb2 as pb
from router.token_text import text_offsets, token_texts


@dataclass(slots=True)
class Reply:
    """What every event of one response shares."""

    id: str
    created: int
    model: str
    chat: bool
    n: int  # samples per prompt: usage counts each prompt's tokens once
    keep: int | None = None  # best_of: of each prompt's n samples, the `keep` likeliest are returned
    logprobs: bool = False  # the request asked for them (logprobs: 0 too: the chosen tokens' own)
    echo: list[str] | None = None  # a completion's echo: each prompt's text, ahead of its choices'
    generated: bool = True  # False: echo with max_tokens 0; the token generated is left out

    @property
    def head(self) -> dict:
        kind = ("chat.completion.chunk" if self.chat else "text_completion")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(last: Sequence[pb.GenerateResponse | None], n: int, generated: bool = True) -> dict:
    """Summed over the choices; a prompt's own tokens (and its cache hits) once, not once per sample."""
    firsts = [m for i, m in enumerate(last) if m is not None and i % n == 0]
    prompt = sum(m.usage.prompt_tokens for m in firsts)
    completion = sum(m.usage.completion_tokens for m in last if m is not None) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m.usage.cached_tokens for m in firsts)}}


def _top_texts(tok, top: pb.TopLogprobs) -> dict[str, float]:
    """A position's alternatives, keyed by their text."""
    return dict(zip(token_texts(tok, list(top.logprobs)), top.logprobs.values(), strict=True))


def logprobs(tok, msg: pb.GenerateResponse, chat: bool, offset: int, want: bool = True) -> tuple[dict | None, int]:
    """Logprobs of one message (tokens as text), and the text offset after it. With no
    alternatives asked for (logprobs: 0), a completion token's own logprob stands as its top one
    (vLLM's way: the sampled token is always there); a chat token has none (OpenAI's)."""
    if not want or not (msg.top_logprobs or msg.logprobs):
        return None, offset
    texts = token_texts(tok, list(msg.token_ids))
    tops = [_top_texts(tok, t) for t in msg.top_logprobs] or \
        [{} if chat else {t: lp} for t, lp in zip(texts, msg.logprobs, strict=False)]
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": [
            {"token": k, "logprob": v, "bytes": list(k.encode())} for k, v in top.items()]}
            for t, lp, top in zip(texts, msg.logprobs, tops, strict=False)]}, offset
    offsets, offset = text_offsets(texts, offset)
    return {"tokens": texts, "token_logprobs": list(msg.logprobs), "top_logprobs": tops,
            "text_offset": offsets}, offset


def echoed(tok, reply: Reply, index: int, msg: pb.GenerateResponse) -> tuple[str, dict | None, int]:
    """Echo: what goes ahead of a choice's first message: its prompt's text, and with logprobs
    the prompt tokens' (the first has none: null, as OpenAI and vLLM give it), and the text
    offset after them."""
    prompt = reply.echo[index // reply.n] if reply.echo else ""
    if not reply.logprobs or not msg.prompt_token_ids:
        return prompt, None, 0
    texts = token_texts(tok, list(msg.prompt_token_ids))
    lps = [None, *msg.prompt_logprobs]
    tops = [None] + [_top_texts(tok, t) or {tx: lp}
                     for t, tx, lp in zip(msg.prompt_top_logprobs, texts[1:], msg.prompt_logprobs, strict=True)]
    offsets, offset = text_offsets(texts, 0)
    return prompt, {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _merge(parts: list[dict], chat: bool) -> dict | None:
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def piece(tok, reply: Reply, index: int, msg: pb.GenerateResponse, offset: int, first: bool,
          ) -> tuple[str, dict | None, int]:
    """One message of a choice as its text, logprobs and the text offset after them: the echo
    (echoed) ahead of the first, and the generated part unless it is left out (reply.generated)."""
    text, parts = "", []
    if first and reply.echo is not None:
        text, lp, offset = echoed(tok, reply, index, msg)
        parts += [lp] if lp else []
    if reply.generated:
        text += msg.text
        lp, offset = logprobs(tok, msg, reply.chat, offset, reply.logprobs)
        parts += [lp] if lp else []
    return text, _merge(parts, reply.chat), offset


async def _choice(tok, gen, index: int, reply: Reply) -> tuple[dict, pb.GenerateResponse | None, float]:
    """The choice, its last message, and its tokens' summed logprob (what best_of ranks by)."""
    out, finish, last, lps, offset, total, first = "", None, None, [], 0, 0.0, True
    async for msg in gen:
        text, lp, offset = piece(tok, reply, index, msg, offset, first)
        out, first = out + text, False
        lps += [lp] if lp else []
        total += sum(msg.logprobs) if reply.generated else 0.0
        if msg.finish_reason:
            finish, last = msg.finish_reason, msg
    choice = {"index": index, "finish_reason": finish, "logprobs": _merge(lps, reply.chat)}
    if reply.chat:
        choice["message"] = {"role": "assistant", "content": out}
    else:
        choice["text"] = out
    return choice, last, total


def _best(done: list[tuple[dict, pb.GenerateResponse | None, float]], n: int, keep: int) -> list[dict]:
    """Of each prompt's n samples, the `keep` with the highest summed logprob, numbered anew."""
    out = []
    for start in range(0, len(done), n):
        group = sorted(done[start:start + n], key=lambda d: -d[2])[:keep]
        for rank, (choice, _, _) in enumerate(group):
            out.append({**choice, "index": start // n * keep + rank})
    return out


async def collect(tok, gens: Sequence, reply: Reply) -> web.Response:
    """The whole answer as one body. Raises the first generation's failure (RequestFailed)."""
    if len(gens) == 1:
        done = [await _choice(tok, gens[0], 0, reply)]
    else:
        tasks = [asyncio.ensure_future(_choice(tok, g, i, reply)) for i, g in enumerate(gens)]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:
            await _stop(tasks)
            raise
    picked = [c for c, _, _ in done] if reply.keep in (None, reply.n) else _best(done, reply.n, reply.keep)
    return web.json_response({**reply.head, "object": "chat.completion" if reply.chat else "text_completion",
                              "choices": picked, "usage": usage([m for _, m, _ in done], reply.n, reply.generated)},
                             headers={"X-Request-Id": reply.id})


async def merged(gens: Sequence) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(choice index, message) of all the generations, as they come. The first failure is raised
    here and stops the rest; so does closing this iterator."""
    if len(gens) == 1:
        async for msg in gens[0]:
            yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for msg in gen:
                queue.put_nowait((i, msg, None))
        except Exception as e:  # re-raised by the reader
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            i, msg, err = await queue.get()
            if err is not None:
                raise err
            if msg is None:
                running -= 1
                continue
            yield i, msg
    finally:
        await _stop(tasks)


async def _stop(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def event(reply: Reply, index: int, msg: pb.GenerateResponse, text: str, lp: dict | None, first: bool,
          include_usage: bool) -> bytes:
    """One choice's message as an event, with its text and logprobs as `piece` made them."""
    choice: dict = {"index": index, "finish_reason": msg.finish_reason or None, "logprobs": lp}
    if reply.chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    body = {**reply.head, "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return f"data: {json.dumps(body)}\n\n".encode()


def usage_event(reply: Reply, last: Sequence[pb.GenerateResponse | None]) -> bytes:
    body = {**reply.head, "choices": [], "usage": usage(last, reply.n, reply.generated)}
    return f"data: {json.dumps(body)}\n\n".encode()
