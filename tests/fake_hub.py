"""A local, Hub-compatible file server for tests: `HF_ENDPOINT` points at it, nothing leaves the machine.

It answers what huggingface_hub 2.x asks while downloading (read from its source: hf_api.model_info,
hf_api.list_repo_tree, file_download.get_hf_file_metadata and http_get):

- GET  /api/models/{repo}[/revision/{rev}]  model info: id, sha, siblings (with sizes), gated
- GET  /api/models/{repo}/tree/{rev}        the file listing snapshot_download caches
- HEAD /{repo}/resolve/{rev}/{file}         X-Repo-Commit, ETag, Content-Length
- GET  /{repo}/resolve/{rev}/{file}         the bytes; `Range: bytes=N-` answered with 206

and the Hub's refusals: X-Error-Code RepoNotFound with 401 (no token: it could be private) or 404; 404
with RevisionNotFound or EntryNotFound; GatedRepo with 401 (no token) or 403 (a token without access).

Knobs for failure cases: `drop_once` (file names whose first full GET sends half the bytes and
closes the connection), `fail` (file names whose GET answers 500 while they are listed;
huggingface_hub does not retry that), `down` (every request answers 503), `slow` (file names whose
whole-file GET trickles out in 256 KiB pieces a few milliseconds apart, so a client can be killed
in the middle).
`requests` records (method, path, Range header) of everything asked.

    with FakeHub() as hub:
        hub.add_repo("acme/tiny", model_dir)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class _Repo:
    def __init__(self, repo_id: str, root: Path, gated: bool, tokens: set[str]):
        self.repo_id, self.root, self.gated, self.tokens = repo_id, Path(root), gated, tokens
        files = sorted(p for p in self.root.rglob("*") if p.is_file())
        self.files = {p.relative_to(self.root).as_posix(): p for p in files}
        digest = hashlib.sha1(repo_id.encode())
        for name, path in self.files.items():
            digest.update(name.encode() + hashlib.sha1(path.read_bytes()).digest())
        self.sha = digest.hexdigest()

    def etag(self, name: str) -> str:
        return hashlib.sha256(self.files[name].read_bytes()).hexdigest()


class FakeHub:
    """A threaded http.server serving repositories from local directories (see the module docstring)."""

    def __init__(self):
        self.repos: dict[str, _Repo] = {}
        self.drop_once: set[str] = set()
        self.fail: set[str] = set()
        self.slow: set[str] = set()
        self.down = False
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
        )

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_repo(self, repo_id: str, root: Path, *, gated: bool = False, tokens: set[str] | None = None) -> str:
        """Serve directory `root` as `repo_id`; returns its commit sha. A gated repo accepts only `tokens`."""
        repo = _Repo(repo_id, root, gated, tokens or set())
        self.repos[repo_id] = repo
        return repo.sha

    def gets(self, file: str | None = None) -> list[tuple[str, str, str | None]]:
        """The GET requests of resolve URLs (of `file` only, when given)."""
        return [
            r
            for r in self.requests
            if r[0] == "GET" and "/resolve/" in r[1] and (file is None or r[1].endswith("/" + file))
        ]

    # ---------------------------------------------------------------- handling
    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self._lock:
            self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        if self.down:
            return self._error(h, 503, None, head)
        api, resolve = _API.match(path), _RESOLVE.match(path)
        match = api or resolve
        if match is None:
            return self._error(h, 404, "EntryNotFound", head)
        repo = self.repos.get(match["repo"])
        token = (h.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if repo is None:  # as the Hub: 401 without a token (it could be private), 404 with one
            return self._error(h, 404 if token else 401, "RepoNotFound", head)
        rev = match["rev"] or "main"
        if rev not in ("main", repo.sha):
            return self._error(h, 404, "RevisionNotFound", head)
        if api is not None:
            if api["kind"] == "tree":
                body = [
                    {"type": "file", "path": n, "size": p.stat().st_size, "oid": repo.etag(n)[:40]}
                    for n, p in repo.files.items()
                ]
            else:
                body = {
                    "id": repo.repo_id,
                    "sha": repo.sha,
                    "private": False,
                    "gated": "manual" if repo.gated else False,
                    "siblings": [
                        {"rfilename": n, "size": p.stat().st_size, "blobId": repo.etag(n)[:40]}
                        for n, p in repo.files.items()
                    ],
                }
            return self._send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
        if repo.gated:
            if token not in repo.tokens:
                return self._error(h, 403 if token else 401, "GatedRepo", head)
        name = resolve["file"]
        if name not in repo.files:
            return self._error(h, 404, "EntryNotFound", head, commit=repo.sha)
        if name in self.fail and not head:
            return self._error(h, 500, None, head)
        data = repo.files[name].read_bytes()
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{repo.etag(name)}"', "Accept-Ranges": "bytes"}
        if head:
            return self._send(h, 200, b"", {**headers, "Content-Length": str(len(data))}, head=True)
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range") or "")
        if ranged:
            start = int(ranged[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        elif name in self.drop_once:  # half the file, then the connection goes away
            self.drop_once.discard(name)
            h.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return None
        elif name in self.slow:
            h.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                h.send_header(k, v)
            h.end_headers()
            try:
                for at in range(0, len(data), 256 * 1024):
                    h.wfile.write(data[at : at + 256 * 1024])
                    h.wfile.flush()
                    time.sleep(0.02)
            except OSError:  # the client went away (the point of the knob)
                h.close_connection = True
            return None
        return self._send(h, 206 if ranged else 200, data[start:], headers, head=False)

    @staticmethod
    def _send(h, status: int, body: bytes, headers: dict, head: bool) -> None:
        h.send_response(status)
        headers.setdefault("Content-Length", str(len(body)))
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _error(self, h, status: int, code: str | None, head: bool, commit: str | None = None) -> None:
        headers = {"Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        body = json.dumps({"error": code or "unavailable"}).encode()
        self._send(h, status, body, headers, head)


HF_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")


def point_hf_at(monkeypatch, hub: FakeHub, home: Path) -> None:
    """The test's huggingface_hub talks to `hub` only: HF_ENDPOINT at it, HF_HOME at `home`, no token,
    online, the default cache."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(home))
    for name in HF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
