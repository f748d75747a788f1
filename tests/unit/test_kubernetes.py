"""deploy/kubernetes: every overlay renders and validates (devtools/deploy_check.py, also `make deploy-check`), the
validator rejects what the API server would, and the rendered objects say what docs/deployment.md promises."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from devtools import deploy_check

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) missing")
OVERLAYS = ["amd", "cpu", "glm-flash-amd", "nvidia"]
GPU_OVERLAYS = {"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu", "glm-flash-amd": "amd.com/gpu"}


def _rendered(overlay: str) -> dict[str, dict]:
    docs = deploy_check.render(ROOT / "deploy" / "kubernetes" / "overlays" / overlay)
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def _pod(objs: dict) -> dict:
    return objs["LeaderWorkerSet/eaglegate"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]


def test_the_overlays_are_the_ones_tested():
    assert [p.name for p in deploy_check.overlays()] == OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(overlay):
    docs = list(_rendered(overlay).values())
    assert [p for d in docs for p in deploy_check.validate(d)] == []
    kinds = {d["kind"] for d in docs}
    assert {"LeaderWorkerSet", "Service", "PodMonitor", "ConfigMap", "Deployment", "ServiceMonitor"} <= kinds


def test_the_validator_rejects_what_the_api_server_would():
    objs = _rendered("nvidia")
    lws = copy.deepcopy(objs["LeaderWorkerSet/eaglegate"])
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    _pod({"LeaderWorkerSet/eaglegate": lws})["spec"]["containers"][0]["readinesProbe"] = {}
    problems = deploy_check.validate(lws)
    assert any("restartPolicy" in p for p in problems) and any("readinesProbe" in p for p in problems), problems
    monitor = copy.deepcopy(objs["PodMonitor/eaglegate"])
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = 5
    assert deploy_check.validate(monitor)
    gateway = copy.deepcopy(objs["Deployment/eaglegate-gateway"])
    gateway["spec"]["replicas"] = "one"
    assert deploy_check.validate(gateway)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_group_restarts_together_and_every_pod_runs_one_command(overlay):
    from server.cli import build_parser
    from server.serve import FLUSH_S

    objs = _rendered(overlay)
    lws = objs["LeaderWorkerSet/eaglegate"]["spec"]
    assert lws["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert "leaderTemplate" not in lws["leaderWorkerTemplate"]  # the leader runs the worker template too
    pod = _pod(objs)["spec"]
    (container,) = pod["containers"]
    config = next(d["data"] for k, d in objs.items() if k.startswith("ConfigMap/eaglegate-config"))
    assert container["envFrom"] == [{"configMapRef": {"name": next(k for k in objs if "eaglegate-config" in k)[10:]}}]
    lws_env = {"LWS_LEADER_ADDRESS": "eaglegate-0.eaglegate", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    env = config | lws_env
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]  # every variable is defined
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve" and parsed.node_rank == 1 and parsed.nnodes == 2
    assert parsed.dist_init_addr == "eaglegate-0.eaglegate:29500" and parsed.api_key_file == "/etc/eaglegate/api-key"
    size = lws["leaderWorkerTemplate"]["size"]
    gpus = container.get("resources", {}).get("limits", {}).get(GPU_OVERLAYS.get(overlay, ""), 1)
    assert int(config["TP_SIZE"]) == size * gpus  # one rank per GPU on every pod of the group

    # probes: liveness on /health, readiness on /health/ready, a startup window for loading weights
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health" and startup["periodSeconds"] * startup["failureThreshold"] >= 900
    # SIGTERM comes after preStop; the drain and the flush must end before the kubelet's SIGKILL
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + parsed.shutdown_timeout + FLUSH_S + 10
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["api-key"]["secret"]["secretName"] == "eaglegate-api-key"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts["/etc/eaglegate"] == "api-key" and mounts["/models"] == "models"
    if overlay in GPU_OVERLAYS:
        assert container["resources"]["limits"][GPU_OVERLAYS[overlay]] >= 4
    if "amd" in overlay:
        assert container["image"].endswith(":rocm") and 44 in pod["securityContext"]["supplementalGroups"]
        assert pod["securityContext"]["seccompProfile"]["type"] == "Unconfined"
        assert config["HSA_FORCE_FINE_GRAIN_PCIE"] == "1"
        assert all(c["image"].endswith(":rocm") for c in pod.get("initContainers", []))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitors_dashboard_and_gateway(overlay):
    from smg.launch_router import parse_router_args

    objs = _rendered(overlay)
    leaders = objs["Service/eaglegate"]["spec"]["selector"]
    assert leaders == {"leaderworkerset.sigs.k8s.io/name": "eaglegate", "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    monitor = objs["PodMonitor/eaglegate"]["spec"]
    assert monitor["selector"]["matchLabels"] == {"leaderworkerset.sigs.k8s.io/name": "eaglegate"}  # every rank
    assert monitor["podMetricsEndpoints"][0]["port"] == "http"
    dashboard = objs["ConfigMap/eaglegate-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    on_disk = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "eaglegate.json").read_text())
    assert json.loads(dashboard["data"]["eaglegate.json"]) == on_disk

    gateway = objs["Deployment/eaglegate-gateway"]["spec"]["template"]["spec"]
    args = [a.replace("$(POD_NAMESPACE)", "default").replace("$(EAGLEGATE_API_KEY)", "k") for a in
            gateway["containers"][0]["args"]]  # fmt: skip
    parsed = parse_router_args(args)
    assert parsed.policy == "cache_aware" and parsed.service_discovery and parsed.api_key == "k"
    assert parsed.selector == leaders and parsed.service_discovery_port == 30000
    assert parsed.health_check_endpoint == "/health/ready"
    rule = objs["Role/eaglegate-gateway"]["rules"][0]
    assert rule["resources"] == ["pods"] and set(rule["verbs"]) == {"get", "list", "watch"}
    assert gateway["serviceAccountName"] == "eaglegate-gateway"
