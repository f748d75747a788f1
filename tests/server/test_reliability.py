"""Reliability: load with hang-ups, worker death and restart, hostile input and fuzzing, slow clients,
SIGTERM under load, secrets."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from devtools.load import run_load
from devtools.models import eagle_flags, save_copy_eagle_head, save_tiny_model
from devtools.schemas import nested_schema, slow_schema
from devtools.server import ServerProcess, alive, descendants
from runtime.engine import Engine
from worker.config import EngineConfig
from worker.model.config import load_model_config
from worker.model.files import resolve_model
from worker.sampling.params import SamplingParams

SECRET = "sk-never-print-me-7f3a"


def _args(tiny_llama, head, *extra) -> list[str]:
    return [
        "--model-path",
        str(tiny_llama),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
        "--max-model-len",
        "512",
        *eagle_flags(head),
        *extra,
    ]


@pytest.fixture(scope="module")
def head(tiny_llama, tmp_path_factory):
    return save_copy_eagle_head(tmp_path_factory.mktemp("rel-head"), load_model_config(resolve_model(str(tiny_llama))))


@pytest.fixture(scope="module")
def server(tiny_llama, head):
    s = ServerProcess(_args(tiny_llama, head, "--tp-size", "2"), api_key=SECRET)
    yield s
    s.stop()


def _wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = server.stats()
        if (s["running"], s["waiting"], s["kv_used_tokens"]) == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)  # polling for aborts to land, bounded by the deadline


def _chat(server: ServerProcess, **kw) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8} | kw
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=60)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_load_with_hangups_completes_everything_and_leaks_nothing(server):
    report = asyncio.run(
        run_load(server.base_url, "tiny", clients=32, requests_per_client=2, max_tokens=24, api_key=SECRET)
    )
    assert not report.failed, report.failed[:3]
    assert report.completed + report.abandoned == 64 and report.abandoned > 0
    stats = _wait_idle(server)
    assert (stats["running"], stats["waiting"], stats["kv_used_tokens"]) == (0, 0, 0)
    print("load:", json.dumps(report.summary()))


HOSTILE = {
    "deeply nested": b'{"model":"tiny","messages":' + b"[" * 50000 + b"]" * 50000 + b"}",
    "invalid utf-8": b'{"model":"\xff\xfe","messages":[{"role":"user","content":"hi"}]}',
    "NaN temperature": b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
    "negative max_tokens": b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":-5}',
    "huge max_tokens": b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":1000000000000}',
    "huge n": b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"n":1000000000}',
    "unknown field": b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"frobnicate":1}',
    "not an object": b"[1, 2, 3]",
    "oversized": b'{"model":"tiny","messages":[{"role":"user","content":"' + b"a" * 5_000_000 + b'"}]}',
    "infinite penalty": b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"presence_penalty":1e999}',
}


def test_hostile_input_gets_4xx_and_memory_stays_flat(server):
    headers = server.headers() | {"content-type": "application/json"}
    url = server.base_url + "/v1/chat/completions"
    rss_before = None
    for round_ in range(6):
        for name, body in HOSTILE.items():
            r = httpx.post(url, content=body, headers=headers, timeout=30)
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], name
        if round_ == 1:
            rss_before = _rss_kb(server.proc.pid)  # after warm-up rounds
    assert _chat(server).status_code == 200
    growth_mb = (_rss_kb(server.proc.pid) - rss_before) / 1024
    assert growth_mb < 40, f"front-end memory grew {growth_mb:.1f} MB over 40 hostile requests"


def test_fuzz_from_openapi_schema(server):
    """Schemathesis generates requests (valid and invalid) from our own OpenAPI schema, operation by operation:
    never a 5xx, every error in OpenAI's shape, and the server keeps serving."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json", headers=server.headers())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    calls = {"n": 0}
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            case.headers = (case.headers or {}) | server.headers()
            response = case.call(timeout=60)
            calls["n"] += 1
            assert response.status_code < 500, (case.path, response.status_code, response.text[:300])
            if response.status_code >= 400:
                err = response.json().get("error", {})
                assert set(err) == {"message", "type", "param", "code"}, response.text[:300]

        check()
    assert calls["n"] >= 40
    assert _chat(server).status_code == 200


def test_slow_reader_does_not_stall_others(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as slow:
        with slow.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=server.headers()) as r:
            next(r.iter_lines())  # read one line, then stop reading while the server keeps producing
            started = time.monotonic()
            others = [_chat(server, max_tokens=16) for _ in range(4)]
            assert all(o.status_code == 200 for o in others)
            assert server.stats()["steps"] > 0
            assert time.monotonic() - started < 60
    stats = _wait_idle(server)
    assert stats["kv_used_tokens"] == 0


