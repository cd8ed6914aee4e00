"""One generation engine per ready model: a worker thread that takes up to `max_batch_size`
queued requests (waiting `batch_wait_ms` for more to arrive) and runs them as one batch.

Requests cross threads in one direction each: the event loop `submit`s a `GenRequest` into a
bounded queue (full -> 429); the worker hands tokens and the final result back with
`loop.call_soon_threadsafe`, so every `asyncio` object is touched on the loop alone."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from . import generation
from .errors import GenerationFailed, ModelNotReady, QueueFull, ServiceError
from .generation import Finished, Row, SamplingParams, TokenEvent
from .metrics import Metrics
from .modeling import ServedModel

log = logging.getLogger("wcodec.service")


class GenRequest:
    """A request in flight: created on the event loop, fed by the worker thread."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, *, stream: bool = False):
        self.prompt_ids, self.params, self.stream = prompt_ids, params, stream
        self.loop = asyncio.get_running_loop()
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.cancelled = False
        self.row: Row | None = None
        self._events: asyncio.Queue[TokenEvent | Finished | ServiceError] = asyncio.Queue()
        self._callbacks: list[Callable[[], None]] = []
        self._done = False                       # the loop has seen the outcome
        self.outcome_sent = False                # the worker has sent it

    # --- the loop's side ---
    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self._callbacks.append(fn)

    def cancel(self) -> None:
        self.cancelled = True
        if self.row is not None:
            self.row.cancelled = True

    async def next(self) -> TokenEvent | Finished:
        item = await self._events.get()
        if isinstance(item, ServiceError):
            raise item
        return item

    async def result(self) -> Finished:
        while not isinstance(item := await self.next(), Finished):
            pass
        return item

    def _deliver(self, item) -> None:
        self._events.put_nowait(item)
        if isinstance(item, (Finished, ServiceError)) and not self._done:
            self._done = True
            for fn in self._callbacks:
                fn()

    # --- the worker's side ---
    def put(self, item: TokenEvent | Finished | ServiceError) -> None:
        self.loop.call_soon_threadsafe(self._deliver, item)


class Engine:
    def __init__(self, served: ServedModel, metrics: Metrics, *, max_batch_size: int, max_queue: int,
                 batch_wait_s: float):
        self.served, self.metrics = served, metrics
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        self._queue: queue.Queue[GenRequest | None] = queue.Queue(maxsize=max_queue)
        metrics.track_engine(served.name, max_queue)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wcodec-engine-{served.name}", daemon=True)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, req: GenRequest) -> None:
        name = self.served.name
        if self._closed.is_set():
            raise ModelNotReady(f"model {name!r} is unloading", 1)
        try:
            self._queue.put_nowait(req)
        except queue.Full:
            self.metrics.requests.labels(name, "overloaded").inc()
            raise QueueFull(f"model {name!r} has {self._queue.maxsize} requests waiting") from None
        self.metrics.prompt_tokens.labels(name).inc(len(req.prompt_ids))
        self.metrics.queue_depth.labels(name).set(self._queue.qsize())

    def close(self) -> None:
        """Stop the worker after its batch; requests still queued fail with 503."""
        self._closed.set()
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                break
            if req is not None:
                req.put(ModelNotReady(f"model {self.served.name!r} was unloaded", 1))
        self._queue.put(None)
        self._thread.join()

    def _take_batch(self) -> list[GenRequest]:
        first = self._queue.get()
        batch, deadline = [first], time.perf_counter() + self.batch_wait_s
        while batch[-1] is not None and len(batch) < self.max_batch_size:
            try:
                batch.append(self._queue.get(timeout=max(0.0, deadline - time.perf_counter())))
            except queue.Empty:
                break
        self.metrics.queue_depth.labels(self.served.name).set(self._queue.qsize())
        return [r for r in batch if r is not None]

    def _run(self) -> None:
        while not self._closed.is_set():
            batch = [r for r in self._take_batch() if not self._drop_cancelled(r)]
            if batch:
                self._run_batch(batch)

    def _drop_cancelled(self, req: GenRequest) -> bool:
        if req.cancelled:
            self._finish(req, Finished("", None, [], None, len(req.prompt_ids)))
        return req.cancelled

    def _run_batch(self, batch: list[GenRequest]) -> None:
        rows = []
        for req in batch:
            req.row = Row(req.prompt_ids, req.params, self.served, owner=req)
            req.row.cancelled = req.cancelled
            rows.append(req.row)
        self.metrics.batch_size.labels(self.served.name).observe(len(rows))
        try:
            generation.generate(self.served, rows, self._on_token, lambda row: self._finish(row.owner, row.finished()))
        except Exception as e:                   # one failed batch fails its requests, not the server
            log.exception("generation failed on model %s", self.served.name)
            for row in rows:
                if not row.owner.outcome_sent:
                    self._finish(row.owner, GenerationFailed(f"generation failed: {type(e).__name__}: {e}"))

    def _on_token(self, row: Row, event: TokenEvent) -> None:
        req = row.owner
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
            self.metrics.ttft.labels(self.served.name).observe(req.first_token_at - req.created)
        if req.stream:
            req.put(event)

    def _finish(self, req: GenRequest, outcome: Finished | ServiceError) -> None:
        req.outcome_sent, req.row = True, None
        name, now = self.served.name, time.perf_counter()
        if isinstance(outcome, Finished):
            status = "cancelled" if outcome.finish_reason is None else "ok"
            n = len(outcome.tokens)
            self.metrics.generated_tokens.labels(name).inc(n)
            if n > 1 and req.first_token_at is not None:
                self.metrics.tpot.labels(name).observe((now - req.first_token_at) / (n - 1))
        else:
            status = "error"
        self.metrics.requests.labels(name, status).inc()
        self.metrics.request_seconds.labels(name).observe(now - req.created)
        req.put(outcome)
