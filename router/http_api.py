"""OpenAI-compatible HTTP on the router: /v1/completions, /v1/chat/completions (streaming as
server-sent events ending with [DONE]), /v1/models, /health and Prometheus /metrics.

Requests go through the same RouterCore path as gRPC; errors use OpenAI's JSON error shape."""

from __future__ import annotations

import json
import logging
import time
import uuid

import grpc
from aiohttp import ClientConnectionResetError, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdcommon.v1 import router_pb2 as pb
from router.auth import ApiKeys
from router.core import RouterCore
from router.metrics import RouterMetrics
from router.openai_params import (
    ApiError,
    Limits,
    bad,
    boolean,
    check_fields,
    generate_request,
    stream_options,
    text,
    token_ids,
)
from router.request import RequestFailed
from router.token_text import text_offsets, token_texts

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def api_error(e: RequestFailed) -> ApiError:
    status, etype = HTTP_STATUS.get(e.code, (500, "internal_server_error"))
    # An overload refusal says when to come back (OpenAI clients and proxies honour Retry-After).
    headers = {"Retry-After": "1"} if status == 429 else None
    return ApiError(status, e.message, etype, code=e.code.name.lower(), headers=headers)


def error_response(e: ApiError, request_id: str) -> web.Response:
    body = {"error": {"message": e.message, "type": e.etype, "param": e.param, "code": e.code}}
    return web.json_response(body, status=e.status, headers={"X-Request-Id": request_id, **e.headers})


