"""A local HTTP server standing in for the Hugging Face hub (``HF_ENDPOINT``), for tests that must not reach the
network. No maintained package serves local repositories offline with the hub's API (``olah`` is a caching proxy
of an upstream hub; ``hf-local-hub`` is a client), so this is a small fixture of its own.

It speaks enough of the hub's HTTP API for ``huggingface_hub``, ``transformers`` and ``datasets``:

- repository info: ``GET /api/{models,datasets}/REPO[/revision/REV]`` (file list with sizes and blob ids, the
  commit sha, the card's metadata), ``/tree/REV[/PATH]``, ``POST /paths-info/REV``, ``/refs``;
- files: ``GET``/``HEAD /[datasets/]REPO/resolve/REV/PATH`` with the headers ``huggingface_hub`` checks
  (``ETag``, ``X-Repo-Commit``, ``Content-Length``) and byte ranges;
- revisions: branches, tags and full commit shas, each commit an immutable snapshot;
- access: a private repo answers 401 ``RepoNotFound`` and a gated one 401 ``GatedRepo`` to a request without a
  token (any bearer token is accepted); a missing repo 404 ``RepoNotFound``, a missing revision 404
  ``RevisionNotFound``, a missing file 404 ``EntryNotFound``;
- pushes: ``create_repo``, ``create_branch``, ``preupload`` (every file inline) and ``commit``, which becomes a
  real commit that can be downloaded again.

Every request is recorded in :attr:`HubServer.requests` (method, path, auth) so tests can assert on what was asked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class Repo:
    """A repository: commits (sha -> {path: bytes}), refs (branch or tag name -> sha) and its access rules."""

    private: bool = False
    gated: bool = False
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    tags: set[str] = field(default_factory=set)

    def commit(self, files: dict[str, bytes], branch: str = "main", parent: str | None = None) -> str:
        """A new commit on ``branch``: the files of ``parent`` (else the branch head) updated with ``files``."""
        base = dict(self.commits.get(parent or self.refs.get(branch, ""), {}))
        base.update(files)
        digest = hashlib.sha1(json.dumps(sorted((p, _oid(c)) for p, c in base.items())).encode())
        digest.update(str(len(self.commits)).encode())
        sha = digest.hexdigest()
        self.commits[sha] = base
        self.refs[branch] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def _oid(content: bytes) -> str:
    """The git blob id of ``content`` (what the hub reports as a file's ``blobId`` and ``ETag``)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def folder_files(folder: str | Path) -> dict[str, bytes]:
    """The files under ``folder`` as ``{relative path: bytes}`` (hidden files left out)."""
    folder = Path(folder)
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    }


class HubServer:
    """The local hub: ``add_repo`` serves files, ``url`` goes into ``HF_ENDPOINT``, ``requests`` records calls."""

    def __init__(self):
        self.requests: list[dict] = []
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes] | str | Path,
        repo_type: str = "model",
        branch: str = "main",
        tag: str | None = None,
        private: bool = False,
        gated: bool = False,
    ) -> str:
        """Commit ``files`` (a dict or a folder) to ``repo_id`` (created if new); returns the commit sha. ``tag``
        names the commit as well."""
        files = files if isinstance(files, dict) else folder_files(files)
        with self.lock:
            repo = self.repos.setdefault((repo_type, repo_id), Repo(private=private, gated=gated))
            sha = repo.commit({k: v if isinstance(v, bytes) else v.encode() for k, v in files.items()}, branch)
            if tag:
                repo.refs[tag] = sha
                repo.tags.add(tag)
        return sha

    def downloads(self, since: int = 0) -> list[str]:
        """Paths of the file contents served (GET on ``resolve``) since request number ``since``."""
        return [r["path"] for r in self.requests[since:] if r["method"] == "GET" and "/resolve/" in r["path"]]

    def committed_files(self) -> list[str]:
        """Paths of the files in the last recorded commit (its NDJSON body)."""
        commit = [r for r in self.requests if "/commit/" in r["path"]][-1]
        lines = [json.loads(line) for line in commit["body"].decode().splitlines() if line.strip()]
        return sorted(line["value"]["path"] for line in lines if line.get("key") == "file")


_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}


