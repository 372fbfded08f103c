"""A local HTTP server standing in for the Hugging Face hub endpoint (``HF_ENDPOINT``): it answers the calls that
``huggingface_hub`` makes to create a repo and commit a folder, and records every request."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubServer:
    def __init__(self):
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, body: dict, code: int = 200):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append({"path": self.path, "auth": self.headers.get("authorization"), "body": body})
                if self.path == "/api/repos/create":
                    payload = json.loads(body)
                    return self._reply({"url": f"{server.url}/{payload.get('organization')}/{payload['name']}"})
                if self.path == "/api/validate-yaml":  # the model card's metadata
                    return self._reply({"errors": [], "warnings": []})
                if "/preupload/" in self.path:
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    return self._reply({"files": modes})
                if "/commit/" in self.path:
                    repo = self.path.split("/api/models/")[1].split("/commit/")[0]
                    return self._reply({"commitUrl": f"{server.url}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})
                return self._reply({"error": f"not emulated: {self.path}"}, 404)

            def do_GET(self):
                server.requests.append({"path": self.path, "auth": self.headers.get("authorization"), "body": b""})
                return self._reply({"error": f"not emulated: {self.path}"}, 404)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()

    def committed_files(self) -> list[str]:
        """Paths of the files in the recorded commit (its NDJSON body)."""
        commit = next(r for r in self.requests if "/commit/" in r["path"])
        lines = [json.loads(line) for line in commit["body"].decode().splitlines() if line.strip()]
        return sorted(line["value"]["path"] for line in lines if line.get("key") == "file")


def no_hub_login(monkeypatch, tmp_path):
    """Hide any hub token of the machine running the tests (environment and cached login)."""
    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
