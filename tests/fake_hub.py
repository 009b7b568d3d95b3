"""A local HTTP server that imitates the Hugging Face hub endpoints huggingface_hub uses to
download a file (HF_ENDPOINT points at it): model info with file metadata, HEAD/GET resolve with
Range support. It can cut a download short (to test resuming) and serve corrupted bytes (to
test verification). The hub is outside the product, so imitating it is fair."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.cut_after: dict[str, int] = {}      # file -> bytes to send before dropping (once)
        self.corrupt: set[str] = set()
        self.stall_after: dict[str, int] = {}    # file -> bytes to send, then hang until released
        self.stalled = threading.Event()          # set once a stalled transfer is hanging
        self.release = threading.Event()
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub._serve(self, head=True)

            def do_GET(self):
                hub._serve(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, repo: str, files: dict[str, bytes], sha: str = "a" * 40) -> None:
        self.repos[repo] = {"sha": sha, "files": files}

    def close(self) -> None:
        self.server.shutdown()

    def _json(self, h, obj, status=200):
        body = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _serve(self, h, head: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append((h.command, path, h.headers.get("Range") or h.headers.get("range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            repo = "/".join(parts[2:4])
            r = self.repos.get(repo)
            if r is None:
                return self._json(h, {"error": "Repository not found"}, 404)
            siblings = [{"rfilename": n, "size": len(b),
                         "lfs": {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134}}
                        for n, b in r["files"].items()]
            return self._json(h, {"id": repo, "modelId": repo, "sha": r["sha"], "siblings": siblings, "private": False})
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            r = self.repos.get(repo)
            if r is None or name not in r["files"]:
                h.send_response(404)
                h.send_header("X-Error-Code", "EntryNotFound")
                h.end_headers()
                return
            data = r["files"][name]
            if name in self.corrupt:
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            start = 0
            rng = h.headers.get("Range")
            if rng and rng.startswith("bytes="):
                start = int(rng[6:].split("-")[0])
            sha = hashlib.sha256(r["files"][name]).hexdigest()
            h.send_response(206 if start else 200)
            h.send_header("X-Repo-Commit", r["sha"])
            h.send_header("ETag", f'"{sha}"')
            h.send_header("X-Linked-Etag", f'"{sha}"')
            h.send_header("X-Linked-Size", str(len(data)))
            h.send_header("Content-Length", str(len(data) - start))
            if start:
                h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            h.send_header("Accept-Ranges", "bytes")
            h.end_headers()
            if head:
                return
            body = data[start:]
            stall = self.stall_after.pop(name, None)
            if stall is not None:
                h.wfile.write(body[:stall])
                h.wfile.flush()
                self.stalled.set()
                self.release.wait(60)
                h.close_connection = True
                return
            cut = self.cut_after.pop(name, None)
            if cut is not None:
                h.wfile.write(body[:cut])
                h.wfile.flush()
                h.close_connection = True
                h.connection.shutdown(2)
                return
            h.wfile.write(body)
            return
        h.send_response(404)
        h.end_headers()