class OpenAIApi:
    def __init__(self, core: RouterCore, metrics: RouterMetrics, keys: ApiKeys | None = None) -> None:
        self.core = core
        self.metrics = metrics
        self.keys = keys or ApiKeys(frozenset())
        self.created = int(time.time())
        app = web.Application(client_max_size=core.cfg.router.max_request_bytes,
                              middlewares=[self._auth, _errors])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/health", self.health)
        self.app = app

    # ---- plain endpoints -----------------------------------------------------------------------
    def _card(self) -> dict:
        m = self.core.model
        return {"id": m.name, "object": "model", "created": self.created, "owned_by": "pdserve", "root": m.path,
                "max_model_len": m.max_model_len, "vocab_size": m.vocab_size}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            self._check_model({"model": request.match_info["model_id"]})
        except ApiError as e:
            return error_response(e, rid)
        return web.json_response(self._card())

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's shape: {prompt | messages, add_special_tokens} -> {count, max_model_len, tokens}."""
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            body = await self._json(request)
            self._check_model(body)
            if "messages" in body:
                ids = await self.core.offload(self._chat_ids, body, boolean(body, "add_generation_prompt", True))
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' must be a string", param="prompt")
                special = boolean(body, "add_special_tokens", True)
                ids = await self.core.offload(self.core.model.encode, text(prompt, "prompt"), special)
        except ApiError as e:
            return error_response(e, rid)
        return web.json_response({"count": len(ids), "max_model_len": self.core.model.max_model_len, "tokens": ids,
                                  "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            body = await self._json(request)
            self._check_model(body)
            tokens = body.get("tokens")
            vocab = self.core.model.vocab_size
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       and 0 <= t < vocab for t in tokens):
                raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        except ApiError as e:
            return error_response(e, rid)
        return web.json_response({"prompt": await self.core.offload(self.core.model.tokenizer.decode, tokens)})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": self.core.ready()}, status=200 if self.core.ready() else 503)

    # ---- generation ----------------------------------------------------------------------------
    def _check_model(self, body: dict) -> str:
        name = body.get("model") or self.core.model.name
        if name not in (self.core.model.name, self.core.model.path):
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{self.core.model.name}'",
                           "not_found_error", "model", "model_not_found")
        return self.core.model.name

    @property
    def limits(self) -> Limits:
        return Limits(self.core.model.vocab_size, self.core.model.max_model_len)

    @staticmethod
    async def _json(request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex}"
        try:
            body = await self._json(request)
            check_fields(body, "completion")
            model = self._check_model(body)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt = text(prompt, "prompt")
            elif isinstance(prompt, list):
                prompt = token_ids(prompt, "prompt", self.core.model.vocab_size)
            else:
                raise bad("prompt", "must be a string, a list of token ids, or a list with one of those")
            req = generate_request(body, prompt, rid, self.limits, chat=False)
            return await self._run(request, body, req, rid, model, chat=False)
        except ApiError as e:
            return error_response(e, rid)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            body = await self._json(request)
            check_fields(body, "chat")
            model = self._check_model(body)
            generate_request(body, [0], rid, self.limits, chat=True)  # check sampling fields before templating
            req = generate_request(body, await self.core.offload(self._chat_ids, body), rid, self.limits, chat=True)
            return await self._run(request, body, req, rid, model, chat=True)
        except ApiError as e:
            return error_response(e, rid)

    def _chat_ids(self, body: dict, add_generation_prompt: bool = True) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise bad("messages", "must be a non-empty list of {role, content} objects")
        for m in messages:
            if isinstance(m.get("content"), str):
                text(m["content"], "messages")
        tok = self.core.model.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, f"model '{self.core.model.name}' has no chat template; use /v1/completions with a "
                           "plain prompt", param="messages", code="no_chat_template")
        try:
            rendered = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from e
        # The template writes any special tokens itself.
        return list(tok(rendered, add_special_tokens=False).input_ids)

    def _usage(self, msg: pb.GenerateResponse) -> dict:
        u = msg.usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    def _logprobs(self, msg: pb.GenerateResponse, chat: bool, offset: int) -> tuple[dict | None, int]:
        """Logprobs of one message (tokens as text), and the text offset after it."""
        if not msg.top_logprobs:
            return None, offset
        tok = self.core.model.tokenizer
        texts = token_texts(tok, list(msg.token_ids))
        tops = [dict(zip(token_texts(tok, list(t.logprobs)), t.logprobs.values(), strict=True))
                for t in msg.top_logprobs]
        if chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": [
                {"token": k, "logprob": v, "bytes": list(k.encode())} for k, v in top.items()]}
                for t, lp, top in zip(texts, msg.logprobs, tops, strict=False)]}, offset
        offsets, offset = text_offsets(texts, offset)
        return {"tokens": texts, "token_logprobs": list(msg.logprobs), "top_logprobs": tops,
                "text_offset": offsets}, offset

    async def _run(self, request: web.Request, body: dict, req: pb.GenerateRequest, rid: str, model: str,
                   chat: bool) -> web.StreamResponse:
        try:
            st = await self.core.parse(req, None)
        except RequestFailed as e:
            raise api_error(e) from e
        created = int(time.time())
        gen = self.core.generate(st)
        ctx = {"id": rid, "created": created, "model": model, "chat": chat}
        try:
            if not body.get("stream"):
                return await self._collect(gen, ctx)
            return await self._stream(request, gen, ctx, stream_options(body))
        except (ConnectionResetError, ClientConnectionResetError):
            log.info("client disconnected", extra={"request_id": rid})
            return web.Response(status=499)  # nobody reads it; aiohttp needs a return value
        finally:
            await gen.aclose()  # a client gone mid-request frees both workers now, not at GC

    async def _collect(self, gen, ctx: dict) -> web.Response:
        chat = ctx["chat"]
        out_text, finish, last, lps, offset = "", None, None, [], 0
        try:
            async for msg in gen:
                out_text += msg.text
                lp, offset = self._logprobs(msg, chat, offset)
                if lp:
                    lps.append(lp)
                if msg.finish_reason:
                    finish, last = msg.finish_reason, msg
        except RequestFailed as e:
            raise api_error(e) from e
        choice = {"index": 0, "finish_reason": finish, "logprobs": _merge(lps, chat)}
        if chat:
            choice["message"] = {"role": "assistant", "content": out_text}
        else:
            choice["text"] = out_text
        return web.json_response({"id": ctx["id"], "object": "chat.completion" if chat else "text_completion",
                                  "created": ctx["created"], "model": ctx["model"], "choices": [choice],
                                  "usage": self._usage(last)}, headers={"X-Request-Id": ctx["id"]})

    async def _stream(self, request: web.Request, gen, ctx: dict, include_usage: bool) -> web.StreamResponse:
        chat = ctx["chat"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": ctx["id"]})
        first, offset = True, 0
        head = {"id": ctx["id"], "object": "chat.completion.chunk" if chat else "text_completion",
                "created": ctx["created"], "model": ctx["model"]}
        try:
            async for msg in gen:
                if first:
                    await resp.prepare(request)
                lp, offset = self._logprobs(msg, chat, offset)
                choice: dict = {"index": 0, "finish_reason": msg.finish_reason or None, "logprobs": lp}
                if chat:
                    choice["delta"] = {"role": "assistant", "content": msg.text} if first else {"content": msg.text}
                else:
                    choice["text"] = msg.text
                first = False
                event = {**head, "choices": [choice]}
                if include_usage:
                    event["usage"] = None
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                if msg.finish_reason and include_usage:
                    usage = {**head, "choices": [], "usage": self._usage(msg)}
                    await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        except RequestFailed as e:
            if first:  # nothing sent yet: a proper HTTP error
                raise api_error(e) from e
            err = api_error(e)
            await resp.write(f"data: {json.dumps({'error': {'message': err.message, 'type': err.etype}})}\n\n"
                             .encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.keys.http_needs_key(request.path) and not self.keys.check(request.headers.get("Authorization")):
            rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            return error_response(ApiError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                                           "invalid_request_error", code="invalid_api_key"), rid)
        return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Anything unexpected still answers in OpenAI's error shape, with the request id."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as e:
        log.exception("HTTP handler failed")
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error"), rid)


def _merge(parts: list[dict], chat: bool) -> dict | None:
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
