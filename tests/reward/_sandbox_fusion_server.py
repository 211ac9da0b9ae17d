"""A small real Sandbox Fusion stand-in for the tests: ``POST /run_code`` over HTTP on
127.0.0.1, running the code with megarl's own local runner (the OS sandbox, rlimits).

It answers as Sandbox Fusion does for Python (no compile step): ``status`` ``Success`` when the
program finished with exit code 0, else ``Failed``; ``run_result`` ``{status: Finished |
TimeLimitExceeded, return_code, stdout, stderr, execution_time}``; ``SandboxError`` for a
language other than python. ``answers`` queues canned replies for the next requests (an int: that
HTTP status with an empty body; a dict: that JSON reply). It records every request and the most
requests it ever ran at once.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from megarl.reward.scorers.code_runner import run_child


class SandboxFusionServer:
    """``with SandboxFusionServer() as server:`` serves ``server.url`` in a thread."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.answers: list[int | dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/run_code"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()

    def reply(self, request: dict[str, Any]) -> int | dict[str, Any]:
        with self._lock:
            self.requests.append(request)
            if self.answers:
                return self.answers.pop(0)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.delay_s)
            return run_code(request)
        finally:
            with self._lock:
                self.in_flight -= 1


def run_code(request: dict[str, Any]) -> dict[str, Any]:
    """Sandbox Fusion's answer to one ``/run_code`` request (Python only)."""
    if request.get("language") != "python":
        return {"status": "SandboxError", "message": f"unsupported language {request['language']}"}
    start = time.monotonic()
    child = run_child(
        [sys.executable, "-I", "main.py"],
        {"main.py": request["code"]},
        request.get("stdin") or "",
        timeout_s=float(request["run_timeout"]),
        memory_limit_mb=int(request["memory_limit_MB"]),
        keep_stderr=True,
    )
    ran = {
        "status": "Finished" if child.finished else "TimeLimitExceeded",
        "return_code": child.returncode if child.finished else None,
        "stdout": child.stdout,
        "stderr": child.stderr,
        "execution_time": time.monotonic() - start,
    }
    ok = child.finished and child.returncode == 0
    return {
        "status": "Success" if ok else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": ran,
    }


def _handler(server: SandboxFusionServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            if self.path != "/run_code":
                self.send_error(404)
                return
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            answer = server.reply(json.loads(body))
            if isinstance(answer, int):
                self.send_response(answer)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler
