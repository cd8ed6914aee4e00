"""Locust scenarios for the wcodec server: generate, stream (with time to first token), and the
model list. Localhost only:

    pip install locust
    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 --users 16 --spawn-rate 4

Environment: WCODEC_LOAD_MODEL (default: the server's default model), WCODEC_LOAD_TOKENS (16).
"""
from __future__ import annotations

import json
import os
import time
from urllib.parse import urlparse

from locust import HttpUser, between, events, task

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
MODEL = os.environ.get("WCODEC_LOAD_MODEL")
MAX_NEW_TOKENS = int(os.environ.get("WCODEC_LOAD_TOKENS", "16"))


@events.test_start.add_listener
def localhost_only(environment, **_) -> None:
    host = urlparse(environment.host or "").hostname
    if host not in LOCAL_HOSTS:
        environment.runner.quit()
        raise SystemExit(f"refusing to load-test {environment.host!r}: localhost only")


def body(**parameters) -> dict:
    out = {"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, **parameters}}
    return {**out, "model": MODEL} if MODEL else out


class ServerUser(HttpUser):
    wait_time = between(0.05, 0.5)

    @task(6)
    def generate(self) -> None:
        with self.client.post("/generate", json=body(), catch_response=True) as r:
            if r.status_code == 200 and "generated_text" in r.json():
                r.success()
            else:
                r.failure(f"{r.status_code}: {r.text[:200]}")

    @task(3)
    def stream(self) -> None:
        start, first, last = time.perf_counter(), None, None
        with self.client.post("/generate_stream", json=body(), stream=True, catch_response=True) as r:
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                first = first or time.perf_counter()
                last = json.loads(line[len(b"data:"):])
            if r.status_code != 200 or not last or last.get("generated_text") is None:
                r.failure(f"{r.status_code}: stream ended without generated_text ({last})")
                return
            r.success()
        events.request.fire(request_type="SSE", name="time to first token", response_time=(first - start) * 1e3,
                            response_length=0, exception=None, context={})

    @task(1)
    def models(self) -> None:
        self.client.get("/models")
