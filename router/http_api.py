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
from router.openai_output import Reply, collect, event, merged, piece, usage_event
from router.openai_params import (
    ApiError,
    Limits,
    bad,
    best_of,
    boolean,
    check_fields,
    choices,
    generate_requests,
    prompts,
    scored_only,
    stream_options,
    text,
)
from router.request import RequestFailed

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
            many = prompts(body, self.core.model.vocab_size)
            n = choices(body, len(many))
            k = best_of(body, n, len(many))
            reqs = generate_requests(body, many, k, rid, self.limits, chat=False)
            reply = Reply(rid, int(time.time()), model, False, k, n, body.get("logprobs") is not None)
            if boolean(body, "echo"):
                decode = self.core.model.tokenizer.decode
                reply.echo = [p if isinstance(p, str) else await self.core.offload(decode, p) for p in many]
                reply.generated = not scored_only(body)
            return await self._run(request, body, reqs, reply)
        except ApiError as e:
            return error_response(e, rid)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            body = await self._json(request)
            check_fields(body, "chat")
            model = self._check_model(body)
            n = choices(body, 1)
            generate_requests(body, [[0]], 1, rid, self.limits, chat=True)  # check sampling fields before templating
            ids = await self.core.offload(self._chat_ids, body)
            reqs = generate_requests(body, [ids], n, rid, self.limits, chat=True)
            reply = Reply(rid, int(time.time()), model, True, n, logprobs=body.get("logprobs") is True)
            return await self._run(request, body, reqs, reply)
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

    async def _run(self, request: web.Request, body: dict, reqs: list[pb.GenerateRequest], reply: Reply,
                   ) -> web.StreamResponse:
        states = []
        for req in reqs:  # all checked before any starts
            try:
                states.append(await self.core.parse(req, None))
            except RequestFailed as e:
                raise api_error(e) from e
        gens = [self.core.generate(st) for st in states]
        tok = self.core.model.tokenizer
        try:
            if not body.get("stream"):
                try:
                    return await collect(tok, gens, reply)
                except RequestFailed as e:
                    raise api_error(e) from e
            return await self._stream(request, gens, reply, stream_options(body))
        except (ConnectionResetError, ClientConnectionResetError):
            log.info("client disconnected", extra={"request_id": reply.id})
            return web.Response(status=499)  # nobody reads it; aiohttp needs a return value
        finally:
            for gen in gens:  # a client gone mid-request frees the workers now, not at GC
                await gen.aclose()

    async def _stream(self, request: web.Request, gens: list, reply: Reply, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": reply.id})
        tok = self.core.model.tokenizer
        started: set[int] = set()
        offsets, last = [0] * len(gens), [None] * len(gens)
        events = merged(gens)
        try:
            async for i, msg in events:
                if not started:
                    await resp.prepare(request)
                said, lp, offsets[i] = piece(tok, reply, i, msg, offsets[i], i not in started)
                await resp.write(event(reply, i, msg, said, lp, i not in started, include_usage))
                started.add(i)
                if msg.finish_reason:
                    last[i] = msg
                    if include_usage and all(m is not None for m in last):
                        await resp.write(usage_event(reply, last))
        except RequestFailed as e:
            if not started:  # nothing sent yet: a proper HTTP error
                raise api_error(e) from e
            err = api_error(e)
            await resp.write(f"data: {json.dumps({'error': {'message': err.message, 'type': err.etype}})}\n\n"
                             .encode())
        finally:
            await events.aclose()  # stops the other generations when this one ends early
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

