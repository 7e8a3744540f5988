"""A STAND-IN for a Kubernetes API server with KubeRay installed, served over loopback HTTP for tests (no API
server can run here). It answers only the calls hpcrl's Kubernetes client makes (``hpcrl/launch/kube_api.py``):

- Secrets: get, create (body checked against Kubernetes' OpenAPI schema);
- RayJob / RayCluster custom objects (``ray.io/v1``): create (body checked against KubeRay 1.7's CRD schema
  and the pod templates against Kubernetes', as ``tests/harness/kube_schemas.py`` does), get, delete;
- pods: list by ``labelSelector`` (``k=v``), a pod's log.

It records every request (``requests``), answers as the real server does (Status bodies with 401, 404,
409 AlreadyExists, 422 Invalid), checks the bearer token of its kubeconfig (``kubeconfig``), and takes
injected refusals (``fail``). Nothing runs the objects: a test plays KubeRay by setting a RayJob's status
(``set_status``) and adding its submitter pod (``add_pod``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes_validate
import yaml

from tests.harness.kube_schemas import K8S_VERSION, check_against_schemas

CUSTOM = re.compile(r"^/apis/ray\.io/v1/namespaces/([^/]+)/(rayjobs|rayclusters)(?:/([^/]+))?$")
CORE = re.compile(r"^/api/v1/namespaces/([^/]+)/(secrets|pods)(?:/([^/]+))?(/log)?$")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class KubeStandIn:
    def __init__(self, token: str = "standin-token") -> None:
        self.token = token
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (namespace, plural, name)
        self.logs: dict[tuple[str, str], str] = {}
        self.requests: list[Request] = []
        self.faults: list[tuple[str, str, int, str]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> KubeStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        """Forget every object, request and refusal (a module's tests share one server)."""
        with self.lock:
            self.objects.clear()
            self.logs.clear()
            self.requests.clear()
            self.faults.clear()

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig for this server, as ``gcloud container clusters get-credentials`` writes one."""
        conf = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "me", "user": {"token": self.token}}],
            "contexts": [
                {"name": "standin", "context": {"cluster": "standin", "user": "me", "namespace": namespace}}
            ],
            "current-context": "standin",
        }
        path.write_text(yaml.safe_dump(conf))
        return path

    # -- what a test does in KubeRay's place ----------------------------------------------------------
    def fail(self, method: str, path_part: str, code: int, reason: str = "Forbidden") -> None:
        """Answer ``method`` requests whose path contains ``path_part`` with ``code`` from now on."""
        self.faults.append((method, path_part, code, reason))

    def set_status(self, namespace: str, plural: str, name: str, **fields: Any) -> None:
        with self.lock:
            self.objects[(namespace, plural, name)]["status"] = fields

    def add_pod(self, namespace: str, name: str, labels: dict[str, str], log: str) -> None:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": labels,
                "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            "spec": {"containers": [{"name": "ray-job-submitter", "image": "rayproject/ray"}]},
        }
        with self.lock:
            self.objects[(namespace, "pods", name)] = pod
            self.logs[(namespace, name)] = log

    def bodies(self, method: str, path_part: str) -> list[Any]:
        return [r.body for r in self.requests if r.method == method and path_part in r.path]

    # -- the API ----------------------------------------------------------------------------------------
    def answer(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        for m, part, code, reason in self.faults:
            if m == method and part in path:
                return code, status(code, reason, f"stand-in refuses {method} {path}")
        match = CUSTOM.match(path) or CORE.match(path)
        if not match:
            return 404, status(404, "NotFound", f"the server could not find the requested resource ({path})")
        ns, plural, name = match.group(1), match.group(2), match.group(3)
        if plural == "pods":
            if match.group(4):
                return self._log(ns, name)
            return 200, self._list_pods(ns, query.get("labelSelector", [""])[0])
        with self.lock:
            if method == "POST" and name is None:
                return self._create(ns, plural, body)
            key = (ns, plural, name)
            if key not in self.objects:
                group = "" if plural == "secrets" else ".ray.io"
                return 404, status(404, "NotFound", f'{plural}{group} "{name}" not found')
            if method == "DELETE":
                return 200, self.objects.pop(key)
            return 200, self.objects[key]

    def _create(self, ns: str, plural: str, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            if plural == "secrets":
                kubernetes_validate.validate(body, K8S_VERSION, strict=True)
            else:
                check_against_schemas(body, plural)
        except Exception as exc:  # the API server's admission: 422 with the schema's complaint
            return 422, status(422, "Invalid", f"{plural}: {' '.join(str(exc).split())[:300]}")
        name = body["metadata"]["name"]
        if (ns, plural, name) in self.objects:
            group = "" if plural == "secrets" else ".ray.io"
            return 409, status(409, "AlreadyExists", f'{plural}{group} "{name}" already exists')
        stored = json.loads(json.dumps(body))
        stored["metadata"].update(
            namespace=ns, uid=f"uid-{len(self.objects)}", creationTimestamp="2026-01-01T00:00:00Z"
        )
        self.objects[(ns, plural, name)] = stored
        return 201, stored

    def _list_pods(self, ns: str, selector: str) -> dict[str, Any]:
        wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
        with self.lock:
            pods = [
                pod
                for (n, kind, _), pod in self.objects.items()
                if n == ns and kind == "pods" and wanted.items() <= pod["metadata"]["labels"].items()
            ]
        return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods}

    def _log(self, ns: str, name: str) -> tuple[int, Any]:
        if (ns, name) not in self.logs:
            return 404, status(404, "NotFound", f'pods "{name}" not found')
        return 200, self.logs[(ns, name)]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                query = parse_qs(url.query)
                standin.requests.append(Request(self.command, url.path, query, body))
                if self.headers.get("Authorization") != f"Bearer {standin.token}":
                    code, out = 401, status(401, "Unauthorized", "Unauthorized")
                else:
                    code, out = standin.answer(self.command, url.path, query, body)
                text = out if isinstance(out, str) else json.dumps(out)
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _serve

            def log_message(self, *_: Any) -> None:
                pass

        return Handler
