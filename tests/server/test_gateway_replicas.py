"""Two replicas behind the real Shepherd model gateway (`smg` from PyPI), started with the gateway command that
deploy/docker-compose.replicas.yml ships: requests and streams pass through, a conversation stays on one replica
and reuses its prefix cache, the gateway reads the replicas' load reports, and a killed replica costs no more than
its own in-flight requests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from devtools.compose import compose_config
from devtools.server import API_KEY, ServerProcess
from worker.dist import free_port

SMG = Path(sys.executable).parent / "smg"
pytestmark = pytest.mark.skipif(not SMG.exists(), reason="smg (the gateway, in requirements.lock) not installed")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _gateway_args(workers: list[str], port: int, metrics_port: int) -> list[str]:
    """The shipped gateway command, pointed at local replicas and ports."""
    args = compose_config("docker-compose.replicas.yml", {"EAGLEGATE_API_KEY": API_KEY})["services"]["gateway"]
    args = args["command"]
    i = args.index("--worker-urls")
    urls = [a for a in args[i + 1 :] if not a.startswith("--")]
    args = args[: i + 1] + workers + args[i + 1 + len(urls) :]
    swap = {"--host=0.0.0.0": "--host=127.0.0.1", "--port=30000": f"--port={port}"}
    swap["--prometheus-host=0.0.0.0"] = "--prometheus-host=127.0.0.1"
    swap["--prometheus-port=29000"] = f"--prometheus-port={metrics_port}"
    assert set(swap) <= set(args) and f"--api-key={API_KEY}" in args and "--policy=cache_aware" in args
    return [swap.get(a, a) for a in args]


@pytest.fixture(scope="module")
def replicas(api_server):
    """The shared API server and a second replica started with the same flags (so their outputs agree)."""
    second = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "16384", "--speculative-algorithm", "NONE"], api_key=API_KEY
    )
    yield api_server, second
    second.stop()


@pytest.fixture(scope="module")
def gateway(replicas):
    port, metrics_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="smg-", suffix=".log", delete=False)
    args = _gateway_args([r.base_url for r in replicas], port, metrics_port)
    proc = subprocess.Popen([str(SMG), "launch", *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ready once both replicas are registered and healthy
        assert proc.poll() is None, open(log.name).read()
        try:
            if len(httpx.get(url + "/workers", headers=AUTH, timeout=2).json().get("workers", [])) == 2:
                break
        except (httpx.HTTPError, json.JSONDecodeError):
            pass
        time.sleep(0.25)
    yield url, f"http://127.0.0.1:{metrics_port}"
    os.killpg(proc.pid, signal.SIGKILL)  # its graceful shutdown waits out a grace period this test need not
    proc.wait()


def _chat(url: str, messages: list[dict], max_tokens: int = 12) -> dict:
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _finished(replica: ServerProcess) -> float:
    text = httpx.get(replica.base_url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("eaglegate_request_success_total")
    )


def test_requests_and_streams_pass_through_and_a_conversation_stays_on_one_replica(replicas, gateway):
    url, metrics_url = gateway
    direct = _chat(replicas[0].base_url, [{"role": "user", "content": "Say hello."}])
    routed = _chat(url, [{"role": "user", "content": "Say hello."}])
    assert routed["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Count to five."}]}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body | {"stream": True, "max_tokens": 12}, headers=AUTH, timeout=60
    ) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 3
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=10).status_code == 401  # the key is asked

    before = [_finished(r) for r in replicas]
    messages = [
        {"role": "system", "content": "You are a patient geography teacher who answers in full sentences. " * 8},
        {"role": "user", "content": "Which is the longest river in Europe?"},
    ]
    cached = []
    for turn in ("And the second longest?", "Which countries does it flow through?", ""):
        reply = _chat(url, messages, max_tokens=16)
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]}]
        messages += [{"role": "user", "content": turn}] if turn else []
    grew = [_finished(r) - b for r, b in zip(replicas, before)]
    assert sorted(grew) == [0, 3], f"the conversation's turns were split between replicas: {grew}"
    assert cached[1] > 0 and cached[2] > cached[1], cached

    home = replicas[grew.index(3)]  # the replica that held the conversation, and its prefix cache
    load = httpx.get(home.base_url + "/v1/loads", headers=AUTH, timeout=5).json()  # SGLang's shape
    assert load["dp_rank_count"] == 1 and load["loads"][0]["max_total_num_tokens"] == 16384
    assert 0 <= load["loads"][0]["token_usage"] <= 1 and load["loads"][0]["cache_hit_rate"] > 0
    assert httpx.get(home.base_url + "/v1/loads", timeout=5).status_code == 401

    # the gateway shows both replicas in its metrics, with the figures it polls from their /v1/loads
    wanted = [
        f'{name}{{worker="{r.base_url}"' for r in replicas for name in ("smg_worker_health", "smg_engine_token_usage")
    ]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the load monitor polls every --load-monitor-interval (5 s)
        text = httpx.get(metrics_url + "/metrics", timeout=5).text
        if all(w in text for w in wanted):
            break
        time.sleep(0.5)
    lines = text.splitlines()
    for r in replicas:
        assert f'smg_worker_health{{worker="{r.base_url}"}} 1' in lines
        assert any(line.startswith(f'smg_worker_requests_total{{worker="{r.base_url}"') for line in lines), lines
        assert any(line.startswith(f'smg_engine_token_usage{{worker="{r.base_url}"') for line in lines), lines


def test_a_killed_replica_costs_only_its_own_in_flight_requests(replicas, gateway):
    url, _ = gateway
    victim = replicas[1]
    results: list[tuple[float, int | str]] = []  # (when sent, status or error)
    lock = threading.Lock()

    def one(i: int) -> None:
        sent = time.monotonic()
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": f"Request {i}: write a short line about rivers."}],
            "max_tokens": 24,
            "temperature": 0,
        }
        try:
            outcome: int | str = httpx.post(
                url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120
            ).status_code
        except httpx.HTTPError as e:
            outcome = type(e).__name__
        with lock:
            results.append((sent, outcome))

    with ThreadPoolExecutor(4) as pool:
        for i in range(8):
            pool.submit(one, i)
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        for i in range(8, 14):
            pool.submit(one, i)
    after = [outcome for sent, outcome in results if sent > killed_at]
    before = [outcome for sent, outcome in results if sent <= killed_at]
    assert after and all(o == 200 for o in after), after  # the gateway retried elsewhere and routed around it
    assert sum(o != 200 for o in before) <= 4, before  # at most what was in flight (4 workers) failed
    assert _chat(url, [{"role": "user", "content": "Still there?"}])["choices"][0]["message"]["content"]
