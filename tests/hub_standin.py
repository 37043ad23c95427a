"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, answering the requests huggingface_hub makes to
fetch a data set's files: the revision (``dataset_info``), the paged tree listing (``list_repo_tree``) and the
files (``hf_hub_download``: a HEAD for the commit, ETag and size, then a GET). Nothing leaves the machine.

``trees`` maps a commit to its files (path -> bytes); paths ending in ``.parquet`` are LFS files (listed with
their SHA-256, as the Hub lists large files), the others small git blobs. ``served`` overrides the bytes a
commit's file is served with (a corrupted download: the headers still name the listed file). ``asked``
records each request as ``"METHOD path"``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PAGE = 2  # tree entries per page, so that a listing of a few files already needs the Link header's next page


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandIn:
    def __init__(self, repo_id: str):
        self.repo_id = repo_id
        self.refs: dict[str, str] = {}  # branch, tag or commit -> commit
        self.trees: dict[str, dict[str, bytes]] = {}
        self.served: dict[tuple[str, str], bytes] = {}
        self.asked: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def listing(self, commit: str, folder: str) -> list[dict]:
        """The tree at ``commit`` under ``folder``, recursive, in the Hub's JSON: folders, then files."""
        files = {p: b for p, b in self.trees[commit].items() if not folder or p.startswith(folder + "/")}
        folders = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
        folders = [f for f in folders if not folder or f.startswith(folder + "/")]
        entries = [{"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()} for f in folders]
        for path, data in sorted(files.items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
            if path.endswith(".parquet"):
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}"
                entry["oid"] = git_blob_sha1(pointer.encode())
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # no request lines on the test's stderr
                pass

            def do_GET(self):
                self.answer(body=True)

            def do_HEAD(self):
                self.answer(body=False)

            def answer(self, body: bool) -> None:
                url = urllib.parse.urlsplit(self.path)
                path = urllib.parse.unquote(url.path)
                hub.asked.append(f"{self.command} {path}")
                api, files = f"/api/datasets/{hub.repo_id}/", f"/datasets/{hub.repo_id}/resolve/"
                if path.startswith(api + "revision/"):
                    revision = path[len(api + "revision/") :]
                    if revision not in hub.refs:
                        return self.send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
                    info = {"id": hub.repo_id, "sha": hub.refs[revision], "private": False}
                    return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
                if path.startswith(api + "tree/"):
                    commit, _, folder = path[len(api + "tree/") :].partition("/")
                    if commit not in hub.trees:
                        return self.send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
                    entries = hub.listing(commit, folder)
                    start = int(urllib.parse.parse_qs(url.query).get("cursor", ["0"])[0])
                    headers = {"Content-Type": "application/json"}
                    if start + PAGE < len(entries):  # the next page, as the Hub (and GitHub) give it
                        following = f"{hub.url}{url.path}?recursive=true&cursor={start + PAGE}"
                        headers["Link"] = f'<{following}>; rel="next"'
                    return self.send(200, json.dumps(entries[start : start + PAGE]).encode(), headers, body)
                if path.startswith(files):
                    commit, _, name = path[len(files) :].partition("/")
                    if name not in hub.trees.get(commit, {}):
                        return self.send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
                    listed = hub.trees[commit][name]
                    data = hub.served.get((commit, name), listed)
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(listed)}"'}
                    if name.endswith(".parquet"):  # an LFS file: the Hub names it by its SHA-256 and size
                        headers["X-Linked-Etag"] = f'"{hashlib.sha256(listed).hexdigest()}"'
                        headers["X-Linked-Size"] = str(len(listed))
                    return self.send(200, data, headers, body)
                return self.send(404, b"not a Hub endpoint")

            def send(self, status: int, data: bytes, headers: dict | None = None, body: bool = True) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler
