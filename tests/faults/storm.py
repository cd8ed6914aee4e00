"""The storm: N concurrent clients for a fixed time against a running server, each picking
requests at random (seeded): /generate, /generate_stream (some hang up mid-stream),
/v1/chat/completions, /v1/completions (streamed too), load, load?wait=false, GET /models,
GET /v1/models, /metrics and a few invalid bodies (TGI's and OpenAI's),
while an admin unloads the model every `unload_every_s`. Every answer's status is checked against
what the OpenAPI schema documents for its route; every request has a deadline, so a hang is
counted, never waited out.

    report = asyncio.run(run_storm(url, model, clients=32, seconds=20))
    report.problems()   # [] when: only documented statuses, no unexpected 5xx, no hang,
                        # no transport error, every complete stream well formed
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from .server import documented_statuses, openapi, route_of

QUESTION = "What is the capital of France?"
PROMPTS = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
           for q in (QUESTION, "Name a colour.", "Count to three.", "Say hello.")]
EXPECTED_5XX = {503}                  # model not ready (unloading, loading): documented, with Retry-After


@dataclass
class StormReport:
    clients: int
    seconds: float = 0.0
    requests: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)   # "METHOD template status"
    actions: collections.Counter = field(default_factory=collections.Counter)
    disconnects: int = 0              # streams the client hung up on after the first event
    streams_complete: int = 0
    undocumented: list[str] = field(default_factory=list)
    unexpected_5xx: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    transport_errors: list[str] = field(default_factory=list)
    bad_streams: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)          # the first 5xx answers, for the record

    def problems(self) -> list[str]:
        return [f"{name}: {items[:5]}" for name, items in (
            ("undocumented statuses", self.undocumented), ("unexpected 5xx", self.unexpected_5xx),
            ("hangs", self.hangs), ("transport errors", self.transport_errors),
            ("malformed streams", self.bad_streams)) if items]

    def summary(self) -> dict:
        return {"clients": self.clients, "seconds": round(self.seconds, 1), "requests": self.requests,
                "statuses": dict(sorted(self.statuses.items())), "actions": dict(sorted(self.actions.items())),
                "disconnects": self.disconnects, "streams_complete": self.streams_complete,
                "undocumented": len(self.undocumented), "unexpected_5xx": len(self.unexpected_5xx),
                "hangs": len(self.hangs), "transport_errors": len(self.transport_errors),
                "bad_streams": len(self.bad_streams)}


def _sse_payloads(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def check_tgi_stream(lines: list[str]) -> str | None:
    """Why a complete TGI stream is malformed, or None: JSON events, the last one (only) with
    generated_text, or a final error event."""
    events = [json.loads(p) for p in _sse_payloads(lines)]
    if not events:
        return "no event"
    if "error" in events[-1]:
        return None if all("token" in e for e in events[:-1]) else "error event after a malformed one"
    if any(e.get("generated_text") is not None for e in events[:-1]) or events[-1].get("generated_text") is None:
        return "generated_text not on the last event alone"
    return None


def check_openai_stream(lines: list[str]) -> str | None:
    """Why a complete OpenAI stream (chat or completions) is malformed, or None: JSON chunks with
    choices (or a final error), then [DONE]; asked for, the usage comes last."""
    payloads = _sse_payloads(lines)
    if not payloads or payloads[-1] != "[DONE]":
        return "OpenAI stream does not end with [DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    if not all("choices" in c or "error" in c for c in chunks):
        return "chunk without choices"
    return None if "error" in chunks[-1] or chunks[-1].get("usage") else "no usage chunk last"


class _Client:
    def __init__(self, report: StormReport, url: str, model: str, templates, rng: random.Random, timeout: float):
        self.report, self.model, self.templates, self.rng = report, model, templates, rng
        self.http = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout))
        self.timeout = timeout

    def _record(self, action: str, method: str, path: str, status: int) -> None:
        r = self.report
        r.requests += 1
        r.actions[action] += 1
        route = route_of(method, path, self.templates)
        key = f"{method} {route[1] if route else path} {status}"
        r.statuses[key] += 1
        if route is None or status not in self.templates[route]:
            r.undocumented.append(key)
        if status >= 500 and status not in EXPECTED_5XX:
            r.unexpected_5xx.append(key)

    async def _plain(self, action: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
        response = await self.http.request(method, path, json=body)
        self._record(action, method, path, response.status_code)
        if response.status_code >= 500 and len(self.report.samples) < 20:
            self.report.samples.append(f"{method} {path} {response.status_code}: {response.text[:160]}")
        return response

    async def _stream(self, action: str, path: str, body: dict, hang_up: bool, check) -> None:
        async with self.http.stream("POST", path, json=body) as response:
            self._record(action, "POST", path, response.status_code)
            if response.status_code != 200:
                await response.aread()
                return
            lines = []
            async for line in response.aiter_lines():
                lines.append(line)
                if hang_up and line.startswith("data: "):
                    self.report.disconnects += 1
                    return                  # leaving the block closes the connection mid-stream
        self.report.streams_complete += 1
        if (why := check(lines)) is not None:
            self.report.bad_streams.append(f"{path}: {why}")

    def _generate_body(self) -> dict:
        params = {"max_new_tokens": self.rng.randint(1, 8)}
        if self.rng.random() < 0.3:
            params |= {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": self.rng.randint(0, 99)}
        return {"inputs": self.rng.choice(PROMPTS), "parameters": params}

    def _chat_body(self, stream: bool) -> dict:
        return {"messages": [{"role": "user", "content": self.rng.choice([QUESTION, "Say hello."])}],
                "max_tokens": self.rng.randint(1, 6), "stream": stream, "stream_options": {"include_usage": True}}

    def _completion_body(self, stream: bool) -> dict:
        prompts = self.rng.sample(["The capital of France is", "1, 2, 3,", "Once upon a time"], self.rng.randint(1, 2))
        return {"prompt": prompts, "max_tokens": self.rng.randint(1, 6), "temperature": self.rng.choice([0, 0.8]),
                "stream": stream, "stream_options": {"include_usage": True}}

    async def one(self) -> None:
        m, roll = self.model, self.rng.random()
        table = [
            (0.22, lambda: self._plain("generate", "POST", "/generate", self._generate_body())),
            (0.16, lambda: self._stream("generate_stream", "/generate_stream", self._generate_body(),
                                        self.rng.random() < 0.5, check_tgi_stream)),
            (0.08, lambda: self._plain("chat", "POST", "/v1/chat/completions", self._chat_body(False))),
            (0.07, lambda: self._stream("chat_stream", "/v1/chat/completions", self._chat_body(True),
                                        self.rng.random() < 0.5, check_openai_stream)),
            (0.05, lambda: self._plain("completions", "POST", "/v1/completions", self._completion_body(False))),
            (0.04, lambda: self._stream("completions_stream", "/v1/completions", self._completion_body(True),
                                        self.rng.random() < 0.5, check_openai_stream)),
            (0.06, lambda: self._plain("models", "GET", "/models")),
            (0.03, lambda: self._plain("v1_models", "GET", "/v1/models")),
            (0.05, lambda: self._plain("metrics", "GET", "/metrics")),
            (0.03, lambda: self._plain("model", "GET", f"/models/{m}")),
            (0.03, lambda: self._plain("load", "POST", f"/models/{m}/load")),
            (0.03, lambda: self._plain("load_nowait", "POST", f"/models/{m}/load?wait=false")),
            (0.03, lambda: self._plain("model", "GET", f"/models/{m}")),
            (0.05, lambda: self._plain("invalid", "POST", "/generate", {"inputs": "x", "parameters":
                                                                         {"max_new_tokens": 0}})),
            (0.03, lambda: self._plain("invalid_v1", "POST", "/v1/completions", {"prompt": "x", "max_tokens": -5})),
            (0.04, lambda: self._plain("health", "GET", "/health/ready")),
        ]
        for weight, call in table:
            roll -= weight
            if roll < 0:
                break
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(call(), self.timeout + 5)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            self.report.hangs.append(f"{time.monotonic() - t0:.0f} s")
        except httpx.TransportError as e:
            self.report.transport_errors.append(f"{type(e).__name__}: {e}")

    async def run(self, deadline: float) -> None:
        async with self.http:
            while time.monotonic() < deadline:
                await self.one()

    async def unloads(self, deadline: float, every_s: float) -> None:
        """The admin: one unload every `every_s` seconds (clients load it again; more unloads would
        leave a CPU's model mostly reloading)."""
        async with self.http:
            while time.monotonic() + every_s < deadline:
                await asyncio.sleep(every_s)
                try:
                    await asyncio.wait_for(self._plain("unload", "POST", f"/models/{self.model}/unload"),
                                           self.timeout + 5)
                except (asyncio.TimeoutError, httpx.TimeoutException):
                    self.report.hangs.append("unload")


async def run_storm(url: str, model: str, *, clients: int = 32, seconds: float = 20, seed: int = 0,
                    timeout: float = 120, unload_every_s: float = 15.0) -> StormReport:
    """Run the storm; a request still unanswered `timeout` s after it was sent counts as a hang."""
    templates = await asyncio.to_thread(lambda: documented_statuses(openapi(url)))
    report = StormReport(clients)
    t0 = time.monotonic()
    admin = _Client(report, url, model, templates, random.Random(seed), timeout)
    await asyncio.gather(admin.unloads(t0 + seconds, unload_every_s),
                         *(_Client(report, url, model, templates, random.Random(seed * 1000 + i), timeout)
                           .run(t0 + seconds) for i in range(clients)))
    report.seconds = time.monotonic() - t0
    return report


async def wait_ready(url: str, timeout: float = 300) -> None:
    """Until /health/ready answers 200 (the preloaded model is ready)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while (await http.get("/health/ready")).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("no model became ready")
            await asyncio.sleep(0.2)


async def settle(url: str, timeout: float = 120) -> list[dict]:
    """Wait until no model is loading/unloading and none has a request in flight; the model list."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while True:
            models = (await http.get("/models")).json()["models"]
            if all(m["state"] in ("ready", "available", "failed") and m["in_flight"] == 0 for m in models):
                return models
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not settle: {models}")
            await asyncio.sleep(0.2)


async def answers_paris(url: str, model: str) -> str:
    """Load the model and ask the question: the demo's greedy answer."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        r = await http.post(f"/models/{model}/load")
        r.raise_for_status()
        r = await http.post("/generate", json={"inputs": PROMPTS[0], "model": model,
                                               "parameters": {"max_new_tokens": 12}})
        r.raise_for_status()
        return r.json()["generated_text"]
