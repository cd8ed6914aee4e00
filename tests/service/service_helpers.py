"""What the service tests share besides fixtures: the demo's name and prompt, request bodies,
`assert_error` (a response in TGI's error shape), `metric_sample` (one sample of a /metrics text),
`with_broken_archive` (a store with a file that is no archive), `Server` (a client of an app whose lifespan runs, plus its registry and /metrics samples),
`when_queue_full` (a request made while the model's queue is full), and `FileReads` (what a load
read of an archive's file)."""
from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI

from service.load import reading
from service.load.demo import DEMO_NAME
from service.model import paged
from service.errors import ModelNotFound
from service.registry import ModelRegistry, ModelState

DEMO = DEMO_NAME
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def assert_error(r, status: int, error_type: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type and body["error"], body
    return body


def generate_body(max_new_tokens: int = 12, **parameters) -> dict:
    return {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": max_new_tokens, **parameters}}


def metric_sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a /metrics text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
            return float(m.group(2))
    return 0.0


def with_broken_archive(root):
    """`root` (a store) with `broken.wcodec`, a file that is no archive; returns `root`."""
    (root / "broken.wcodec").write_bytes(b"not an archive")
    return root


@dataclass
class Server:
    client: httpx.AsyncClient
    app: FastAPI

    @property
    def registry(self) -> ModelRegistry:
        return self.app.state.registry

    async def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (0 when absent)."""
        return metric_sample((await self.client.get("/metrics")).text, name, **labels)

    async def wait_state(self, name: str, state: ModelState, timeout: float = 60) -> None:
        with anyio.fail_after(timeout):
            while True:
                with contextlib.suppress(ModelNotFound):
                    if self.registry.get(name).state is state:
                        return
                await anyio.sleep(0.02)


QUEUE_OF_ONE = {"max_queue": 1, "max_batch_size": 1, "batch_wait_ms": 0}      # serve(...) settings


async def when_queue_full(server: Server, monkeypatch, send: Callable[[], Awaitable], probe: Callable[[], Awaitable]):
    """On a server started with QUEUE_OF_ONE and the demo ready: `send()` twice, the first held in
    its prefill, the second waiting in the engine's queue (not only leased: its prompt is tokenized
    off the event loop before it is queued), then `probe()` while the queue is full; then the held ones go
    on (and finish before this returns). Returns what `probe()` returned."""
    entered, release = threading.Event(), threading.Event()
    real = paged.forward                                 # the paged engine's forward (engine/runner.py)

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(paged, "forward", held)
    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await anyio.to_thread.run_sync(entered.wait, 30)     # the worker holds the first
        tg.start_soon(send)
        entry = server.registry.get(DEMO)
        with anyio.fail_after(10):                           # leased, tokenized (off the loop) and queued
            while entry.in_flight < 2 or not entry.engine.batcher.waiting:
                await anyio.sleep(0.01)
        try:
            return await probe()
        finally:
            release.set()


class FileReads:
    """Every ArchiveFile opened, and the bytes its reads asked for."""

    def __init__(self, monkeypatch):
        self.opened, self.bytes = [], 0
        init, read = reading.ArchiveFile.__init__, reading.ArchiveFile.read

        def counting_init(file, path, direct=None):
            self.opened.append(path)
            init(file, path, direct)

        def counting_read(file, buf, base, start, end):
            self.bytes += end - start
            read(file, buf, base, start, end)
        monkeypatch.setattr(reading.ArchiveFile, "__init__", counting_init)
        monkeypatch.setattr(reading.ArchiveFile, "read", counting_read)
