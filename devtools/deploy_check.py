"""`make deploy-check`: render every Kubernetes overlay with kustomize (`kubectl kustomize`) and validate every object,
offline: built-in kinds against Kubernetes' own schemas (`kubernetes-validate`, strict: an unknown field is an
error), the LeaderWorkerSet and Prometheus Operator kinds against their CRDs' OpenAPI schemas vendored in
`deploy/kubernetes/schemas/` (unknown fields are errors there too, as the API server's strict field validation
makes them), and the pod template inside a LeaderWorkerSet against Kubernetes' PodTemplateSpec as well."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"  # the schemas validated against (the manifests need 1.30+: the preStop sleep action)


def overlays() -> list[Path]:
    return sorted(p.parent for p in (KUBE / "overlays").glob("*/kustomization.yaml"))


def render(overlay: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise SystemExit("deploy-check needs kubectl (its built-in kustomize v5) on PATH")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"kustomize failed on {overlay.relative_to(ROOT)}:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _closed(schema):
    """An object schema that lists its properties admits no others, unless it says it keeps unknown fields."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the vendored CRD's openAPIV3Schema, closed."""
    out = {}
    for path in sorted((KUBE / "schemas").glob("*.json.gz")):
        crd = json.loads(gzip.decompress(path.read_bytes()))
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = _closed(crd["openAPIV3Schema"])
    return out


def validate(doc: dict) -> list[str]:
    """Every problem with one rendered object, as 'Kind/name: path: message' lines."""
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    schema = crd_schemas().get((doc.get("apiVersion"), doc.get("kind")))
    if schema is None:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            return [f"{where}: {'.'.join(map(str, e.path))}: {e.message}"]
        except kubernetes_validate.SchemaNotFoundError as e:
            return [f"{where}: no schema for {doc.get('apiVersion')} {doc.get('kind')} ({e})"]
        return []
    body = copy.deepcopy(doc)
    body.pop("metadata", None)  # the API server checks ObjectMeta itself; the CRD schema says only 'object'
    problems = [
        f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(body)
    ]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        for name in ("leaderTemplate", "workerTemplate"):
            if name in lwt:
                pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": lwt[name]}
                problems += [p.replace("PodTemplate/t", f"{where} {name}") for p in validate(pod)]
    return problems


def main() -> int:
    if shutil.which("kubectl") is None:  # scripts/test-deps.sh refuses this under CI
        print("deploy-check: skipped, no kubectl on PATH")
        return 0
    failed = 0
    for overlay in overlays():
        docs = render(overlay)
        problems = [p for doc in docs for p in validate(doc)]
        kinds = ", ".join(sorted({d["kind"] for d in docs}))
        print(f"{overlay.relative_to(ROOT)}: {len(docs)} objects ({kinds}): {'ok' if not problems else 'INVALID'}")
        for p in problems:
            print(f"  {p}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
