"""A STAND-IN for the Hugging Face hub, served over loopback HTTP for tests (no machine here reaches the
real hub). It answers the calls huggingface_hub's ``snapshot_download`` makes, for model and data set
repositories held in memory: the revision's commit, the recursive tree, and ``resolve`` downloads with
HEAD metadata and byte ranges. ``cut_after`` makes the first download of a file stop after that many
bytes (the connection closes mid-body), as a broken transfer would; ``requests`` records every request
with its Range header, so a test can see a download resume where it stopped.

Start with ``with HubStandIn({...}) as hub:`` and point huggingface_hub at ``hub.url`` (``HF_ENDPOINT``).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, bytes]
    kind: str = "model"  # or "dataset"
    gated: bool = False
    """Gated: every call without ``Authorization: Bearer <token>`` gets 401."""
    token: str = ""

    @property
    def sha(self) -> str:
        digest = hashlib.sha1()
        for path in sorted(self.files):
            digest.update(path.encode() + b"\0" + self.files[path])
        return digest.hexdigest()


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubStandIn:
    repos: dict[str, Repo]
    """``org/name`` -> repository (a data set's key is its id too; ``Repo.kind`` says which it is)."""
    cut_after: dict[str, int] = field(default_factory=dict)
    """Path in a repo -> bytes sent before the first GET of it breaks off."""
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    """(method, path, Range header or '') of every request, in order."""

    def __enter__(self) -> HubStandIn:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet: tests read ``requests`` instead
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- routes ---------------------------------------------------------------------------------------
    _INFO = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)/revision/([^/?]+)")
    _TREE = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)/tree/([^/?]+)")
    _RESOLVE = re.compile(r"^/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")

    def _serve(self, req: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(req.path).path)
        self.requests.append((req.command, path, req.headers.get("Range", "")))
        for pattern, handler in ((self._INFO, self._info), (self._TREE, self._tree)):
            if m := pattern.match(path):
                repo = self._repo(req, m.group(2), "dataset" if m.group(1) == "datasets" else "model")
                if repo is not None:
                    handler(req, m.group(2), repo)
                return
        if m := self._RESOLVE.match(path):
            repo = self._repo(req, m.group(2), "dataset" if m.group(1) else "model")
            if repo is not None:
                self._resolve(req, repo, m.group(4), body=body)
            return
        self._send(req, 404, b'{"error": "not found"}')

    def _repo(self, req: BaseHTTPRequestHandler, repo_id: str, kind: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None or repo.kind != kind:
            self._send(req, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            return None
        if repo.gated and req.headers.get("Authorization") != f"Bearer {repo.token}":
            self._send(
                req, 401, b'{"error": "Access to this repo is restricted"}', {"X-Error-Code": "GatedRepo"}
            )
            return None
        return repo

    def _info(self, req: BaseHTTPRequestHandler, repo_id: str, repo: Repo) -> None:
        siblings = [{"rfilename": p} for p in sorted(repo.files)]
        self._json(req, {"id": repo_id, "sha": repo.sha, "siblings": siblings, "private": False})

    def _tree(self, req: BaseHTTPRequestHandler, repo_id: str, repo: Repo) -> None:
        entries = [
            {"type": "file", "path": p, "size": len(data), "oid": _blob_id(data)}
            for p, data in sorted(repo.files.items())
        ]
        self._json(req, entries)

    def _resolve(self, req: BaseHTTPRequestHandler, repo: Repo, file: str, *, body: bool) -> None:
        data = repo.files.get(file)
        if data is None:
            self._send(req, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})
            return
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{_blob_id(data)}"', "Accept-Ranges": "bytes"}
        start = 0
        if m := re.match(r"bytes=(\d+)-", req.headers.get("Range", "")):
            start = int(m.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        if not body:
            self._send(req, 200, b"", headers, length=len(data))
            return
        cut = self.cut_after.pop(file, None)
        req.send_response(206 if start else 200)
        for name, value in headers.items():
            req.send_header(name, value)
        req.send_header("Content-Length", str(len(part)))
        req.end_headers()
        if cut is not None:  # the transfer breaks off: part of the body, then the connection closes
            req.wfile.write(part[:cut])
            req.wfile.flush()
            req.close_connection = True
            return
        req.wfile.write(part)

    @staticmethod
    def _json(req: BaseHTTPRequestHandler, value: Any) -> None:
        HubStandIn._send(req, 200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    @staticmethod
    def _send(
        req: BaseHTTPRequestHandler,
        code: int,
        payload: bytes,
        headers: dict[str, str] | None = None,
        *,
        length: int | None = None,
    ) -> None:
        req.send_response(code)
        for name, value in (headers or {}).items():
            req.send_header(name, value)
        req.send_header("Content-Length", str(len(payload) if length is None else length))
        req.end_headers()
        if payload:
            req.wfile.write(payload)


def publish_for(model_id: str, sources: list[tuple[str, str, tuple[str, ...]]]) -> dict[str, Repo]:
    """Stand-in repositories for a config that names a model and ``hf:`` splits ((source, split, the
    record fields the run reads) triples): a model repository with a config and one small safetensors
    file, and per data set one JSONL file per split, named as the split (under the subset's folder for
    ``hf:<repo>:<subset>``), whose record holds those fields (dotted: nested). Enough for ``hpcrl fetch``
    to fill a cache the checks before submit accept, not a model that runs."""
    import numpy as np
    from safetensors.numpy import save

    weights = save({"w": np.zeros((2, 2), dtype=np.float32)})
    repos = {model_id: Repo({"config.json": b'{"model_type": "stand-in"}', "model.safetensors": weights})}
    for source, split, fields in sources:
        repo_id, _, subset = source.removeprefix("hf:").partition(":")
        name = f"{subset}/{split}.jsonl" if subset else f"{split}.jsonl"
        repo = repos.setdefault(repo_id, Repo({}, kind="dataset"))
        record: dict[str, Any] = {}
        for dotted in fields:
            _put(record, dotted.split("."), "2")
        repo.files[name] = json.dumps(record).encode() + b"\n"
    return repos


def _put(node: Any, path: list[str], value: str) -> None:
    """Set a dotted field (a number indexes a list) to ``value``, making the dicts and lists on the way."""
    for key, after in zip(path, [*path[1:], None], strict=True):
        empty: Any = value if after is None else [] if after.isdigit() else {}
        if isinstance(node, list):
            node.extend([None] * (int(key) + 1 - len(node)))
            node[int(key)] = node[int(key)] if node[int(key)] is not None and after else empty
            node = node[int(key)]
        else:
            node = node.setdefault(key, empty)
