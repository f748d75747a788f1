"""OpenTelemetry traces over OTLP/HTTP to a receiver in the test (protobuf, as a collector gets them): one span per
request with the documented attributes, and a caller's W3C `traceparent` continued."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from devtools.models import eagle_flags, save_copy_eagle_head
from devtools.server import ServerProcess
from worker.dist import free_port
from worker.model.config import load_model_config
from worker.model.files import resolve_model

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def collector():
    spans: list = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            spans.extend(s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1/traces", spans
    server.shutdown()


@pytest.fixture(scope="module")
def traced_server(tiny_llama, collector, tmp_path_factory):
    head = save_copy_eagle_head(
        tmp_path_factory.mktemp("trace-head"), load_model_config(resolve_model(str(tiny_llama)))
    )
    args = ["--model-path", str(tiny_llama), "--tp-size", "2", "--dtype", "float32", "--max-total-tokens", "2048"]
    env = os.environ | {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s, not 5 s
    server = ServerProcess([*args, *eagle_flags(head), "--otlp-traces-endpoint", collector[0]], env=env)
    yield server
    server.stop()


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.string_value or v.int_value or v.double_value
    return out


def _spans_of(spans, request_id: str, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [s for s in spans if _attrs(s).get("eaglegate.request_id") == request_id]
        if found:
            return found
        time.sleep(0.1)  # the batch processor exports every 0.1 s here
    return []


def test_a_request_is_one_span_with_the_documented_attributes(traced_server, collector, tiny_llama):
    _, spans = collector
    body = {"model": str(tiny_llama), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12}
    r = httpx.post(traced_server.base_url + "/v1/chat/completions", json=body | {"ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    (span,) = _spans_of(spans, r.json()["id"])
    a = _attrs(span)
    assert span.name == f"chat {tiny_llama}" and span.kind == 2  # SPAN_KIND_SERVER
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.usage.output_tokens"] == 12
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    for key in ("eaglegate.queue_seconds", "eaglegate.prefill_seconds", "eaglegate.decode_seconds"):
        assert key in a and a[key] >= 0
    assert a["eaglegate.decision_sync_seconds"] > 0  # tp=2: its steps waited on rank 0's broadcasts
    assert a["eaglegate.spec.verify_steps"] > 0 and a["eaglegate.spec.accept_length"] >= 1.0
    assert span.end_time_unix_nano - span.start_time_unix_nano > 0


def test_an_incoming_traceparent_is_continued(traced_server, collector, tiny_llama):
    _, spans = collector
    body = {"model": str(tiny_llama), "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    with httpx.stream("POST", traced_server.base_url + "/v1/completions", json=body, headers=headers, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: {")]
    rid = json.loads(lines[0][6:])["id"]
    (span,) = _spans_of(spans, rid)
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert _attrs(span)["gen_ai.operation.name"] == "text_completion"
