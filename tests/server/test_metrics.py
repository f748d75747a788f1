"""What an operator sees, from one speculative tp=2 server: a real Prometheus scrapes it under traffic and every
dashboard query returns data; per-request figures add up to the totals; OpenTelemetry traces over OTLP/HTTP reach a
receiver in the test (protobuf, as a collector gets them): one span per request with the documented attributes, and
a caller's W3C `traceparent` continued."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from devtools.models import eagle_flags, save_copy_eagle_head
from devtools.server import ServerProcess
from worker.dist import free_port
from worker.model.config import load_model_config
from worker.model.files import resolve_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus (Debian package) not installed; make test installs it"
)


def _server(tiny_llama, extra: list[str], env: dict | None = None) -> ServerProcess:
    return ServerProcess(
        ["--model-path", str(tiny_llama), "--tp-size", "2", "--dtype", "float32", "--max-total-tokens", "4096", *extra],
        env=env,
    )


def _traffic(server: ServerProcess, model: str, rounds: int) -> None:
    """Streaming and non-streaming requests, greedy and sampled, a few hundred milliseconds apart."""
    for i in range(rounds):
        body = {
            "model": model,
            "prompt": [5, 6, 7, 8] * 3,
            "max_tokens": 16,
            "temperature": 0 if i % 2 else 0.7,
            "ignore_eos": True,
        }
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body | {"stream": True}, timeout=60) as s:
            assert s.status_code == 200
            list(s.iter_lines())


def _scrape(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def _value(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


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
def spec_server(tiny_llama, tmp_path_factory, collector):
    head = save_copy_eagle_head(
        tmp_path_factory.mktemp("metrics-head"), load_model_config(resolve_model(str(tiny_llama)))
    )
    env = os.environ | {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # traces exported within 0.1 s, not 5 s
    # every step drafts: each rate() window holds accept lengths
    server = _server(tiny_llama, [*eagle_flags(head), "--otlp-traces-endpoint", collector[0]], env=env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(spec_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = folder / "prometheus.yml"
    rules = ROOT / "deploy" / "prometheus"
    config.write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {rules / "recording_rules.yml"}
  - {rules / "alerts.yml"}
scrape_configs:
  - job_name: eaglegate
    static_configs:
      - targets: ["127.0.0.1:{spec_server.port}"]
""")
    assert subprocess.run(["promtool", "check", "config", str(config)], capture_output=True).returncode == 0
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # waiting for Prometheus to start, bounded by the deadline
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _query(url: str, expr: str) -> list:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def test_every_dashboard_query_returns_data(spec_server, prometheus):
    model = str(spec_server.proc.args[spec_server.proc.args.index("--model-path") + 1])
    _traffic(spec_server, model, 3)
    # wait until Prometheus has scraped the traffic's effects (bounded)
    want = _value(_scrape(spec_server), "eaglegate_spec_verify_steps_total")
    assert want > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = _query(prometheus, "sum(eaglegate_spec_verify_steps_total)")
        if got and float(got[0]["value"][1]) >= want:
            break
        time.sleep(0.5)  # one scrape interval is 1 s
    _traffic(spec_server, model, 2)  # a second burst so every rate() window holds an increase
    time.sleep(2.5)  # two more scrapes of the second burst (scrape_interval 1 s)
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/eaglegate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    empty = [e for e in exprs if not _query(prometheus, e)]
    assert not empty, f"dashboard queries with no data: {empty}"
    mean = float(_query(prometheus, exprs[0])[0]["value"][1])
    assert mean >= 1.0
    # the peer names the recording rules give, and every series docs/deployment.md documents, have data
    groups = yaml.safe_load((ROOT / "deploy/prometheus/recording_rules.yml").read_text())["groups"]
    recorded = [r["record"] for g in groups for r in g["rules"]]
    assert any(n.startswith("vllm:spec_decode") for n in recorded) and "sglang:spec_accept_length" in recorded
    missing = [n for n in recorded if not _query(prometheus, n)]
    assert not missing, f"recorded peer names with no data: {missing}"
    drafts = _query(prometheus, "sum(vllm:spec_decode_num_drafts_total)")
    assert float(drafts[0]["value"][1]) == float(
        _query(prometheus, "sum(eaglegate_spec_verify_steps_total)")[0]["value"][1]
    )
    missing = [e for e in _documented_series() if not _query(prometheus, e)]
    assert not missing, f"documented series with no data: {missing}"


