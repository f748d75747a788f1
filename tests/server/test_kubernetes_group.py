"""The rendered LeaderWorkerSet's own command forms a TP group: its two pods run here as local processes, with the
variables LWS would give them, and the group serves what tp=1 serves; a lost worker pod turns the leader unready.

What differs from a cluster is only where things are (the model, the key, the cache: the volumes' contents) and the
network (one host: loopback, a free port per pod instead of one IP per pod)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from devtools import deploy_check
from devtools.prompts import chat
from runtime.engine import Engine
from worker.config import EngineConfig
from worker.dist import free_port
from worker.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(deploy_check.shutil.which("kubectl") is None, reason="kubectl (kustomize) missing")
KEY = "sk-lws-test"
STALL_TIMEOUT_S = 60.0  # the leader's --stall-timeout default, which the manifest keeps
PROMPT = "Name three rivers."


def _pod_spec(overlay: str) -> tuple[dict, dict]:
    """The LWS pod template's container and the ConfigMap its envFrom names, from the rendered overlay."""
    docs = deploy_check.render(ROOT / "deploy" / "kubernetes" / "overlays" / overlay)
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    names = {ref["configMapRef"]["name"] for ref in container["envFrom"]}
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] in names)
    return container, config["data"]


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args: a variable the container does not define stays as written."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg)


def _start_pod(container: dict, env: dict[str, str], worker_index: int, http_port: int, log) -> subprocess.Popen:
    args = [_expand(a, env | {"LWS_WORKER_INDEX": str(worker_index)}) for a in container["args"]]
    args = [a.replace("--port=30000", f"--port={http_port}") for a in args]
    # the image's entrypoint is `eaglegate`; python -m server is the same program
    return subprocess.Popen(
        [sys.executable, "-m", "server", *args],
        env=os.environ | env | {"LWS_WORKER_INDEX": str(worker_index)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait(url: str, status: int, timeout: float, procs) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for p in procs:
            assert p.poll() is None, f"a pod's process exited with {p.returncode}"
        try:
            if httpx.get(url, timeout=5).status_code == status:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{url} did not answer {status} within {timeout} s")


def test_the_lws_command_forms_a_two_node_group_that_serves_like_tp1(tiny_llama, tmp_path):
    container, config = _pod_spec("nvidia")
    assert config["TP_SIZE"] == "16"  # two pods of 8 GPUs; here two pods of one CPU rank each
    key_dir = tmp_path / "secret"
    key_dir.mkdir()
    (key_dir / "api-key").write_text(KEY + "\n")
    rendezvous, ports = free_port(), (free_port(), free_port())
    env = config | {
        # the volumes' contents
        "MODEL_PATH": str(tiny_llama),
        "EAGLEGATE_HOME": os.environ.get("EAGLEGATE_HOME", str(Path.home() / ".cache" / "eaglegate")),
        # a CPU-sized group, in float32 so that tp=2 and tp=1 agree exactly
        "TP_SIZE": "2",
        "DTYPE": "float32",
        # the network: one host
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        # what LWS injects into every container of a group of two
        "LWS_LEADER_ADDRESS": "127.0.0.1",
        "LWS_GROUP_SIZE": "2",
    }
    container = container | {
        "args": [
            a.replace("/etc/eaglegate/api-key", str(key_dir / "api-key")).replace(":29500", f":{rendezvous}")
            for a in container["args"]
        ]
    }
    log = tempfile.NamedTemporaryFile("w+", prefix="eaglegate-lws-", suffix=".log", delete=False)
    leader = _start_pod(container, env, 0, ports[0], log)
    worker = _start_pod(container, env, 1, ports[1], log)
    leader_url, worker_url = (f"http://127.0.0.1:{p}" for p in ports)
    try:
        probes = {p["httpGet"]["path"] for p in (container["livenessProbe"], container["readinessProbe"])}
        assert probes == {"/health", "/health/ready"}
        _wait(worker_url + "/health", 200, 120, [leader, worker])  # the worker pod's own probes
        _wait(worker_url + "/health/ready", 200, 10, [leader, worker])
        _wait(leader_url + "/health/ready", 200, 180, [leader, worker])
        body = {
            "model": str(tiny_llama),
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(
            leader_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["message"]["content"]
        metrics = httpx.get(worker_url + "/metrics", timeout=5).text
        assert 'eaglegate_node_ranks_alive{node_rank="1"} 1.0' in metrics
        info = httpx.get(leader_url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).json()
        assert info["tp_size"] == 2 and info["nnodes"] == 2

        # tp=1, in process, on the same prompt
        with Engine(EngineConfig(model_path=str(tiny_llama), dtype="float32", max_total_tokens=1024)) as ref:
            prompt = ref.tokenizer.encode(chat(ref, PROMPT), add_special_tokens=False)
            ids = ref.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))[0]
            assert got == ref.tokenizer.decode(ids.token_ids, skip_special_tokens=True)

        # the worker pod dies (its container's processes, as when a node goes): the leader turns unready, and
        # LWS's RecreateGroupOnPodRestart then replaces the group
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        took = _wait(leader_url + "/health/ready", 503, STALL_TIMEOUT_S, [leader])
        assert took < STALL_TIMEOUT_S
    finally:
        for p in (leader, worker):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
