"""A Hugging Face hub on loopback, as huggingface_hub talks to it (HF_ENDPOINT): the tree
listing with LFS checksums, HEAD and GET of ``/REPO/resolve/REV/FILE`` with ranges. Faults
on request: a download cut after N bytes, a file served with other bytes than listed."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "a" * 40


@dataclass
class Hub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    cut_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before the first GET drops
    corrupt: set[str] = field(default_factory=set)  # paths served with one byte changed
    ranges: list[tuple[str, int]] = field(default_factory=list)  # (path, first byte) of each ranged GET
    gets: list[str] = field(default_factory=list)
    url: str = ""


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _file(self) -> tuple[str, str, bytes] | None:
            parts = unquote(urlparse(self.path).path).lstrip("/").split("/")
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                data = hub.repos.get(repo, {}).get(name)
                if data is not None:
                    return repo, name, data
            return None

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _file_headers(self, name: str, data: bytes) -> dict[str, str]:
            sha = hashlib.sha256(data).hexdigest()
            return {
                "X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{sha}"', "ETag": f'"{sha}"',
                "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes",
            }

        def do_HEAD(self) -> None:  # noqa: N802
            found = self._file()
            if found is None:
                self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
                return
            _, name, data = found
            self._send(200, b"", self._file_headers(name, data))

        def do_GET(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            parts = unquote(url.path).lstrip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                repo = "/".join(parts[2:4])
                if repo not in hub.repos:
                    self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                    return
                entries = [
                    {"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                     "lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                    for p, d in sorted(hub.repos[repo].items())
                ]
                self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})
                return
            found = self._file()
            if found is None:
                self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
                return
            _, name, data = found
            hub.gets.append(name)
            if name in hub.corrupt:
                data = bytes([data[0] ^ 1]) + data[1:]
            start = 0
            header = self.headers.get("Range", "")
            if header.startswith("bytes="):
                start = int(header[6:].split("-")[0] or 0)
                hub.ranges.append((name, start))
            headers = self._file_headers(name, data)
            body = data[start:]
            cut = hub.cut_after.pop(name, None)
            self.send_response(206 if start else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if cut is not None:  # the connection drops mid-file
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(body)

    return Handler


@contextmanager
def fake_hub(hub: Hub) -> Iterator[Hub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
