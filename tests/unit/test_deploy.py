"""deploy/: compose files validate with Compose v2, Dockerfiles pass hadolint, Prometheus config passes promtool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.compose import compose_binary, compose_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KEYED = os.environ | {"EAGLEGATE_API_KEY": "sk-compose-test"}  # the compose files refuse to start without a key


@pytest.mark.parametrize("profile", ["rocm", "cuda", "cpu", "glm-flash-rocm"])
def test_compose_validates(profile):
    r = subprocess.run(
        [compose_binary(), "-f", "docker-compose.yml", "--profile", profile, "config", "-q"],
        cwd=DEPLOY,
        capture_output=True,
        text=True,
        env=KEYED,
    )
    assert r.returncode == 0, r.stderr
    full = subprocess.run(
        [compose_binary(), "-f", "docker-compose.yml", "--profile", profile, "config", "--format", "json"],
        cwd=DEPLOY,
        capture_output=True,
        text=True,
        check=True,
        env=KEYED,
    )
    services = json.loads(full.stdout)["services"]
    gateway = services[f"eaglegate-{profile}"]
    assert "healthcheck" in gateway and gateway["restart"] == "unless-stopped"
    assert {"prometheus", "grafana"} <= set(services)
    if "rocm" in profile:
        devices = {d["source"] for d in gateway["devices"]}
        assert devices == {"/dev/kfd", "/dev/dri"} and gateway["ipc"] == "host"
        assert "seccomp=unconfined" in gateway["security_opt"] and "video" in gateway["group_add"]
        assert "HIP_VISIBLE_DEVICES" in gateway["environment"] and gateway["shm_size"]


def test_the_glm_flash_service_runs_tp4_with_its_mtp_layer():
    """GLM-4.7-Flash at TP4 on 4 MI355X: no draft path, so the checkpoint's MTP layer drafts (speculative/mtp.py)."""
    from server.cli import build_parser

    full = subprocess.run(
        [compose_binary(), "-f", "docker-compose.yml", "--profile", "glm-flash-rocm", "config", "--format", "json"],
        cwd=DEPLOY,
        capture_output=True,
        text=True,
        check=True,
        env=KEYED,
    )
    service = json.loads(full.stdout)["services"]["eaglegate-glm-flash-rocm"]
    args = build_parser().parse_args(service["command"])  # every flag is one the CLI takes
    assert args.tp_size == 4 and args.speculative_algorithm == "EAGLE" and args.speculative_draft_model_path is None
    assert args.model_path.endswith("GLM-4.7-Flash") and service["environment"]["HIP_VISIBLE_DEVICES"] == "0,1,2,3"


@pytest.mark.parametrize("file", ["docker-compose.yml", "docker-compose.multinode.yml", "docker-compose.replicas.yml"])
def test_compose_refuses_to_start_without_an_api_key(file):
    env = {k: v for k, v in os.environ.items() if k != "EAGLEGATE_API_KEY"} | {"NODE_RANK": "0", "MASTER_ADDR": "h"}
    r = subprocess.run(
        [compose_binary(), "-f", file, "--profile", "cpu", "config", "-q"], cwd=DEPLOY, capture_output=True, text=True,
        env=env,
    )  # fmt: skip
    assert r.returncode != 0 and "set EAGLEGATE_API_KEY" in r.stderr, r.stderr


def test_broken_compose_is_rejected(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    ports: 12\n")
    r = subprocess.run([compose_binary(), "-f", str(bad), "config", "-q"], capture_output=True, text=True)
    assert r.returncode != 0


def test_multinode_compose_validates():
    env = KEYED | {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    r = subprocess.run(
        [compose_binary(), "-f", "docker-compose.multinode.yml", "config", "--format", "json"],
        cwd=DEPLOY,
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    cmd = json.loads(r.stdout)["services"]["eaglegate"]["command"]
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd and "--dist-init-addr=10.0.0.1:29500" in cmd


def test_replicas_compose_puts_each_replica_on_its_own_gpus_behind_the_gateway():
    from server.cli import build_parser

    services = compose_config("docker-compose.replicas.yml", {"EAGLEGATE_API_KEY": "sk-compose-test"})["services"]
    replicas = sorted(k for k in services if k.startswith("eaglegate-"))
    assert replicas == [f"eaglegate-{i}" for i in range(4)]
    gpus = []
    for name in replicas:
        svc = services[name]
        args = build_parser().parse_args(svc["command"])
        assert args.tp_size == 2 and svc["restart"] == "unless-stopped" and "/health/ready" in str(svc["healthcheck"])
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        gpus += device["device_ids"]
    assert sorted(gpus, key=int) == [str(i) for i in range(8)]  # 4 x TP2 on 8 GPUs, none shared
    gateway = services["gateway"]["command"]
    urls = gateway[gateway.index("--worker-urls") + 1 : gateway.index("--worker-urls") + 5]
    assert urls == [f"http://{name}:30000" for name in replicas] and "--policy=cache_aware" in gateway
    assert set(services["gateway"]["depends_on"]) == set(replicas)
    scraped = (DEPLOY / "prometheus" / "prometheus.replicas.yml").read_text()
    assert all(f"{name}:30000" in scraped for name in replicas) and "gateway:29000" in scraped


@pytest.mark.parametrize("dockerfile", ["Dockerfile.rocm", "Dockerfile.cuda"])
def test_dockerfiles_pass_hadolint(dockerfile):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run([hadolint, str(ROOT / dockerfile)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (ROOT / dockerfile).read_text()
    assert "USER 10001" in text and "HEALTHCHECK" in text and "VOLUME" in text
    assert "API_KEY" not in text and "torch==" not in text.replace("(torch|setuptools)==", "")
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = [p.removesuffix("*") for p in found["include"]]
    assert packages == ["server", "runtime", "worker", "speculative", "training", "devtools"]
    for pkg in packages:  # `pip install .` in the image needs every package of the project
        assert f"COPY {pkg} ./{pkg}" in text, f"{dockerfile} does not copy the {pkg} package"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus.replicas.yml"])
def test_prometheus_config_passes_promtool(config):
    r = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus" / config)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_alerts_and_peer_name_rules_pass_promtool_and_their_tests():
    rules = DEPLOY / "prometheus"
    r = subprocess.run(
        ["promtool", "check", "rules", "recording_rules.yml", "alerts.yml"], cwd=rules, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(["promtool", "test", "rules", "alerts.test.yml"], cwd=rules, capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_the_prometheus_rule_is_generated_from_the_rule_files():
    from importlib import util

    import yaml

    spec = util.spec_from_file_location("make_prometheus_rules", ROOT / "scripts" / "make_prometheus_rules.py")
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert yaml.safe_load(mod.OUT.read_text()) == mod.build()
    alerts = {r["alert"] for g in mod.build()["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert len(alerts) == 6 and "EaglegateRankDivergence" in alerts


def test_dashboard_is_generated_from_script():
    from importlib import util

    spec = util.spec_from_file_location("make_dashboard", ROOT / "scripts" / "make_dashboard.py")
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    on_disk = json.loads((DEPLOY / "grafana" / "dashboards" / "eaglegate.json").read_text())
    assert on_disk == mod.build()
    titles = " ".join(p["title"] for p in on_disk["panels"]).lower()
    for needle in (
        "accept length",
        "position",
        "acceptance rate",
        "sync latency",
        "first token",
        "inter-token",
        "end-to-end",
        "throughput",
        "running and waiting",
        "kv cache",
        "divergences",
    ):
        assert needle in titles
