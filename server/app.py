"""The FastAPI app: OpenAI endpoints, health, stats and metrics over one Engine."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from runtime.engine import Engine
from worker.sampling.params import SamplingParams

from .chat_output import chat_deltas, chat_message, finish_reason, parse_whole, reasoning_tokens
from .errors import APIError, error_body, error_response, install_error_handlers
from .generation import (
    ChatSetup,
    ChoiceEvent,
    ChoiceSet,
    chat_setup,
    completion_prompts,
    request_grammar,
    sampling_params,
)
from .load_report import LoadReport
from .metrics import Metrics
from .parsers.registry import Parsers
from .responses import ResponseBuilder, ResponsesRequest, to_chat
from .responses_stream import responses_stream
from .schemas import ChatCompletionRequest, CompletionRequest, new_id, now
from .tracing import Tracing

log = logging.getLogger("eaglegate.api")
MAX_BODY_BYTES = 4 * 1024 * 1024
OPEN_PATHS = frozenset({"/health", "/health/ready", "/metrics"})  # exact paths served without the key
READY_PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    stall_timeout: float = 60.0
    parsers: Parsers = Parsers()  # --reasoning-parser, --tool-call-parser
    max_new_tokens_default: int | None = None  # max_tokens where a request leaves it out (None: the context's rest)
    request_timeout: float | None = None  # seconds at rank 0 after which a request finishes with "timeout"
    otlp_traces_endpoint: str | None = None  # an OTLP/HTTP collector for one span per request (server/tracing.py)


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
        if key and path not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                rejection = error_response(
                    401,
                    "invalid or missing API key (Authorization: Bearer ...)",
                    "authentication_error",
                    code="invalid_api_key",
                )
        if rejection is None and self.state.draining and path.startswith("/v1/") and scope["method"] == "POST":
            rejection = error_response(
                503, "server is shutting down", "service_unavailable_error", headers={"Retry-After": "5"}
            )
            self.state.metrics.labels(self.state.metrics.rejected, status="503").inc()
        length = headers.get(b"content-length")
        too_large = error_response(413, f"request body larger than {MAX_BODY_BYTES} bytes", "invalid_request_error")
        if rejection is None and length is not None and not length.isdigit():
            rejection = error_response(400, "malformed Content-Length header", "invalid_request_error")
        if rejection is None and length is not None and int(length) > MAX_BODY_BYTES:
            rejection = too_large
        if rejection is None and scope["method"] in ("POST", "PUT", "PATCH"):
            # the bytes that arrive count, declared or not (a chunked body has no Content-Length)
            received, over = await _read_body(receive, MAX_BODY_BYTES)
            if received[-1]["type"] == "http.disconnect":
                return  # the client left before its body arrived: nothing to answer
            if over:
                rejection = too_large
            receive = _replay(received, receive)
            del received  # the replay holds the chunks only until the app has read them
        if rejection is not None:
            return await rejection(scope, receive, send)
        return await self.app(scope, receive, send)


async def _read_body(receive, limit: int) -> tuple[list[dict], bool]:
    """A request's body messages up to `limit` bytes, and whether it went past the limit (reading stops there)."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":  # the client left
            return messages, False
        size += len(message.get("body", b""))
        if size > limit:
            return messages, True
        if not message.get("more_body", False):
            return messages, False


