"""A Hugging Face Hub on loopback: the few endpoints huggingface_hub calls to download a repo,
answering as the real hub does (read from huggingface_hub's snapshot_download, hf_hub_download
and HfApi.repo_info / list_repo_tree), serving model folders from disk.

- GET  /api/models/{org}/{name}[/revision/{rev}][?blobs=true] repo info: sha, siblings (sizes)
- GET  /api/models/{org}/{name}/tree/{rev}?recursive=...      the file listing
- HEAD /{org}/{name}/resolve/{rev}/{file}                     ETag, X-Repo-Commit, Content-Length
- GET  /{org}/{name}/resolve/{rev}/{file}                     the bytes, in small timed chunks
A repo or file it does not have answers 404 with the hub's X-Error-Code, so huggingface_hub
raises RepositoryNotFoundError / EntryNotFoundError as it would against huggingface.co.

Point a process at it with HF_ENDPOINT=url, set before huggingface_hub is imported there (its
URL template is built at import time), i.e. in a subprocess's environment.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
CHUNK = 64 << 10


@dataclass
class HubRepo:
    folder: Path
    commit: str

    def files(self) -> dict[str, bytes]:
        return {file.name: file.read_bytes() for file in sorted(self.folder.iterdir())
                if file.is_file()}


class FakeHub:
    def __init__(self, chunk_delay: float = 0.0) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.chunk_delay = chunk_delay  # seconds between 64 KiB chunks: a visible progress bar
        self.requests: list[str] = []

    def add(self, repo_id: str, folder: Path) -> None:
        commit = hashlib.sha1(f"{repo_id}:{folder}".encode()).hexdigest()
        self.repos[repo_id] = HubRepo(folder, commit)

    def find(self, repo_id: str, revision: str) -> HubRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None or revision not in ("main", repo.commit):
            return None
        return repo


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: object) -> None:
            return None

        def _json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _missing(self, code: str, message: str) -> None:
            self._json(404, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            if match := _INFO.match(path):
                repo = hub.find(match.group(1), match.group(2) or "main")
                if repo is None:
                    return self._missing("RepoNotFound", "Repository not found")
                siblings = [{"rfilename": name, "size": len(data),
                             "blobId": hashlib.sha1(data).hexdigest()}
                            for name, data in repo.files().items()]
                return self._json(200, {"id": match.group(1), "modelId": match.group(1),
                                        "sha": repo.commit, "private": False,
                                        "siblings": siblings})
            if match := _TREE.match(path):
                repo = hub.find(match.group(1), match.group(2))
                if repo is None:
                    return self._missing("RepoNotFound", "Repository not found")
                return self._json(200, [{"type": "file", "path": name, "size": len(data),
                                         "oid": hashlib.sha1(data).hexdigest()}
                                        for name, data in repo.files().items()])
            if match := _RESOLVE.match(path):
                repo = hub.find(match.group(1), match.group(2))
                if repo is None:
                    return self._missing("RepoNotFound", "Repository not found")
                data = repo.files().get(match.group(3))
                if data is None:
                    return self._missing("EntryNotFound", "Entry not found")
                return self._file(repo, data)
            return self._missing("RepoNotFound", f"no route {path}")

        def _file(self, repo: HubRepo, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", repo.commit)
            self.end_headers()
            if self.command == "HEAD":
                return
            for start in range(0, len(data), CHUNK):
                self.wfile.write(data[start:start + CHUNK])
                self.wfile.flush()
                if hub.chunk_delay:
                    time.sleep(hub.chunk_delay)

    return Handler


@contextmanager
def fake_hub(chunk_delay: float = 0.0) -> Iterator[tuple[str, FakeHub]]:
    """(base URL, the hub to add repos to), served until the block ends."""
    hub = FakeHub(chunk_delay)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hub
    finally:
        server.shutdown()
        server.server_close()