def test_api_key_never_leaks(server):
    r = httpx.post(
        server.base_url + "/v1/chat/completions", json={"model": "tiny"}, headers={"Authorization": f"Bearer {SECRET}x"}
    )
    assert r.status_code == 401 and SECRET not in r.text
    assert SECRET not in httpx.get(server.base_url + "/metrics").text
    assert SECRET not in httpx.get(server.base_url + "/health").text
    assert SECRET not in server.output()


def _workers(s: ServerProcess) -> list[int]:
    tree = sorted(descendants(s.proc.pid) - {s.proc.pid})
    return [p for p in tree if Path(f"/proc/{p}/comm").read_text().startswith("eaglegate-tp")]


def test_worker_death_gives_503_then_the_group_restarts(tiny_llama, head):
    """A killed rank fails the in-flight stream with a 503 at once, /health and /health/ready turn red, the group
    restarts (readiness returns with a real generation); past --max-worker-restarts the process exits 1, and the
    restarting parent it runs under (as a container runtime would) brings a fresh one back."""
    args = _args(tiny_llama, head, "--tp-size", "2", "--max-model-len", "6000", "--max-worker-restarts", "1")
    s = ServerProcess(args, restart=True)
    try:
        assert httpx.get(s.base_url + "/health/ready", timeout=60).json() == {"status": "ready"}
        workers = _workers(s)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 5900,
            "ignore_eos": True,
            "stream": True,
        }
        outcome = {}

        def stream() -> None:
            with httpx.stream("POST", s.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                outcome["lines"] = lines

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while s.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)  # until the request is running
        victim = workers[-1]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        t.join(timeout=20)
        assert not t.is_alive(), "stream hung after a worker was killed"
        assert time.monotonic() - killed < 20
        errors = [json.loads(x[6:]) for x in outcome["lines"] if x != "data: [DONE]" and "error" in x]
        assert errors and "engine failed" in errors[0]["error"]["message"]
        assert errors[0]["error"]["type"] == "service_unavailable_error"
        h = httpx.get(s.base_url + "/health", timeout=5)
        r = _chat(s)
        if h.status_code == 503:  # the restart may already be done on a fast machine
            assert "exited with code" not in h.text and "/engine/stats" in h.json()["error"]["message"]
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        deadline = time.monotonic() + 120
        while httpx.get(s.base_url + "/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.25)  # the worker group reloads in the background, bounded
        assert _chat(s).status_code == 200
        assert s.stats()["restarts"] == 1 and "exited with code" in s.stats()["last_failure"]
        assert httpx.get(s.base_url + "/health/ready", timeout=60).status_code == 200
        os.kill(_workers(s)[-1], signal.SIGKILL)  # a second failure within the window: past the budget of 1
        deadline = time.monotonic() + 60
        while "restarter: the server exited with 1" not in s.output() and time.monotonic() < deadline:
            time.sleep(0.25)  # the server drains and exits 1; its parent starts it again
        assert "stopped: the worker group failed too often" in s.output()
        s.wait_healthy()
        assert httpx.get(s.base_url + "/health/ready", timeout=60).status_code == 200
        assert s.stats()["restarts"] == 0  # a fresh process
    finally:
        assert s.stop() == 0


def test_sigterm_under_load_drains_and_exits_zero(tiny_llama, head):
    s = ServerProcess(_args(tiny_llama, head))
    tree = descendants(s.proc.pid)
    result = {}

    def load() -> None:
        result["report"] = asyncio.run(
            run_load(s.base_url, "tiny", clients=16, requests_per_client=50, max_tokens=32, hangup_share=0.0)
        )

    t = threading.Thread(target=load)
    t.start()
    deadline = time.monotonic() + 30
    while s.stats()["steps"] < 20 and time.monotonic() < deadline:
        time.sleep(0.05)  # until the load is flowing
    stopped_at = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=60) == 0
    assert time.monotonic() - stopped_at < 45
    t.join(timeout=60)
    assert not t.is_alive(), "clients hung after shutdown"
    report = result.get("report")
    report = result["report"]  # clients see 503s or refused/closed connections (0), never a 500
    assert report.completed > 0
    assert all(status in (0, 503) for status, _ in report.failed), report.failed[:3]
    deadline = time.monotonic() + 10
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(tree), f"orphans: {alive(tree)}"
    assert "eaglegate: stopped" in s.output()