def _replay(messages: list[dict], receive):
    """A receive() that gives the buffered messages first, then the client's own (a later disconnect included)."""
    pending = messages

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


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
            raise APIError(
                400,
                f"model {name!r} is not served here; available: {settings.served_model_name}",
                param="model",
                code="model_not_found",
            )

    def live_engine(generating: bool = True) -> Engine:
        problem = supervisor.status()
        if problem is not None:
            if generating:  # a generation refused while the group is down (not a gateway's /v1/loads poll)
                metrics.labels(metrics.rejected, status="503").inc()
            raise APIError(503, problem, "service_unavailable_error")
        return supervisor.engine

    @app.get("/health")
    async def health():
        """Liveness, open to anyone: why it is red in a word, the details on /engine/stats (behind the key)."""
        if app.state.draining:
            return error_response(503, "draining: the server is shutting down", "service_unavailable_error")
        if supervisor.status() is not None:
            state = "restarting the worker group" if supervisor.restarting else "down"
            return error_response(503, f"engine {state}: see /engine/stats", "service_unavailable_error")
        engine = supervisor.engine
        stalled = engine.stalled_for()
        if stalled > settings.stall_timeout:
            return error_response(
                503,
                f"no engine step completed for {stalled:.0f} s with {engine.num_in_flight} requests in flight",
                "service_unavailable_error",
            )
        return {"status": "ok"}

    app.state.probed = None  # the engine that generated a token for /health/ready
    probe_lock = asyncio.Lock()

    @app.get("/health/ready")
    async def ready():
        """Readiness: the engine serving now has generated a token (once per worker group, then remembered), and the
        server is not draining; a load balancer or Kubernetes sends traffic only while this is 200."""
        if app.state.draining:
            return error_response(503, "draining: the server is shutting down", "service_unavailable_error")
        if supervisor.status() is not None:
            return error_response(503, "engine not ready: see /health", "service_unavailable_error")
        engine = supervisor.engine
        async with probe_lock:
            if app.state.probed is not engine:
                try:
                    await asyncio.wait_for(_generate_one_token(engine), READY_PROBE_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - any failure means not ready; /health says why
                    return error_response(
                        503, "engine not ready: a one-token generation failed", "service_unavailable_error"
                    )
                app.state.probed = engine
        return {"status": "ready"}

    @app.get("/engine/stats")
    async def stats():
        engine = supervisor.engine
        return engine.stats.values | {
            "alive": engine.is_alive,
            "dead_reason": engine.dead_reason,
            "restarts": supervisor.restarts,
            "last_failure": supervisor.last_failure,
        }

    load_report = LoadReport(supervisor.config, metrics)
    tracing = Tracing(settings.otlp_traces_endpoint) if settings.otlp_traces_endpoint else None
    app.state.tracing = tracing

    def span(operation: str, model: str, request_id: str, raw: Request):
        return tracing.start(operation, model, request_id, raw.headers) if tracing is not None else None

    @app.get("/v1/loads")
    async def loads():
        """SGLang's load report, which a load-aware gateway polls (server/load_report.py)."""
        return load_report.loads(live_engine(generating=False))

    @app.get("/server_info")
    async def server_info():
        return load_report.server_info(live_engine(generating=False), settings.served_model_name)

    @app.get("/debug/ranks")
    async def debug_ranks():
        """This node's ranks side by side (worker/forensics.py), and those of the last group that failed."""
        engine = supervisor.engine

        def side_by_side(beats: list[dict | None] | None) -> list[dict] | None:
            return None if beats is None else [{"rank": r} | (b or {"missing": True}) for r, b in enumerate(beats)]

        return {
            "alive": engine.is_alive,
            "ranks": side_by_side(engine.rank_heartbeats()),
            "last_failure": supervisor.last_failure,
            "failed_group": side_by_side(supervisor.failed_ranks),
        }

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": now(),
            "owned_by": "eaglegate",
            "max_model_len": supervisor.engine.ready.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(settings.served_model_name)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in known_models:
            raise APIError(
                404,
                f"model {model!r} is not served here; available: {settings.served_model_name}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        return model_card(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        engine = live_engine()
        setup = await asyncio.to_thread(chat_setup, engine, req, settings.parsers)  # templating, tokens, grammar
        prompt = setup.prompt
        max_tokens = req.max_completion_tokens or req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = [
            sampling_params(engine, req, len(prompt), max_tokens, k, i, setup.grammar, settings) for i in range(req.n)
        ]
        rid = new_id("chatcmpl")
        traced = span("chat", req.model, rid, raw)
        choices = ChoiceSet(engine, metrics, rid, [prompt] * req.n, params, req.stop, setup.keep, traced)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_chat_stream(engine, req, rid, choices, include_usage, setup), choices)
        return await _collect(
            raw,
            choices,
            lambda evs: _with_spec(
                req, choices, _chat_response(engine, req, rid, evs, setup, choices.cached_tokens(req.n))
            ),
        )

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        check_model(req.model)
        chat = to_chat(req)
        engine = live_engine()
        setup = await asyncio.to_thread(chat_setup, engine, chat, settings.parsers)
        prompt = setup.prompt
        params = [
            sampling_params(engine, chat, len(prompt), chat.max_completion_tokens, None, 0, setup.grammar, settings)
        ]
        build = ResponseBuilder(req)
        choices = ChoiceSet(
            engine, metrics, build.id, [prompt], params, [], setup.keep, span("chat", req.model, build.id, raw)
        )
        count = functools.partial(reasoning_tokens, engine.tokenizer)
        if req.stream:
            return _sse(responses_stream(build, choices, len(prompt), setup.make_parser(), count), choices, events=True)

        def body(events):
            text, _, finish, n = _merge(events[0])
            d = parse_whole(text, setup.make_parser())
            usage = (len(prompt), n, count(d.reasoning))
            return build.response("completed", build.items(d), finish, usage, choices.cached_tokens(1))

        return await _collect(raw, choices, body)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        engine = live_engine()
        prompts, grammar = await asyncio.to_thread(lambda: (completion_prompts(engine, req), request_grammar(req)))
        expanded = [p for p in prompts for _ in range(req.n)]
        params = [
            sampling_params(engine, req, len(p), req.max_tokens, req.logprobs, i % req.n, grammar, settings)
            for i, p in enumerate(expanded)
        ]
        rid = new_id("cmpl")
        choices = ChoiceSet(
            engine, metrics, rid, expanded, params, req.stop, span=span("text_completion", req.model, rid, raw)
        )
        prompt_tokens = sum(len(p) for p in prompts)
        echo = [engine.tokenizer.decode(p) if req.echo else "" for p in expanded]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_completion_stream(engine, req, rid, choices, include_usage, prompt_tokens, echo), choices)
        return await _collect(
            raw,
            choices,
            lambda evs: _with_spec(
                req,
                choices,
                _completion_response(engine, req, rid, evs, prompt_tokens, echo, choices.cached_tokens(req.n)),
            ),
        )

    return app


