"""The FastAPI app: OpenAI endpoints, health, stats and metrics over one Engine."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker.engine import Engine

from .errors import APIError, error_body, error_response, install_error_handlers
from .generation import ChoiceEvent, ChoiceSet, chat_prompt_ids, completion_prompts, sampling_params
from .metrics import Metrics
from .schemas import ChatCompletionRequest, CompletionRequest, new_id, now

log = logging.getLogger("eaglegate.api")
MAX_BODY_BYTES = 4 * 1024 * 1024
OPEN_PATHS = ("/health", "/metrics")


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    stall_timeout: float = 60.0


class GuardMiddleware:
    """API key, draining and body-size checks as plain ASGI (BaseHTTPMiddleware would hide disconnects)."""

    def __init__(self, app, settings: ServerSettings, state):
        self.app, self.settings, self.state = app, settings, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        rejection = None
        key = self.settings.api_key
        if key and not path.startswith(OPEN_PATHS):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                rejection = error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                           "authentication_error", code="invalid_api_key")
        if rejection is None and self.state.draining and path.startswith("/v1/") and scope["method"] == "POST":
            rejection = error_response(503, "server is shutting down", "service_unavailable_error")
        length = headers.get(b"content-length")
        if rejection is None and length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            rejection = error_response(413, f"request body larger than {MAX_BODY_BYTES} bytes",
                                       "invalid_request_error")
        if rejection is not None:
            return await rejection(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(supervisor, settings: ServerSettings, metrics: Metrics) -> FastAPI:
    """`supervisor.engine` is the engine now serving (a restart swaps it); `supervisor.status()` says why not."""
    app = FastAPI(title="eaglegate", version="0.1.0")
    app.state.supervisor, app.state.settings, app.state.metrics = supervisor, settings, metrics
    app.state.draining = False
    install_error_handlers(app)
    known_models = {settings.served_model_name, *settings.model_aliases}

    app.add_middleware(GuardMiddleware, settings=settings, state=app.state)

    def check_model(name: str) -> None:
        if name not in known_models:
            raise APIError(400, f"model {name!r} is not served here; available: {settings.served_model_name}",
                           param="model", code="model_not_found")

    def live_engine() -> Engine:
        problem = supervisor.status()
        if problem is not None:
            raise APIError(503, problem, "service_unavailable_error")
        return supervisor.engine

    @app.get("/health")
    async def health():
        problem = supervisor.status()
        if problem is not None:
            return error_response(503, problem, "service_unavailable_error")
        engine = supervisor.engine
        stalled = engine.stalled_for()
        if stalled > settings.stall_timeout:
            return error_response(503, f"no engine step completed for {stalled:.0f} s with "
                                       f"{engine.num_in_flight} requests in flight", "service_unavailable_error")
        return {"status": "ok"}

    @app.get("/engine/stats")
    async def stats():
        engine = supervisor.engine
        return engine.stats.values | {"alive": engine.is_alive, "dead_reason": engine.dead_reason,
                                      "restarts": supervisor.restarts, "last_failure": supervisor.last_failure}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        engine = supervisor.engine
        return {"object": "list", "data": [{"id": settings.served_model_name, "object": "model", "created": now(),
                                            "owned_by": "eaglegate", "max_model_len": engine.ready.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        engine = live_engine()
        prompt = chat_prompt_ids(engine, req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = [sampling_params(engine, req, len(prompt), max_tokens, k, i) for i in range(req.n)]
        rid = new_id("chatcmpl")
        choices = ChoiceSet(engine, metrics, rid, [prompt] * req.n, params, req.stop)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_chat_stream(engine, req, rid, choices, include_usage, len(prompt)))
        return await _collect(raw, choices, lambda evs: _chat_response(engine, req, rid, evs, len(prompt)))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        engine = live_engine()
        prompts = completion_prompts(engine, req)
        expanded = [p for p in prompts for _ in range(req.n)]
        params = [sampling_params(engine, req, len(p), req.max_tokens, req.logprobs, i % req.n)
                  for i, p in enumerate(expanded)]
        rid = new_id("cmpl")
        choices = ChoiceSet(engine, metrics, rid, expanded, params, req.stop)
        prompt_tokens = sum(len(p) for p in prompts)
        echo = [engine.tokenizer.decode(p) if req.echo else "" for p in expanded]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_completion_stream(engine, req, rid, choices, include_usage, prompt_tokens, echo))
        return await _collect(raw, choices, lambda evs: _completion_response(engine, req, rid, evs, prompt_tokens,
                                                                              echo))

    return app


# --- non-streaming --------------------------------------------------------------------------------------
async def _collect(raw: Request, choices: ChoiceSet, build) -> JSONResponse:
    """Gather every choice; a client that hangs up has its requests aborted on every rank."""
    events: dict[int, list[ChoiceEvent]] = {}

    async def gather() -> None:
        async for ev in choices.events():
            events.setdefault(ev.index, []).append(ev)

    task = asyncio.create_task(gather())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await raw.is_disconnected():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
    task.result()
    return JSONResponse(build(events))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_str(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def _chat_logprobs(engine: Engine, entries) -> dict | None:
    if entries is None:
        return None

    def item(tid: int, lp: float) -> dict:
        tok = _token_str(engine, tid)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in entries]}


def _completion_logprobs(engine: Engine, entries, offset: int) -> dict | None:
    if entries is None:
        return None
    tokens = [_token_str(engine, e.token_id) for e in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token_str(engine, t): v for t, v in e.top} for e in entries], "text_offset": offsets}


def _merge(evs: list[ChoiceEvent]) -> tuple[str, list | None, str, int]:
    text = "".join(e.text for e in evs)
    lps = [x for e in evs for x in (e.logprobs or [])] if any(e.logprobs is not None for e in evs) else None
    return text, lps, evs[-1].finish_reason or "stop", evs[-1].completion_tokens


def _chat_response(engine, req, rid, events, prompt_tokens) -> dict:
    choices, completion = [], 0
    for i in sorted(events):
        text, lps, finish, n = _merge(events[i])
        completion += n
        choices.append({"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": _chat_logprobs(engine, lps if req.logprobs else None), "finish_reason": finish})
    return {"id": rid, "object": "chat.completion", "created": now(), "model": req.model, "choices": choices,
            "usage": _usage(prompt_tokens, completion)}


def _completion_response(engine, req, rid, events, prompt_tokens, echo) -> dict:
    choices, completion = [], 0
    for i in sorted(events):
        text, lps, finish, n = _merge(events[i])
        completion += n
        choices.append({"index": i, "text": echo[i] + text, "finish_reason": finish,
                        "logprobs": _completion_logprobs(engine, lps if req.logprobs is not None else None,
                                                         len(echo[i]))})
    return {"id": rid, "object": "text_completion", "created": now(), "model": req.model, "choices": choices,
            "usage": _usage(prompt_tokens, completion)}


# --- streaming ------------------------------------------------------------------------------------------
def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"
        except Exception as e:  # noqa: BLE001 - the stream must end with an error, never silently
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(f'internal error: {type(e).__name__}', 'internal_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _chat_stream(engine, req, rid, choices: ChoiceSet, include_usage: bool, prompt_tokens: int):
    created = now()

    def chunk(choice_list, usage=None) -> dict:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
             "choices": choice_list}
        if include_usage:
            c["usage"] = usage
        return c

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(req.n)])
    completion = {}
    async for ev in choices.events():
        completion[ev.index] = ev.completion_tokens
        if ev.text or ev.finish_reason or (req.logprobs and ev.logprobs):
            delta = {"content": ev.text} if ev.text else {}
            lps = _chat_logprobs(engine, ev.logprobs) if req.logprobs else None
            yield chunk([{"index": ev.index, "delta": delta, "logprobs": lps, "finish_reason": ev.finish_reason}])
    if include_usage:
        yield chunk([], _usage(prompt_tokens, sum(completion.values())))


async def _completion_stream(engine, req, rid, choices: ChoiceSet, include_usage: bool, prompt_tokens: int,
                             echo: list[str]):
    created = now()
    completion, offsets, started = {}, {}, set()

    def chunk(choice_list, usage=None) -> dict:
        c = {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": choice_list}
        if include_usage:
            c["usage"] = usage
        return c

    async for ev in choices.events():
        completion[ev.index] = ev.completion_tokens
        text = ev.text
        if ev.index not in started:
            started.add(ev.index)
            text = echo[ev.index] + text
        if text or ev.finish_reason:
            off = offsets.get(ev.index, 0)
            lps = _completion_logprobs(engine, ev.logprobs, off) if req.logprobs is not None else None
            offsets[ev.index] = off + len(text)
            yield chunk([{"index": ev.index, "text": text, "logprobs": lps, "finish_reason": ev.finish_reason}])
    if include_usage:
        yield chunk([], _usage(prompt_tokens, sum(completion.values())))
