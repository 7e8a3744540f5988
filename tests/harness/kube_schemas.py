"""The schemas a Kubernetes API server with KubeRay would check: KubeRay's RayJob/RayCluster CRD schemas,
vendored from ray-project/kuberay at v1.7.0 (``tests/launch/kuberay/``, see its README), and Kubernetes'
own OpenAPI schema for pods and Secrets (kubernetes-validate, strict: unknown fields fail). Used by
tests/launch/test_kuberay.py and by the API stand-in (``kube_standin.py``) on every body it receives."""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

CRDS = Path(__file__).parents[1] / "launch" / "kuberay"
K8S_VERSION = "1.33.0"  # GKE's regular channel at KubeRay 1.7's release


@cache
def crd_schema(kind: str) -> dict[str, Any]:
    data = json.loads(gzip.decompress((CRDS / f"{kind}.v1.7.0.json.gz").read_bytes()))
    return dict(data["openAPIV3Schema"])


@cache
def crd_validator(kind: str) -> Any:
    """The CRD's validator, its schema checked once: ``jsonschema.validate`` checks the (large) schema
    itself on every call, seconds each on this machine, for every body the stand-in receives."""
    schema = crd_schema(kind)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def unknown_fields(obj: Any, schema: dict[str, Any], at: str = "") -> list[str]:
    """Keys the structural schema does not declare (the API server would prune them silently)."""
    if isinstance(obj, dict) and "properties" in schema:
        out = []
        for key, value in obj.items():
            if key not in schema["properties"]:
                out.append(f"{at}.{key}")
            else:
                out += unknown_fields(value, schema["properties"][key], f"{at}.{key}")
        return out
    if isinstance(obj, list) and "items" in schema:
        return [f for i, item in enumerate(obj) for f in unknown_fields(item, schema["items"], f"{at}[{i}]")]
    return []


def check_against_schemas(manifest: dict[str, Any], kind: str) -> None:
    """``kind``: rayjobs or rayclusters. Raises on the first mistake (AssertionError for an unknown field)."""
    schema = crd_schema(kind)
    crd_validator(kind).validate(manifest)
    assert unknown_fields(manifest, schema) == []
    spec = manifest["spec"].get("rayClusterSpec", manifest["spec"])
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    if "submitterPodTemplate" in manifest["spec"]:
        groups.append({"template": manifest["spec"]["submitterPodTemplate"]})
    for group in groups:
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": group["template"],
        }
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
