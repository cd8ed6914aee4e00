"""Locust scenarios for the wcodec server. Localhost only.

    BenchUser   the acceptance workload: a closed loop of /generate_stream, greedy, WCODEC_LOAD_TOKENS
                (48) new tokens, every request a different prompt (docs/BENCHMARKS.md)
    MixUser     /generate, /generate_stream (a third of the streams leave after a few tokens),
                /v1/chat/completions and model-control reads
    SharedUser  BenchUser's loop, each prompt a long system prompt that every request shares
                (WCODEC_LOAD_SHARED words, 600) before its own question: what a prefix cache serves

Headless and bounded (fixed users and duration, summary with p50/p99, TTFT, tokens/s, errors):
`python -m loadtests.run --help`. With locust's own UI:
`locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 MixUser`.

Environment: WCODEC_LOAD_MODEL (default: the server's default model), WCODEC_LOAD_TOKENS (48),
WCODEC_LOAD_SHARED (600).
Prompts are ChatML (the demo model's format). Every request is recorded in `RECORDS` (a
`Record` each) for loadtests/run.py, and reported to locust's own statistics too.
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from locust import HttpUser, constant, events, task
from locust.exception import StopUser

from loadtests.prompts import prompt, question, shared_prompt

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
MODEL = os.environ.get("WCODEC_LOAD_MODEL")
MAX_NEW_TOKENS = int(os.environ.get("WCODEC_LOAD_TOKENS", "48"))


@dataclass
class Record:
    kind: str                        # generate, stream, chat, control
    start: float
    end: float = 0.0
    first: float | None = None       # first token (streams)
    token_times: list[float] = field(default_factory=list)
    status: int = 0                  # HTTP status; 0: transport error
    error: str | None = None
    disconnected: bool = False       # left mid-stream on purpose


RECORDS: list[Record] = []
STOP = {"at": float("inf")}          # run.py sets the time after which users start no new request


@events.test_start.add_listener
def localhost_only(environment, **_) -> None:
    host = urlparse(environment.host or "").hostname
    if host not in LOCAL_HOSTS:
        environment.runner.quit()
        raise SystemExit(f"refusing to load-test {environment.host!r}: localhost only")


def body(inputs: str | None = None, **parameters) -> dict:
    out = {"inputs": inputs or prompt(), "parameters": {"max_new_tokens": MAX_NEW_TOKENS, **parameters}}
    return {**out, "model": MODEL} if MODEL else out


class Recorded(HttpUser):
    abstract = True

    def record(self, kind: str) -> Record:
        if time.perf_counter() >= STOP["at"]:
            raise StopUser()
        rec = Record(kind, time.perf_counter())
        RECORDS.append(rec)
        return rec

    def post_json(self, kind: str, path: str, payload: dict, check) -> None:
        rec = self.record(kind)
        with self.client.post(path, json=payload, catch_response=True, name=path) as r:
            rec.end, rec.status = time.perf_counter(), r.status_code
            rec.error = None if r.status_code == 200 and check(r.json()) else f"{r.status_code}: {(r.text or '')[:200]}"
            rec.token_times = [rec.end] * (_tokens(r.json()) if rec.error is None else 0)
            _report(r, rec)

    def stream(self, payload: dict, leave_after: int | None = None) -> None:
        rec, last = self.record("stream"), None
        with self.client.post("/generate_stream", json=payload, stream=True, catch_response=True,
                              name="/generate_stream") as r:
            rec.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                last = json.loads(line[len(b"data:"):])
                if "token" in last:
                    rec.token_times.append(time.perf_counter())
                    rec.first = rec.first or rec.token_times[-1]
                if leave_after is not None and len(rec.token_times) >= leave_after:
                    rec.disconnected = True
                    break
            rec.end = time.perf_counter()
            if not rec.disconnected and (r.status_code != 200 or not last or last.get("generated_text") is None):
                rec.error = f"{r.status_code}: stream ended without generated_text ({str(last)[:200]})"
            _report(r, rec)
            if rec.disconnected:
                r.close()                                   # the server sees the client leave


def _report(response, rec: Record) -> None:
    """To locust's statistics: a 429 is a deliberate rejection, not a failure."""
    if rec.error and rec.status != 429:
        response.failure(rec.error)
    else:
        response.success()


def _tokens(answer) -> int:
    answer = answer[0] if isinstance(answer, list) else answer
    if "usage" in answer:
        return answer["usage"]["completion_tokens"]
    return (answer.get("details") or {}).get("generated_tokens", 0)


class BenchUser(Recorded):
    wait_time = constant(0)

    @task
    def generate_stream(self) -> None:
        self.stream(body(do_sample=False))


class SharedUser(Recorded):
    wait_time = constant(0)

    @task
    def generate_stream(self) -> None:
        self.stream(body(shared_prompt(), do_sample=False))


class MixUser(Recorded):
    wait_time = constant(0.05)

    @task(4)
    def generate(self) -> None:
        sampled = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "seed": random.getrandbits(31),
                   "stop": ["\n\n"]} if random.random() < 0.5 else {}
        self.post_json("generate", "/generate", body(**sampled), lambda j: "generated_text" in j)

    @task(3)
    def generate_stream(self) -> None:
        self.stream(body(), leave_after=random.randint(1, 4) if random.random() < 1 / 3 else None)

    @task(2)
    def chat(self) -> None:
        payload = {"messages": [{"role": "user", "content": question()}], "max_tokens": MAX_NEW_TOKENS,
                   "temperature": 0}
        self.post_json("chat", "/v1/chat/completions", {**payload, "model": MODEL} if MODEL else payload,
                       lambda j: bool(j["choices"][0]["message"]["content"]))

    @task(1)
    def control(self) -> None:
        rec = self.record("control")
        models = self.client.get("/models", name="/models")
        names = [m["name"] for m in models.json()["models"]] if models.status_code == 200 else []
        statuses = [models.status_code]
        for name in names[:1]:
            statuses.append(self.client.get(f"/models/{name}", name="/models/{name}").status_code)
        statuses.append(self.client.get("/health/ready", name="/health/ready").status_code)
        rec.end, rec.status = time.perf_counter(), max(statuses)
        rec.error = None if set(statuses) == {200} else f"model-control reads answered {statuses}"
