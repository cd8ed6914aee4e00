"""A real `wcodec serve` process on the loopback, for the fault and load suite: start it on a free
port, read its resident memory, kill it (-9 included), and the statuses its OpenAPI schema
documents per route. Everything here talks to 127.0.0.1 only."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
QUIET = {"WCODEC_DEMO": "false", "WCODEC_PRELOAD": "[]", "WCODEC_LOG_LEVEL": "warning"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class ServerProcess:
    """`python -m wcodec serve --store STORE` as a child process; a context manager."""

    store: Path
    env: dict[str, str] = field(default_factory=dict)
    log: Path | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 120) -> ServerProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO), **QUIET, **self.env}
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL   # noqa: SIM115  (closed by the child's exit)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wcodec", "serve", "--store", str(self.store), "--host", HOST,
             "--port", str(self.port)], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.wait_health(timeout)
        return self

    def wait_health(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} (log: {self.log})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server did not answer /health in {timeout} s")

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def kill(self, sig: int = signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(30)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            return self.kill()

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def documented_statuses(schema: dict) -> dict[tuple[str, str], set[int]]:
    """(METHOD, path template) -> every status the OpenAPI schema documents (422: FastAPI's own)."""
    out = {}
    for path, item in schema["paths"].items():
        for method, op in item.items():
            out[(method.upper(), path)] = {int(code) for code in op.get("responses", {}) if code.isdigit()} | {422}
    return out


def route_of(method: str, path: str, templates: dict[tuple[str, str], set[int]]) -> tuple[str, str] | None:
    """The (METHOD, template) of a concrete request path, e.g. /models/x/load -> /models/{name}/load."""
    for m, template in templates:
        pattern = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$"
        if m == method and re.match(pattern, path.split("?")[0]):
            return m, template
    return None


def openapi(url: str) -> dict:
    return json.loads(httpx.get(f"{url}/openapi.json", timeout=30).text)
