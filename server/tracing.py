"""OpenTelemetry traces, off unless `--otlp-traces-endpoint` names an OTLP/HTTP collector: one SERVER span per
request, continuing the W3C trace context (`traceparent`) of the caller, so a gateway's trace goes on through us.

Attributes, set when the request ends: the GenAI conventions' `gen_ai.*` (operation, model, token counts) and
eaglegate's own: `eaglegate.queue_seconds` (arrival at rank 0 to first scheduling), `eaglegate.prefill_seconds`
(arrival to the first token, less the queue), `eaglegate.decode_seconds` (first token to the last),
`eaglegate.decision_sync_seconds` (what its steps waited on rank 0's broadcasts), `eaglegate.spec.verify_steps`,
`eaglegate.spec.draft_tokens`, `eaglegate.spec.accepted_tokens`, `eaglegate.spec.accept_length`. The spans are
exported in batches off the request path (the SDK's BatchSpanProcessor; OTEL_BSP_* tune it)."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


class Tracing:
    def __init__(self, endpoint: str, exporter: SpanExporter | None = None):
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "eaglegate"}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("eaglegate")

    def start(self, operation: str, model: str, request_id: str, headers: Mapping[str, str]) -> trace.Span:
        parent = propagate.extract(dict(headers))  # W3C traceparent/tracestate, if the caller sent them
        span = self.tracer.start_span(f"{operation} {model}", context=parent, kind=trace.SpanKind.SERVER)
        span.set_attributes(
            {"gen_ai.operation.name": operation, "gen_ai.request.model": model, "eaglegate.request_id": request_id}
        )
        return span

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what is queued


def finish_span(span: trace.Span, choices, error: BaseException | None = None) -> None:
    """The request's figures from its choices (server/generation.py: ChoiceState), then end the span."""
    first = [c.first_token_at for c in choices if c.first_token_at is not None]
    last = [c.last_token_at for c in choices if c.last_token_at is not None]
    arrival = min(c.arrival for c in choices)
    queue = max((c.queue_seconds or 0.0) for c in choices)
    attrs = {
        "gen_ai.usage.input_tokens": sum(c.prompt_tokens for c in choices),
        "gen_ai.usage.output_tokens": sum(c.completion_tokens for c in choices),
        "eaglegate.queue_seconds": queue,
        "eaglegate.decision_sync_seconds": sum(c.sync_seconds for c in choices),
    }
    if first:
        attrs["eaglegate.prefill_seconds"] = max(0.0, min(first) - arrival - queue)
        attrs["eaglegate.decode_seconds"] = max(last) - min(first) if last else 0.0
    specs = [c.spec for c in choices if c.spec is not None]
    if specs:
        steps, drafted, accepted = (
            sum(getattr(s, f) for s in specs) for f in ("verify_steps", "draft_tokens", "accepted_tokens")
        )
        attrs |= {
            "eaglegate.spec.verify_steps": steps,
            "eaglegate.spec.draft_tokens": drafted,
            "eaglegate.spec.accepted_tokens": accepted,
            "eaglegate.spec.accept_length": (steps + accepted) / steps if steps else 0.0,
        }
    span.set_attributes(attrs)
    if error is not None:
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
    span.end()
