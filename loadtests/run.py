"""A headless, bounded load run: loopback only, a fixed number of users for a fixed time.

    python -m loadtests.run --users 32 --duration 120                 # serves the demo model itself
    python -m loadtests.run --users 32 --duration 120 --checkout /tmp/base   # the same, older code
    python -m loadtests.run --host http://127.0.0.1:8000 --scenario mix --users 8 --duration 30

Without --host it starts `python -m wcodec serve` from --checkout (default: this one) on a free
loopback port over --store (an empty store gets the demo model), waits for /health/ready, runs,
and stops it. Users start together; after --duration they start no new request, and the run
waits (at most --drain seconds) for the requests in flight. It prints, and with --json writes:

    latency p50/p99   of the requests started within the duration, each to its last byte
    TTFT p50/p99      streams: from the request to its first token
    tokens/s          tokens received within the duration / the duration
    errors            everything but 200, deliberate disconnects and 429 (counted as rejected)
and the server's own view from /metrics over the run (its counters and histograms read before and
after, so a server that served earlier runs reports this one alone): requests by status, mean rows
and tokens per step, mean inter-token latency and TTFT.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import gevent  # noqa: F401  (locust's import below patches the standard library with it)
from locust.env import Environment

from loadtests import locustfile
from loadtests.summary import parse_metrics, summarize, text, window

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`wcodec serve` of a checkout on a loopback port; `env` adds WCODEC_* settings."""

    def __init__(self, checkout: Path, store: Path, env: dict[str, str], log: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        full = {**os.environ, "PYTHONPATH": str(checkout), "WCODEC_MODEL_STORE": str(store), **env}
        self.log = log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "wcodec", "serve", "--host", "127.0.0.1", "--port",
                                      self.url.rsplit(":", 1)[1]], cwd=checkout, env=full, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if requests.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the server was not ready within {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def run(host: str, scenario: str, users: int, duration: float, drain: float) -> float:
    """Run the users; returns the start time (perf_counter) of the window."""
    user = {"bench": locustfile.BenchUser, "mix": locustfile.MixUser, "shared": locustfile.SharedUser}[scenario]
    env = Environment(user_classes=[user], host=host, events=locustfile.events)
    runner = env.create_local_runner()
    env.events.test_start.fire(environment=env)
    t0 = time.perf_counter()
    locustfile.STOP["at"] = t0 + duration
    runner.start(users, spawn_rate=users)
    gevent.sleep(duration)
    deadline = time.perf_counter() + drain
    while runner.user_count and time.perf_counter() < deadline:
        gevent.sleep(0.2)
    runner.quit()
    return t0


def server_metrics(host: str) -> dict[str, float]:
    import requests

    return parse_metrics(requests.get(f"{host}/metrics", timeout=10).text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", help="a running server on loopback (else one is started)")
    ap.add_argument("--checkout", type=Path, default=ROOT, help="the code the started server runs")
    ap.add_argument("--store", type=Path, default=ROOT / "models", help="the started server's model store")
    ap.add_argument("--env", action="append", default=[], metavar="WCODEC_X=V", help="a setting for the server")
    ap.add_argument("--scenario", choices=["bench", "mix", "shared"], default="bench")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--drain", type=float, default=120.0)
    ap.add_argument("--tokens", type=int, default=48, help="max_new_tokens of each request")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    locustfile.MAX_NEW_TOKENS = args.tokens
    server = None
    if args.host is None:
        env = dict(kv.split("=", 1) for kv in args.env)
        server = Server(args.checkout.resolve(), args.store.resolve(), env, Path(os.environ.get("TMPDIR", "/tmp"))
                        / f"wcodec-load-{os.getpid()}.log")
        server.wait_ready(args.ready_timeout)
    host = args.host or server.url
    if urlparse(host).hostname not in locustfile.LOCAL_HOSTS:
        raise SystemExit(f"refusing to load-test {host!r}: localhost only")
    try:
        load_before, before = os.getloadavg(), server_metrics(host)
        t0 = run(host, args.scenario, args.users, args.duration, args.drain)
        result = summarize(locustfile.RECORDS, t0, args.duration, window(before, server_metrics(host)))
    finally:
        if server is not None:
            server.stop()
    result.update(scenario=args.scenario, users=args.users, duration_s=args.duration, tokens=args.tokens,
                  checkout=str(args.checkout), env=args.env, loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(text(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
