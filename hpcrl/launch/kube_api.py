"""The Kubernetes API as hpcrl's commands use it for ``cluster.scheduler: kuberay``: credentials, the Ray
token's Secret, RayJob/RayCluster custom objects and the driver's pod log, through the Kubernetes Python
client. Every refusal of the API (403, 404, 409, the server unreachable) is one line naming what was asked.

Credentials as ``kubectl`` finds them: ``$KUBECONFIG`` (its first file) or ``~/.kube/config``, else, inside a
pod, its service account (in-cluster config).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpcrl.errors import HpcrlError

GROUP, VERSION = "ray.io", "v1"
TIMEOUT_S = 30
KINDS = {"rayjobs": "RayJob", "rayclusters": "RayCluster"}


def kubeconfig_path() -> Path:
    first = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return Path(first or "~/.kube/config").expanduser()


def connect() -> Any:
    """An ``ApiClient`` from the kubeconfig or the pod's service account; one line when there is neither."""
    from kubernetes import client, config

    conf = client.Configuration()
    path = kubeconfig_path()
    try:
        if path.is_file():
            config.load_kube_config(config_file=str(path), client_configuration=conf)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=conf)
        else:
            raise HpcrlError(
                f"no Kubernetes credentials: no kubeconfig at {path} and not inside a pod; get one "
                "(`gcloud container clusters get-credentials CLUSTER --location LOCATION`) or set KUBECONFIG"
            )
    except config.ConfigException as exc:
        where = path if path.is_file() else "the pod's service account"
        raise HpcrlError(f"Kubernetes credentials from {where} are unusable: {_one_line(exc)}") from None
    conf.retries = 1  # a refused connection is reported at once, not after urllib3's three tries
    return client.ApiClient(conf)


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())[:300]


@contextmanager
def api_errors(what: str, host: str) -> Iterator[None]:
    """The client's exceptions as one line each: what was asked, the API's own reason, the fix."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as exc:
        try:
            reason = json.loads(exc.body or "{}").get("message") or exc.reason
        except ValueError:
            reason = exc.reason
        fix = {
            401: "refresh your credentials (the kubeconfig's token expired?)",
            403: "your account lacks the RBAC right for it in this namespace; ask the cluster's admin",
            404: "is KubeRay installed (the ray.io/v1 CRDs) and the namespace right (cluster.kube.namespace)?",
            409: "it exists already: another submission in the same second? submit again",
        }.get(exc.status or 0, "see the API server's reason")
        raise HpcrlError(f"Kubernetes refused {what} ({exc.status} {_one_line(reason)}); {fix}") from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise HpcrlError(
            f"cannot reach the Kubernetes API at {host} for {what} ({_one_line(exc)}); check the "
            "kubeconfig's cluster (`kubectl cluster-info`) and the network"
        ) from None


class Kube:
    """One namespace's objects: the Ray token's Secret, RayJobs and RayClusters, the driver's log."""

    def __init__(self, namespace: str) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.api = connect()
        self.core: Any = client.CoreV1Api(self.api)  # typed models; hpcrl passes and reads plain dicts
        self.custom: Any = client.CustomObjectsApi(self.api)
        self.host = str(self.api.configuration.host)

    def _errors(self, what: str) -> Any:
        return api_errors(f"{what} in namespace {self.namespace}", self.host)

    def ensure_token_secret(self, name: str) -> str:
        """The Secret (key ``token``) the pods mount: reused when it exists, else created with a fresh
        token. Its value never leaves this function. Returns "created" or "reused"."""
        from kubernetes.client.exceptions import ApiException

        with self._errors(f"reading Secret {name}"):
            try:
                self.core.read_namespaced_secret(name, self.namespace, _request_timeout=TIMEOUT_S)
                return "reused"
            except ApiException as exc:
                if exc.status != 404:
                    raise
        token = base64.b64encode(secrets.token_hex(32).encode()).decode()
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "hpcrl"}},
            "type": "Opaque",
            "data": {"token": token},
        }
        with self._errors(f"creating Secret {name}"):
            try:
                self.core.create_namespaced_secret(self.namespace, body, _request_timeout=TIMEOUT_S)
            except ApiException as exc:
                if exc.status != 409:  # created meanwhile by another submission: the same use
                    raise
                return "reused"
        return "created"

    def create(self, plural: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        with self._errors(f"creating {KINDS[plural]} {name}"):
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, plural, body, _request_timeout=TIMEOUT_S
            )

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        """The object, or None once it is gone (deleted, or removed by its TTL after finishing)."""
        from kubernetes.client.exceptions import ApiException

        with self._errors(f"reading {KINDS[plural]} {name}"):
            try:
                return dict(
                    self.custom.get_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, plural, name, _request_timeout=TIMEOUT_S
                    )
                )
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

    def delete(self, plural: str, name: str) -> None:
        # Background: the call returns at once; KubeRay's owner references remove the RayCluster and pods
        with self._errors(f"deleting {KINDS[plural]} {name}"):
            self.custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                self.namespace,
                plural,
                name,
                propagation_policy="Background",
                _request_timeout=TIMEOUT_S,
            )

    def submitter_log(self, rayjob: str) -> str | None:
        """The log of the RayJob's newest submitter pod (K8sJobMode: a Kubernetes Job named after the
        RayJob runs ``ray job submit`` and follows the driver's output); None when no such pod exists."""
        with self._errors(f"listing the pods of RayJob {rayjob}"):
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector=f"job-name={rayjob}", _request_timeout=TIMEOUT_S
            ).items
        if not pods:
            return None
        newest = max(pods, key=lambda p: p.metadata.creation_timestamp)
        name = newest.metadata.name
        with self._errors(f"reading the log of pod {name}"):
            return str(self.core.read_namespaced_pod_log(name, self.namespace, _request_timeout=TIMEOUT_S))