# --- non-streaming --------------------------------------------------------------------------------------
async def _generate_one_token(engine: Engine) -> None:
    """A real generation through every rank: one prompt token, one new token."""
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    async for out in engine.stream([0], params, request_id=f"ready-{uuid.uuid4().hex[:12]}"):
        if out.error:
            raise RuntimeError(out.error)


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


def _with_spec(req, choices: ChoiceSet, body: dict) -> dict:
    """`return_spec_metrics`: the request's speculation figures beside usage (null when it did not speculate)."""
    if req.return_spec_metrics:
        body["spec_metrics"] = choices.spec_metrics()
    return body


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning: int | None = None) -> dict:
    """`reasoning`: reasoning tokens, where a reasoning parser is set."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _token_str(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def _chat_logprobs(engine: Engine, entries) -> dict | None:
    if entries is None:
        return None

    def item(tid: int, lp: float) -> dict:
        tok = _token_str(engine, tid)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

    return {
        "content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, v) for t, v in e.top]} for e in entries]
    }


def _completion_logprobs(engine: Engine, entries, offset: int) -> dict | None:
    if entries is None:
        return None
    tokens = [_token_str(engine, e.token_id) for e in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_str(engine, t): v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def _merge(evs: list[ChoiceEvent]) -> tuple[str, list | None, str, int]:
    text = "".join(e.text for e in evs)
    lps = [x for e in evs for x in (e.logprobs or [])] if any(e.logprobs is not None for e in evs) else None
    return text, lps, evs[-1].finish_reason or "stop", evs[-1].completion_tokens


def _chat_response(engine, req, rid, events, setup: ChatSetup, cached) -> dict:
    choices, completion, reasoning = [], 0, 0
    for i in sorted(events):
        text, lps, finish, n = _merge(events[i])
        completion += n
        d = parse_whole(text, setup.make_parser())
        reasoning += reasoning_tokens(engine.tokenizer, d.reasoning)
        choices.append(
            {
                "index": i,
                "message": chat_message(d, setup.reasoning),
                "logprobs": _chat_logprobs(engine, lps if req.logprobs else None),
                "finish_reason": finish_reason(finish, bool(d.calls)),
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": req.model,
        "choices": choices,
        "usage": _usage(len(setup.prompt), completion, cached, reasoning if setup.reasoning else None),
    }


def _completion_response(engine, req, rid, events, prompt_tokens, echo, cached) -> dict:
    choices, completion = [], 0
    for i in sorted(events):
        text, lps, finish, n = _merge(events[i])
        completion += n
        choices.append(
            {
                "index": i,
                "text": echo[i] + text,
                "finish_reason": finish,
                "logprobs": _completion_logprobs(engine, lps if req.logprobs is not None else None, len(echo[i])),
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": req.model,
        "choices": choices,
        "usage": _usage(prompt_tokens, completion, cached),
    }


# --- streaming ------------------------------------------------------------------------------------------
def _sse(chunks: AsyncIterator[dict], choices: ChoiceSet, events: bool = False) -> StreamingResponse:
    """Chat and completions end with `[DONE]`; the Responses API names each event and has no `[DONE]`."""

    def line(chunk: dict) -> str:
        head = f"event: {chunk['type']}\n" if events else ""
        return f"{head}data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def failure(body: dict) -> str:
        return line({"type": "error", **body["error"]}) if events else line(body)

    async def body():
        try:
            async for chunk in chunks:
                yield line(chunk)
        except APIError as e:
            yield failure(error_body(e.message, e.type, e.param, e.code))
        except Exception as e:  # noqa: BLE001 - the stream must end with an error, never silently
            log.exception("stream failed")
            yield failure(error_body(f"internal error: {type(e).__name__}", "internal_error"))
        finally:
            choices.end_span()  # a client that left early still ends the trace
        if not events:
            yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def _chat_stream(engine, req, rid, choices: ChoiceSet, include_usage: bool, setup: ChatSetup):
    """Content streams as it comes. With a parser, each choice's output goes through it: reasoning and content stream
    as they become final, and each call is sent as OpenAI's tool_calls deltas once it is whole."""
    created = now()

    def chunk(choice_list, usage=None) -> dict:
        c = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": choice_list,
        }
        if include_usage:
            c["usage"] = usage
        return c

    def delta(index: int, d: dict, finish=None, lps=None) -> dict:
        return chunk([{"index": index, "delta": d, "logprobs": lps, "finish_reason": finish}])

    yield chunk(
        [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(req.n)
        ]
    )
    completion: dict[int, int] = {}
    parsers = {i: setup.make_parser() for i in range(req.n)}
    calls = dict.fromkeys(range(req.n), 0)
    reasoning = dict.fromkeys(range(req.n), "")
    async for ev in choices.events():
        i = ev.index
        completion[i] = ev.completion_tokens
        lps = _chat_logprobs(engine, ev.logprobs) if req.logprobs and ev.logprobs else None
        if parsers[i] is None:
            if ev.text or ev.finish_reason or lps:
                yield delta(i, {"content": ev.text} if ev.text else {}, ev.finish_reason, lps)
            continue
        d = parsers[i].feed(ev.text)
        if ev.finish_reason is not None:
            d += parsers[i].finish()
        reasoning[i] += d.reasoning
        pieces = chat_deltas(d, calls[i])
        calls[i] += len(d.calls)
        if lps and not pieces:
            pieces = [{}]
        for k, piece in enumerate(pieces):
            yield delta(i, piece, None, lps if k == 0 else None)
        if ev.finish_reason is not None:
            yield delta(i, {}, finish_reason(ev.finish_reason, calls[i] > 0))
    if include_usage:
        count = sum(reasoning_tokens(engine.tokenizer, r) for r in reasoning.values()) if setup.reasoning else None
        yield chunk([], _usage(len(setup.prompt), sum(completion.values()), choices.cached_tokens(req.n), count))
    if req.return_spec_metrics:  # a last chunk with no choices, as the usage chunk is
        yield _with_spec(req, choices, chunk([]))


async def _completion_stream(
    engine, req, rid, choices: ChoiceSet, include_usage: bool, prompt_tokens: int, echo: list[str]
):
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
        yield chunk([], _usage(prompt_tokens, sum(completion.values()), choices.cached_tokens(req.n)))
    if req.return_spec_metrics:
        yield _with_spec(req, choices, chunk([]))