def test_a_failing_step_observer_never_stops_outputs(tiny_llama, caplog):
    """The server's metrics run on the engine's receiver thread: an observer that raises is logged once and counted,
    and every request still gets its whole answer (a raise that ended the thread would hang every request)."""
    calls = []

    def broken(report):
        calls.append(report)
        raise RuntimeError("metrics bug")

    cfg = EngineConfig(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with Engine(cfg) as reference:
        expected = [r.token_ids for r in reference.generate([[1, 2, 3], [4, 5]], params)]
    with caplog.at_level(logging.ERROR, logger="runtime.engine"), Engine(cfg, on_step=broken) as eng:
        got = [r.token_ids for r in eng.generate([[1, 2, 3], [4, 5]], params, timeout=60)]
    assert got == expected and all(len(t) == 8 for t in got)
    assert eng.observer_errors == len(calls) >= 8  # after shutdown joined the receiver: the counts are final
    assert sum("metrics bug" in r.exc_text for r in caplog.records if r.exc_text) == 1


def _stream_chat(base_url: str, body: dict, out: dict) -> None:
    """One streamed chat request; records its status, text and finish reason."""
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        text, finish = [], None
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice:
                    text.append(choice[0]["delta"].get("content") or "")
                    finish = choice[0].get("finish_reason") or finish
                    out.setdefault("first", time.monotonic())
        out["text"], out["finish"] = "".join(text), finish


def test_tp3_grammars_at_their_limits_then_sigterm_drains_streams_to_their_end(tmp_path, smol_dir):
    """At tp=3: grammars over a limit (nesting 250 and 400, a repeat cap) and one that compiles past the limit (set to
    1 s) each get a 400 naming it while plain streams keep completing, with no restart, and the next grammar is
    served. Then SIGTERM during streams: new requests and /health/ready get 503 while the streams run to their full
    length, and the process exits 0 with no process left behind. (A small model with SmolLM2's tokenizer: 6 heads
    over 3 KV heads.)"""
    model = save_tiny_model(tmp_path / "m", "llama", heads=6, kv_heads=3, hidden=48, intermediate=96, seed=3)
    s = ServerProcess(["--model-path", str(model), "--served-model-name", "tiny", "--tp-size", "3",
                       "--dtype", "float32", "--speculative-algorithm", "NONE",
                       "--grammar-compile-timeout", "1"])  # fmt: skip
    tree = descendants(s.proc.pid)
    url = s.base_url + "/v1/chat/completions"
    plain = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about owls."}]}
    streaming = plain | {"max_tokens": 32, "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        assert httpx.get(s.base_url + "/health/ready", timeout=60).status_code == 200
        streams = [{} for _ in range(2)]
        threads = [threading.Thread(target=_stream_chat, args=(s.base_url, streaming, o)) for o in streams]
        for t in threads:
            t.start()
        refused = [
            (json.loads(nested_schema(250)), "nests deeper than the limit of 128"),
            (json.loads(nested_schema(400)), "nests deeper than the limit of 128"),
            (slow_schema(), "compiling took longer than the limit of 1 s"),
        ]
        for schema, reason in refused:
            fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            r = httpx.post(url, json=plain | {"max_tokens": 8, "response_format": fmt}, timeout=120)
            assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text[:300]
        r = httpx.post(url, json=plain | {"max_tokens": 8, "regex": "a{1,999}"}, timeout=60)
        assert r.status_code == 400 and "over the limit of 256" in r.json()["error"]["message"]
        for t in threads:
            t.join(timeout=120)
        assert all(o["status"] == 200 and o["finish"] == "length" for o in streams)
        r = httpx.post(url, json=plain | {"max_tokens": 8, "response_format": {"type": "json_object"}}, timeout=60)
        assert r.status_code == 200 and s.stats()["restarts"] == 0
        # SIGTERM while streams run
        streams = [{} for _ in range(3)]
        threads = [
            threading.Thread(target=_stream_chat, args=(s.base_url, streaming | {"max_tokens": 64}, o)) for o in streams
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all("first" in o for o in streams) and time.monotonic() < deadline:
            time.sleep(0.02)  # until every stream has its first chunk
        s.proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        time.sleep(0.2)
        r = httpx.post(url, json=plain | {"max_tokens": 8}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert httpx.get(s.base_url + "/health/ready", timeout=10).status_code == 503
        for t in threads:
            t.join(timeout=60)
        assert all(o["status"] == 200 and o["finish"] == "length" for o in streams)  # full length, not cut
        assert s.proc.wait(timeout=60) == 0 and time.monotonic() - stopped_at < 30 + 10
    finally:
        s.stop()
    deadline = time.monotonic() + 10
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(tree), f"orphans: {alive(tree)}"