def _handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        # -- replies -------------------------------------------------------------------------------------------
        def _send(self, code: int, body: bytes, headers: dict | None = None, head: bool = False):
            if getattr(self, "recorded", None) is not None:
                self.recorded["status"] = code
            self.send_response(code)
            for key, value in (headers or {}).items():
                self.send_header(key, str(value))
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, body, code: int = 200, headers: dict | None = None):
            self._send(code, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _error(self, code: int, error_code: str, message: str, head: bool = False):
            headers = {"Content-Type": "application/json", "X-Error-Code": error_code, "X-Error-Message": message}
            self._send(code, json.dumps({"error": message}).encode(), headers, head=head)

        # -- routing -------------------------------------------------------------------------------------------
        def _record(self, body: bytes = b""):
            self.recorded = {"method": self.command, "path": self.path, "auth": self.headers.get("authorization")}
            self.recorded["body"] = body
            server.requests.append(self.recorded)  # its "status" is filled in when the answer is sent

        def _repo(self, repo_type: str, repo_id: str, head: bool = False) -> Repo | None:
            """The repo if this request may see it, else None after answering the hub's error."""
            repo = server.repos.get((repo_type, repo_id))
            authorized = bool(self.headers.get("authorization"))
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository not found: {repo_id}", head)
            elif repo.private and not authorized:
                self._error(401, "RepoNotFound", "Invalid username or password.", head)
            elif repo.gated and not authorized:
                message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
                self._error(401, "GatedRepo", message, head)
            else:
                return repo
            return None

        def _commit(self, repo: Repo, revision: str, head: bool = False) -> str | None:
            sha = repo.resolve(unquote(revision))
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}", head)
            return sha

        def do_HEAD(self):
            self._record()
            self._get(head=True)

        def do_GET(self):
            self._record()
            self._get(head=False)

        def _get(self, head: bool):
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            query = parse_qs(url.query)
            if "resolve" in parts:
                return self._resolve(parts, head)
            if len(parts) >= 3 and parts[0] == "api" and parts[1] in _TYPES:
                repo_type, repo_id, rest = _TYPES[parts[1]], "/".join(parts[2:4]), parts[4:]
                repo = self._repo(repo_type, repo_id, head)
                if repo is None:
                    return
                if not rest or rest[0] == "revision":
                    sha = self._commit(repo, rest[1] if len(rest) > 1 else "main", head)
                    if sha is not None:
                        self._json(self._info(repo_type, repo_id, repo, sha))
                    return
                if rest[0] == "tree":
                    sha = self._commit(repo, rest[1], head)
                    if sha is not None:
                        recursive = query.get("recursive", ["false"])[0].lower() == "true"
                        self._json(self._tree(repo.commits[sha], "/".join(rest[2:]), recursive))
                    return
                if rest[0] == "refs":
                    kinds = {"branches": [], "tags": []}
                    for name, sha in repo.refs.items():
                        kind = "tags" if name in repo.tags else "branches"
                        ref = f"refs/{'tags' if kind == 'tags' else 'heads'}/{name}"
                        kinds[kind].append({"name": name, "ref": ref, "targetCommit": sha})
                    return self._json({**kinds, "converts": []})
            self._error(404, "NotEmulated", f"not emulated by the test hub: {self.path}", head)

        def _resolve(self, parts: list[str], head: bool):
            at = parts.index("resolve")
            repo_type = "dataset" if parts[0] == "datasets" else "model"
            repo_id = "/".join(parts[1 if repo_type == "dataset" else 0 : at])
            repo = self._repo(repo_type, repo_id, head)
            if repo is None:
                return
            sha = self._commit(repo, parts[at + 1], head)
            if sha is None:
                return
            path = "/".join(parts[at + 2 :])
            content = repo.commits[sha].get(path)
            if content is None:
                return self._error(404, "EntryNotFound", f"Entry not found: {path}", head)
            headers = {"ETag": f'"{_oid(content)}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
            headers["Content-Type"] = "application/octet-stream"
            ranges = self.headers.get("Range")
            if ranges and ranges.startswith("bytes=") and not head:
                start, _, end = ranges[len("bytes=") :].partition("-")
                start, end = int(start or 0), min(int(end) if end else len(content) - 1, len(content) - 1)
                headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
                return self._send(206, content[start : end + 1], headers)
            headers["Content-Length"] = len(content)
            self._send(200, content, headers, head=head)

        def _info(self, repo_type: str, repo_id: str, repo: Repo, sha: str) -> dict:
            files = repo.commits[sha]
            card = _card_data(files.get("README.md", b""))
            siblings = [{"rfilename": p, "size": len(c), "blobId": _oid(c)} for p, c in sorted(files.items())]
            return {
                "id": repo_id,
                "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
                "sha": sha,
                "private": repo.private,
                "gated": "auto" if repo.gated else False,
                "disabled": False,
                "siblings": siblings,
                "cardData": card,
                "tags": [],
                "lastModified": "2025-01-01T00:00:00.000Z",
                "createdAt": "2025-01-01T00:00:00.000Z",
                **({"library_name": "transformers"} if repo_type == "model" else {}),
            }

        @staticmethod
        def _tree(files: dict[str, bytes], prefix: str, recursive: bool) -> list[dict]:
            prefix = prefix.strip("/")
            entries, folders = [], set()
            for path, content in sorted(files.items()):
                if prefix and not path.startswith(prefix + "/"):
                    continue
                rest = path[len(prefix) + 1 :] if prefix else path
                pieces = rest.split("/")
                for depth in range(1, len(pieces)):
                    folder = "/".join(([prefix] if prefix else []) + pieces[:depth])
                    if folder not in folders and (recursive or depth == 1):
                        folders.add(folder)
                        entries.append({"type": "directory", "oid": _oid(folder.encode()), "size": 0, "path": folder})
                if recursive or len(pieces) == 1:
                    entries.append({"type": "file", "oid": _oid(content), "size": len(content), "path": path})
            return entries

        # -- pushes --------------------------------------------------------------------------------------------
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._record(body)
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            if url.path == "/api/repos/create":
                payload = json.loads(body)
                repo_id = "/".join(filter(None, [payload.get("organization"), payload["name"]]))
                repo_type = payload.get("type") or "model"
                with server.lock:
                    if (repo_type, repo_id) not in server.repos:
                        repo = server.repos[(repo_type, repo_id)] = Repo(private=bool(payload.get("private")))
                        repo.commit({".gitattributes": b""})
                    else:  # the hub names the existing repo in its 409 answer (huggingface_hub reads its url)
                        message = "You already created this model repo"
                        body = {"error": message, "url": f"{server.url}/{repo_id}"}
                        return self._json(body, 409, {"X-Error-Code": "RepoExists", "X-Error-Message": message})
                return self._json({"url": f"{server.url}/{repo_id}", "name": repo_id})
            if url.path == "/api/validate-yaml":  # the model card's metadata
                return self._json({"errors": [], "warnings": []})
            if len(parts) >= 6 and parts[0] == "api" and parts[1] in _TYPES:
                repo_type, repo_id, action = _TYPES[parts[1]], "/".join(parts[2:4]), parts[4]
                repo = self._repo(repo_type, repo_id)
                if repo is None:
                    return
                if action == "preupload":
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    return self._json({"files": modes, "commitOid": repo.refs.get("main")})
                if action == "branch":
                    with server.lock:
                        if parts[5] not in repo.refs:
                            start = json.loads(body or b"{}").get("startingPoint") or "main"
                            repo.refs[parts[5]] = repo.resolve(start)
                    return self._json({})
                if action == "commit":
                    return self._commit_files(repo, repo_id, parts[5], body)
                if action == "paths-info":
                    sha = self._commit(repo, parts[5])
                    if sha is None:
                        return
                    form = parse_qs(body.decode())
                    files = repo.commits[sha]
                    wanted = form.get("paths", [])
                    return self._json([e for e in self._tree(files, "", True) if e["path"] in wanted])
            self._error(404, "NotEmulated", f"not emulated by the test hub: {self.path}")

        def _commit_files(self, repo: Repo, repo_id: str, branch: str, body: bytes):
            files = {}
            for line in body.decode().splitlines():
                entry = json.loads(line) if line.strip() else {}
                if entry.get("key") == "file":
                    value = entry["value"]
                    files[value["path"]] = base64.b64decode(value["content"])
            with server.lock:
                sha = repo.commit(files, branch)
            return self._json({"commitUrl": f"{server.url}/{repo_id}/commit/{sha}", "commitOid": sha})

    return Handler


def _card_data(readme: bytes) -> dict | None:
    """The YAML metadata of a model card (what the hub returns as ``cardData``)."""
    text = readme.decode(errors="replace")
    if not text.startswith("---"):
        return None
    import yaml

    return yaml.safe_load(text.split("---", 2)[1]) or None


def no_hub_login(monkeypatch, tmp_path):
    """Hide any hub token of the machine running the tests (environment and cached login)."""
    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
