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

from pdcommon.client import make_request
from pdcommon.v1 import router_pb2 as pb
from router.core import RouterCore
from router.metrics import RouterMetrics
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


class ApiError(Exception):
    def __init__(self, status: int, message: str, etype: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.etype, self.param, self.code = status, message, etype, param, code

    @classmethod
    def from_failed(cls, e: RequestFailed) -> ApiError:
        status, etype = HTTP_STATUS.get(e.code, (500, "internal_server_error"))
        return cls(status, e.message, etype, code=e.code.name.lower())

    def response(self, request_id: str) -> web.Response:
        body = {"error": {"message": self.message, "type": self.etype, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers={"X-Request-Id": request_id})


def _opt(body: dict, name: str, types: tuple, default=None):
    value = body.get(name, default)
    if value is not None and (isinstance(value, bool) and bool not in types or not isinstance(value, types)):
        raise ApiError(400, f"'{name}' must be of type {'/'.join(t.__name__ for t in types)}", param=name)
    return value


class OpenAIApi:
    def __init__(self, core: RouterCore, metrics: RouterMetrics) -> None:
        self.core = core
        self.metrics = metrics
        self.created = int(time.time())
        app = web.Application(client_max_size=64 << 20, middlewares=[_errors])
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
            return e.response(rid)
        return web.json_response(self._card())

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's shape: {prompt | messages, add_special_tokens} -> {count, max_model_len, tokens}."""
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            body = await self._json(request)
            self._check_model(body)
            if "messages" in body:
                ids = self._chat_ids(body, add_generation_prompt=bool(body.get("add_generation_prompt", True)))
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' must be a string", param="prompt")
                special = _opt(body, "add_special_tokens", (bool,), True)
                ids = list(self.core.model.tokenizer(prompt, add_special_tokens=special).input_ids)
        except ApiError as e:
            return e.response(rid)
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
            return e.response(rid)
        return web.json_response({"prompt": self.core.model.tokenizer.decode(tokens)})

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

    def _request(self, body: dict, prompt: str | list[int], rid: str) -> pb.GenerateRequest:
        n = _opt(body, "n", (int,), 1)
        if n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        if body.get("echo"):
            raise ApiError(400, "echo is not supported", param="echo")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
            raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
        logprobs = body.get("logprobs")
        if body.get("top_logprobs") is not None:
            logprobs = _opt(body, "top_logprobs", (int,))
        elif isinstance(logprobs, bool):
            logprobs = 1 if logprobs else None
        max_tokens = _opt(body, "max_completion_tokens", (int,)) or _opt(body, "max_tokens", (int,), 16)
        return make_request(prompt, max_tokens=max_tokens,
                            temperature=float(_opt(body, "temperature", (int, float), 1.0)),
                            top_p=_opt(body, "top_p", (int, float)), top_k=_opt(body, "top_k", (int,)),
                            seed=_opt(body, "seed", (int,)), stop=stop, request_id=rid,
                            ignore_eos=bool(body.get("ignore_eos", False)),
                            logprobs=logprobs if isinstance(logprobs, int) else None)

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
            model = self._check_model(body)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if not isinstance(prompt, (str, list)) or (isinstance(prompt, list)
                                                       and not all(isinstance(t, int) for t in prompt)):
                raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list with one of those",
                               param="prompt")
            req = self._request(body, prompt, rid)
            return await self._run(request, body, req, rid, model, chat=False)
        except ApiError as e:
            return e.response(rid)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            body = await self._json(request)
            model = self._check_model(body)
            req = self._request(body, self._chat_ids(body), rid)
            return await self._run(request, body, req, rid, model, chat=True)
        except ApiError as e:
            return e.response(rid)

    def _chat_ids(self, body: dict, add_generation_prompt: bool = True) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        tok = self.core.model.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, f"model '{self.core.model.name}' has no chat template; use /v1/completions with a "
                           "plain prompt", param="messages", code="no_chat_template")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from e
        # The template writes any special tokens itself.
        return list(tok(text, add_special_tokens=False).input_ids)

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
            st = self.core.parse(req, None)
        except RequestFailed as e:
            raise ApiError.from_failed(e) from e
        created = int(time.time())
        gen = self.core.generate(st)
        ctx = {"id": rid, "created": created, "model": model, "chat": chat}
        try:
            if not body.get("stream"):
                return await self._collect(gen, ctx)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, gen, ctx, include_usage)
        except (ConnectionResetError, ClientConnectionResetError):
            log.info("client disconnected", extra={"request_id": rid})
            return web.Response(status=499)  # nobody reads it; aiohttp needs a return value
        finally:
            await gen.aclose()  # a client gone mid-request frees both workers now, not at GC

    async def _collect(self, gen, ctx: dict) -> web.Response:
        chat = ctx["chat"]
        text, finish, last, lps, offset = "", None, None, [], 0
        try:
            async for msg in gen:
                text += msg.text
                lp, offset = self._logprobs(msg, chat, offset)
                if lp:
                    lps.append(lp)
                if msg.finish_reason:
                    finish, last = msg.finish_reason, msg
        except RequestFailed as e:
            raise ApiError.from_failed(e) from e
        choice = {"index": 0, "finish_reason": finish, "logprobs": _merge(lps, chat)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
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
                raise ApiError.from_failed(e) from e
            err = ApiError.from_failed(e)
            await resp.write(f"data: {json.dumps({'error': {'message': err.message, 'type': err.etype}})}\n\n"
                             .encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


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
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error").response(rid)


def _merge(parts: list[dict], chat: bool) -> dict | None:
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