def _documented_series() -> list[str]:
    """Each row of the metrics table in docs/deployment.md, as the series Prometheus stores for its type."""
    suffix = {"counter": "_total", "histogram": "_count", "gauge": ""}
    rows = re.findall(r"^\| `(\w+)` \| (counter|gauge|histogram) \|", (ROOT / "docs/deployment.md").read_text(), re.M)
    assert len(rows) >= 30
    return [f"eaglegate_{name}{suffix[kind]}" for name, kind in rows]


def test_per_request_spec_figures_add_up_to_the_server_totals(spec_server):
    model = str(spec_server.proc.args[spec_server.proc.args.index("--model-path") + 1])
    names = ("spec_verify_steps_total", "spec_draft_tokens_total", "spec_accepted_tokens_total")
    before = [_value(_scrape(spec_server), f"eaglegate_{n}") for n in names]
    per_request, url = [], spec_server.base_url
    for i in range(4):
        body = {"model": model, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_spec_metrics": True}
        if i % 2:
            body |= {"prompt": [5, 6, 7, 8, i] * 3}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            per_request.append(r.json()["spec_metrics"])
        elif i == 0:
            body |= {"messages": [{"role": "user", "content": "Count to ten."}]}
            per_request.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["spec_metrics"])
        else:  # streamed: the figures come in a last chunk with no choices
            body |= {"messages": [{"role": "user", "content": "Name a colour."}], "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as s:
                chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            assert chunks[-1]["choices"] == []
            per_request.append(chunks[-1]["spec_metrics"])
    for m in per_request:
        assert m["verify_steps"] > 0 and m["accept_length"] >= 1.0
        assert m["accept_length"] == round((m["verify_steps"] + m["accepted_tokens"]) / m["verify_steps"], 4)
        assert sum(src["accepted"] for src in m["by_source"].values()) >= m["accepted_tokens"]
    sums = [sum(m[k] for m in per_request) for k in ("verify_steps", "draft_tokens", "accepted_tokens")]
    after = [_value(_scrape(spec_server), f"eaglegate_{n}") for n in names]
    assert [a - b for a, b in zip(after, before)] == sums
    plain = httpx.post(url + "/v1/completions", json={"model": model, "prompt": [5, 6], "max_tokens": 2}, timeout=60)
    assert "spec_metrics" not in plain.json()


def test_scrape_passes_promtool(spec_server):
    """Names use `eaglegate_`: colons are reserved for recording rules, so promtool accepts every series as is."""
    r = subprocess.run(["promtool", "check", "metrics"], input=_scrape(spec_server), capture_output=True, text=True)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == 0 and not problems, problems


def test_speculative_series_move_only_with_speculation(spec_server, tiny_llama):
    text = _scrape(spec_server)
    assert _value(text, "eaglegate_spec_accept_length_count") > 0
    assert _value(text, "eaglegate_decision_sync_latency_seconds_count", kind="verify") > 0
    assert _value(text, "eaglegate_decision_sync_latency_seconds_count", kind="draft") > 0
    assert _value(text, "eaglegate_spec_draft_tokens_total") > 0
    for pos in ("1", "2", "3"):  # one series per draft depth, present from the start
        assert 'eaglegate_spec_accepted_tokens_per_position_total{model_name="' in text and f'position="{pos}"' in text
    plain = _server(tiny_llama, ["--speculative-algorithm", "NONE"])
    try:
        _traffic(plain, str(tiny_llama), 2)
        text = _scrape(plain)
        assert _value(text, "eaglegate_generation_tokens_total") > 0
        assert _value(text, "eaglegate_decision_sync_latency_seconds_count", kind="control") > 0  # tp=2 plans
        assert _value(text, "eaglegate_spec_accept_length_count") == 0
        assert _value(text, "eaglegate_spec_verify_steps_total") == 0
        assert _value(text, "eaglegate_decision_sync_latency_seconds_count", kind="verify") == 0
        assert _value(text, "eaglegate_decision_sync_latency_seconds_count", kind="draft") == 0
    finally:
        plain.stop()


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


def test_a_request_is_one_span_with_the_documented_attributes(spec_server, collector, tiny_llama):
    _, spans = collector
    body = {"model": str(tiny_llama), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12}
    r = httpx.post(spec_server.base_url + "/v1/chat/completions", json=body | {"ignore_eos": True}, timeout=60)
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


def test_an_incoming_traceparent_is_continued(spec_server, collector, tiny_llama):
    _, spans = collector
    body = {"model": str(tiny_llama), "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    with httpx.stream("POST", spec_server.base_url + "/v1/completions", json=body, headers=headers, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: {")]
    rid = json.loads(lines[0][6:])["id"]
    (span,) = _spans_of(spans, rid)
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert _attrs(span)["gen_ai.operation.name"] == "text_completion"
