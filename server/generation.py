"""From an OpenAI request to engine requests and back: prompt building, parameters, choice streams."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from runtime.engine import AsyncRequest, Engine, EngineBusyError, EngineDeadError, EngineInboxFullError
from worker.protocol import ERROR_CONTEXT_LENGTH, ERROR_INVALID_GRAMMAR, RequestOutput
from worker.sampling.grammar import check_grammar
from worker.sampling.params import (
    GrammarSpec,
    InvalidGrammarError,
    InvalidParameterError,
    SamplingParams,
    TokenLogprobs,
)
from worker.stats import SpecCounts

from .detokenizer import IncrementalDetokenizer, kept_token_ids
from .errors import APIError
from .metrics import Metrics
from .parsers.base import BlockCalls
from .parsers.registry import OutputParser, Parsers
from .schemas import ChatCompletionRequest, CompletionRequest
from .tools import call_grammar, render_messages, template_knows_tools, tool_mode, tool_schemas
from .tracing import finish_span


@dataclass
class ChoiceEvent:
    """A piece of one choice's output: new text (and its tokens' logprobs), and the finish reason at the end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class ChoiceState:
    index: int
    handle: AsyncRequest
    detok: IncrementalDetokenizer
    prompt_tokens: int
    arrival: float
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens rank 0 found in its prefix cache
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    spec: SpecCounts | None = None  # rank 0's speculation figures for this choice, on its last report
    queue_seconds: float | None = None  # arrival at rank 0 to first scheduling
    sync_seconds: float = 0.0  # its steps' waits on rank 0's decision broadcasts, on its last report


def chat_prompt(
    engine: Engine, req: ChatCompletionRequest, tool_mode: str = "none", fmt: type[BlockCalls] | None = None
) -> tuple[list[int], str]:
    """The prompt's token ids and text (whose end says whether the template opened a reasoning block)."""
    messages, tools = render_messages(req, tool_mode, template_knows_tools(engine.tokenizer), fmt)
    try:
        text = engine.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template may reject a role order; that is the client's request
        raise APIError(400, f"messages cannot be rendered by the model's chat template: {e}", param="messages") from e
    return engine.tokenizer.encode(text, add_special_tokens=False), text


@dataclass
class ChatSetup:
    """A chat request made ready for the engine, with how its output is read back."""

    prompt: list[int]
    grammar: GrammarSpec | None
    make_parser: Callable[[], OutputParser | None]  # one per choice; None: the output is all content
    keep: frozenset[int]  # special tokens the detokenizer keeps (the parsers' tags)
    reasoning: bool  # a reasoning parser is set: responses carry reasoning fields


def chat_setup(engine: Engine, req: ChatCompletionRequest, parsers: Parsers) -> ChatSetup:
    mode = tool_mode(req)
    fmt = parsers.format
    prompt, text = chat_prompt(engine, req, mode, fmt)
    opens = parsers.opens_reasoning(text)
    calls = call_grammar(req, mode, fmt, opens)
    grammar = request_grammar(req, calls)
    if grammar is not None and (grammar is not calls or fmt is None):
        opens = False  # a grammar without a reasoning block holds the output from its first token
    schemas = tool_schemas(req)
    keep = kept_token_ids(engine.tokenizer, parsers.markers())
    return ChatSetup(prompt, grammar, lambda: parsers.for_request(mode, schemas, opens), keep, bool(parsers.reasoning))


