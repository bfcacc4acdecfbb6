"""A small Hugging Face Hub on 127.0.0.1 port 0: just the routes `huggingface_hub.snapshot_download`
uses (repo info, tree listing, file resolve), serving repos held in memory, and a log of every
request it saw. No xet headers are sent, so downloads take the plain HTTP path."""

from __future__ import annotations

import hashlib
import json
import re
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import pytest

REGISTRY_PATH = "/api/agent-harnesses"
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


@dataclass(frozen=True)
class FakeRepo:
    """One model repo at one commit: file name -> bytes."""

    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"

    def git_oid(self, name: str) -> str:
        return hashlib.sha1(self.files[name]).hexdigest()


@dataclass
class FakeHub:
    """Serve `repos` ("owner/name" -> FakeRepo) until `stop()`; `requests` holds "METHOD /path" lines."""

    repos: dict[str, FakeRepo]
    requests: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "the fake hub is not running"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-hub",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def paths(self) -> list[str]:
        """The repo request paths (query strings dropped), in arrival order. Left out: the agent
        registry huggingface_hub fetches at most once a process, best effort (`/api/agent-harnesses`)."""
        paths = [line.split(" ", 1)[1].split("?", 1)[0] for line in self.requests]
        return [path for path in paths if path != REGISTRY_PATH]


def _handler_class(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._answer(send_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(send_body=False)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - keep test output quiet
            return

        def _answer(self, send_body: bool) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            status, headers, body = _route(hub, unquote(urlsplit(self.path).path))
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(name, value)
            self.end_headers()
            if send_body:
                self.wfile.write(body)

    return Handler


Answer = tuple[int, dict[str, str], bytes]


def _route(hub: FakeHub, path: str) -> Answer:
    if m := _TREE.match(path):
        return _with_repo(hub, m["repo"], lambda repo: _json(_tree(repo)))
    if m := _INFO.match(path):
        return _with_repo(hub, m["repo"], lambda repo: _json(_info(m["repo"], repo)))
    if m := _RESOLVE.match(path):
        return _with_repo(hub, m["repo"], lambda repo: _file(repo, m["file"]))
    return 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "not found"}'


def _with_repo(hub: FakeHub, repo_id: str, answer: Callable[[FakeRepo], Answer]) -> Answer:
    repo = hub.repos.get(repo_id)
    if repo is None:  # what the real hub says for a repo it does not know
        return 401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b"{}"
    return answer(repo)


def _info(repo_id: str, repo: FakeRepo) -> dict[str, object]:
    siblings = [{"rfilename": name} for name in sorted(repo.files)]
    return {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False, "siblings": siblings, "tags": []}


def _tree(repo: FakeRepo) -> list[dict[str, object]]:
    return [{"type": "file", "path": name, "size": len(data), "oid": repo.git_oid(name)}
            for name, data in sorted(repo.files.items())]


def _file(repo: FakeRepo, name: str) -> Answer:
    if name not in repo.files:
        return 404, {"X-Error-Code": "EntryNotFound"}, b"{}"
    headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{repo.git_oid(name)}"',
               "Content-Type": "application/octet-stream"}
    return 200, headers, repo.files[name]


def _json(value: object) -> Answer:
    return 200, {"Content-Type": "application/json"}, json.dumps(value).encode()


@contextlib.contextmanager
def hub_serving(repos: dict[str, FakeRepo], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A FakeHub on 127.0.0.1 with `repos`, huggingface_hub in this process pointed at it (it read
    HF_ENDPOINT at import, so its constants are patched too); stopped on exit."""
    from huggingface_hub import constants

    hub = FakeHub(repos).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    try:
        yield hub
    finally:
        hub.stop()
