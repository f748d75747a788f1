"""A real Prometheus scrapes a gateway under speculative traffic; every dashboard query returns data."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import eagle_flags, save_copy_eagle_head

from worker.dist import free_port
from worker.model.config import load_model_config
from worker.model.files import resolve_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus (Debian package) not installed; make test installs it"
)


def _server(tiny_llama, extra: list[str]) -> ServerProcess:
    return ServerProcess(
        ["--model-path", str(tiny_llama), "--tp-size", "2", "--dtype", "float32", "--max-total-tokens", "4096", *extra]
    )


def _traffic(server: ServerProcess, model: str, rounds: int) -> None:
    """Streaming and non-streaming requests, greedy and sampled, a few hundred milliseconds apart."""
    for i in range(rounds):
        body = {
            "model": model,
            "prompt": [5, 6, 7, 8] * 3,
            "max_tokens": 24,
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


@pytest.fixture(scope="module")
def spec_server(tiny_llama, tmp_path_factory):
    head = save_copy_eagle_head(
        tmp_path_factory.mktemp("metrics-head"), load_model_config(resolve_model(str(tiny_llama)))
    )
    server = _server(tiny_llama, eagle_flags(head))  # every step drafts: each rate() window holds accept lengths
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(spec_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = folder / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
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
    _traffic(spec_server, model, 8)
    # wait until Prometheus has scraped the traffic's effects (bounded)
    want = _value(_scrape(spec_server), "eaglegate_spec_verify_steps_total")
    assert want > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = _query(prometheus, "sum(eaglegate_spec_verify_steps_total)")
        if got and float(got[0]["value"][1]) >= want:
            break
        time.sleep(0.5)  # one scrape interval is 1 s
    _traffic(spec_server, model, 4)  # a second burst so every rate() window holds an increase
    time.sleep(2.5)  # two more scrapes of the second burst (scrape_interval 1 s)
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/eaglegate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    empty = [e for e in exprs if not _query(prometheus, e)]
    assert not empty, f"dashboard queries with no data: {empty}"
    mean = float(_query(prometheus, exprs[0])[0]["value"][1])
    assert mean >= 1.0


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