def completion_prompts(engine: Engine, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [engine.tokenizer.encode(p, add_special_tokens=False)]
    if p and all(isinstance(x, int) for x in p):
        vocab = engine.model_cfg.vocab_size
        if any(not 0 <= x < vocab for x in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return [list(p)]
    if p and all(isinstance(x, str) for x in p):
        if len(p) > 16:
            raise APIError(400, "at most 16 prompts per request", param="prompt")
        return [engine.tokenizer.encode(x, add_special_tokens=False) for x in p]
    raise APIError(400, "prompt must be a non-empty string, list of strings or list of token ids", param="prompt")


def request_grammar(req, tool_grammar: GrammarSpec | None = None) -> GrammarSpec | None:
    """The one grammar a request asks for (response_format, SGLang's regex / ebnf, or a forced tool call)."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(GrammarSpec("json_object", param="response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema object", param="response_format")
        found.append(
            GrammarSpec(
                "json_schema",
                json.dumps(rf.json_schema.schema_ or {"type": "object"}),
                param="response_format.json_schema.schema",
            )
        )
    if req.regex is not None:
        found.append(GrammarSpec("regex", req.regex, param="regex"))
    if req.ebnf is not None:
        found.append(GrammarSpec("ebnf", req.ebnf, param="ebnf"))
    if tool_grammar is not None:
        found.append(tool_grammar)
    if len(found) > 1:
        raise APIError(
            400, "use one of response_format, regex, ebnf and a forced tool_choice, not several", param=found[1].param
        )
    if not found:
        return None
    try:
        check_grammar(found[0])
    except InvalidGrammarError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_grammar") from e
    return found[0]


def _logit_bias(req) -> tuple[tuple[int, float], ...]:
    try:
        return tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
    except ValueError as e:
        raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from e


def sampling_params(
    engine: Engine,
    req,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    choice: int,
    grammar: GrammarSpec | None = None,
    settings=None,
) -> SamplingParams:
    """The request's sampling fields, with the server's default cap on new tokens and its request timeout
    (`settings`: the app's ServerSettings)."""
    limit = engine.ready.max_model_len
    if prompt_len == 0:
        raise APIError(
            400, "the prompt is empty", param="messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        )
    if prompt_len >= limit:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(limit - prompt_len, getattr(settings, "max_new_tokens_default", None) or limit)
    elif prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
            f"context of {limit} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    seed = None if req.seed is None else req.seed + choice
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=seed,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        logit_bias=_logit_bias(req),
        grammar=grammar,
        timeout_s=getattr(settings, "request_timeout", None),
    )
    try:
        return params.validate(engine.model_cfg.vocab_size)
    except InvalidParameterError as e:
        raise APIError(400, str(e), param=e.param) from e


RETRY_AFTER = {"Retry-After": "1"}  # seconds: a queue drains at decode speed


class ChoiceSet:
    """The n choices of one request (times its prompts), submitted to rank 0 as one batch."""

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        stop: list[str],
        keep: frozenset[int] = frozenset(),
        span=None,
    ):
        """`keep`: special tokens the detokenizer keeps in the text (an output parser's tags); `span`: the request's
        trace span (server/tracing.py), ended with the request's figures when its events end."""
        self.engine, self.metrics, self.span = engine, metrics, span
        reqs = [(f"{request_id}-{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
        try:
            handles = self._submit(reqs)
        except BaseException as e:
            if span is not None:
                span.record_exception(e)
                span.end()
            raise
        now = time.monotonic()
        self.choices = [
            ChoiceState(i, h, IncrementalDetokenizer(engine.tokenizer, stop, keep), len(ids), now)
            for i, (h, ids) in enumerate(zip(handles, prompts))
        ]

    def _submit(self, reqs) -> list[AsyncRequest]:
        try:
            return self.engine.add_async(reqs)
        except EngineDeadError as e:
            raise self._refused(APIError(503, f"engine unavailable: {e}", "service_unavailable_error")) from e
        except EngineBusyError as e:
            err = APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded", headers=RETRY_AFTER)
            raise self._refused(err) from e
        except EngineInboxFullError as e:
            raise self._refused(APIError(503, str(e), "service_unavailable_error", headers=RETRY_AFTER)) from e
        except InvalidParameterError as e:
            raise APIError(400, str(e), param=e.param) from e

    def _refused(self, err: APIError) -> APIError:
        """A refusal for load, not for the request's content: counted in requests_rejected by status."""
        self.metrics.labels(self.metrics.rejected, status=str(err.status)).inc()
        return err

    def cached_tokens(self, n: int) -> int:
        """Cached prompt tokens, counting each prompt once (its n choices share it)."""
        return sum(c.cached_tokens for c in self.choices[::n])

    def spec_metrics(self) -> dict | None:
        """The request's speculation figures, its choices summed (`return_spec_metrics`); None without any."""
        counts = [c.spec for c in self.choices if c.spec is not None]
        if not counts:
            return None
        total = SpecCounts()
        for c in counts:
            total.add(c)
        sources = {
            src: {"drafted": getattr(total, f"{src}_tokens"), "accepted": getattr(total, f"{src}_accepted_tokens")}
            for src in ("eagle", "context", "corpus")
        }
        return {
            "verify_steps": total.verify_steps,
            "drafted_steps": total.drafted_steps,
            "draft_tokens": total.draft_tokens,
            "accepted_tokens": total.accepted_tokens,
            "accept_length": round(total.accept_length_mean, 4),
            "by_source": sources,
        }

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Merged events of all choices, in arrival order. Leaving early cancels (aborts) the rest."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: ChoiceState) -> None:
            try:
                while True:
                    ev = self._advance(c, await c.handle.next())
                    await queue.put(ev)
                    if ev.finish_reason is not None:
                        return
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put(e)

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        pending = len(tasks)
        try:
            while pending:
                item = await queue.get()
                if isinstance(item, BaseException):
                    if isinstance(item, EngineDeadError):
                        raise APIError(503, f"engine failed: {item}", "service_unavailable_error") from item
                    raise item
                if item.finish_reason is not None:
                    pending -= 1
                yield item
        except BaseException as e:
            self.end_span(e)
            raise
        finally:
            for t in tasks:
                t.cancel()
            for c in self.choices:
                c.handle.cancel()
            self.end_span()

    def end_span(self, error: BaseException | None = None) -> None:
        """End the request's trace span with its figures, once (also when a stream closes before its events)."""
        if self.span is not None:
            finish_span(self.span, self.choices, error)
            self.span = None

    def _advance(self, c: ChoiceState, out: RequestOutput) -> ChoiceEvent:
        if out.error:
            bad_input = out.error_code in (ERROR_CONTEXT_LENGTH, ERROR_INVALID_GRAMMAR)
            raise APIError(
                400 if bad_input else 500,
                out.error,
                "invalid_request_error" if bad_input else "internal_error",
                code=out.error_code,
            )
        now = time.monotonic()
        m, lbl = self.metrics, self.metrics.labels
        if out.token_ids:
            if c.first_token_at is None:
                c.first_token_at = now
                lbl(m.ttft).observe(now - c.arrival)
            elif c.last_token_at is not None:
                lbl(m.itl).observe((now - c.last_token_at) / len(out.token_ids))
            c.last_token_at = now
        if out.queue_seconds is not None:
            lbl(m.queue_time).observe(out.queue_seconds)
            c.queue_seconds = out.queue_seconds
        if out.sync_seconds is not None:
            c.sync_seconds = out.sync_seconds
        c.completion_tokens = out.num_output_tokens
        c.cached_tokens = max(c.cached_tokens, out.cached_tokens)
        if out.spec is not None and out.spec.verify_steps:
            c.spec = out.spec
            lbl(m.request_accept_length).observe(out.spec.accept_length_mean)
        text = c.detok.add(out.token_ids)
        finish = out.finish_reason
        if c.detok.stopped and finish is None:
            finish = "stop"  # a stop string: rank 0 is told to abort the rest
            c.handle.cancel()
        if finish is not None:
            text += c.detok.finish()
            lbl(m.e2e).observe(now - c.arrival)
            lbl(m.requests, finished_reason=finish).inc()
            lbl(m.prompt_tokens).inc(c.prompt_tokens)
            lbl(m.generation_tokens).inc(c.completion_tokens)
        return ChoiceEvent(c.index, text, out.token_ids, out.logprobs, finish, c.prompt_tokens, c.completion_tokens)
