"""The engine of one ready model: a worker thread that runs its `Batcher` one step after another
while there is work, and sleeps when there is none.

Requests cross threads in one direction each: the event loop `submit`s a `GenRequest` (its `Row`
joins the batcher's waiting line; more than `max_queue` waiting -> 429); the worker hands tokens
and the final result back with `loop.call_soon_threadsafe`, so every `asyncio` object is touched
on the loop alone."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import GenerationFailed, ModelNotReady, QueueFull, ServiceError
from ..metrics import Metrics
from ..model.build import ServedModel
from ..model.llama import LlamaForCausalLM
from ..timeline import Timeline
from . import paging
from .batcher import Batcher
from .group import RequestGroup
from .sampling import Finished, Row, SamplingParams, TokenEvent

log = logging.getLogger("wcodec.service")


@dataclass(frozen=True)
class Limits:
    max_rows: int           # WCODEC_MAX_BATCH_SIZE: rows in the running batch
    max_tokens: int         # WCODEC_MAX_BATCH_TOKENS: tokens one step feeds the model
    max_queue: int          # WCODEC_MAX_QUEUE: waiting requests before 429
    batch_wait_s: float     # WCODEC_BATCH_WAIT_MS: an idle engine waits this long for a burst
    engine: str = "auto"    # WCODEC_ENGINE: "paged" (llama.py models: paging.py), "padded" (batcher.py),
                            # "auto": paged
    cache: paging.CacheSettings = field(default_factory=paging.CacheSettings)


def limits(s) -> Limits:
    """The engine's limits from the service's Settings."""
    cache = paging.CacheSettings(s.kv_block_size, s.kv_cache_bytes, s.kv_cache_fraction, s.max_total_tokens,
                                 s.cuda_graphs, s.prefill_wait_ms / 1e3, s.prompt_graph_rows, s.prefix_caching)
    return Limits(s.max_batch_size, s.max_batch_tokens, s.max_queue, s.batch_wait_ms / 1e3, s.engine, cache)


def paged_engine(engine: str) -> bool:
    """Whether WCODEC_ENGINE picks the paged engine ("auto" does, on every device: it passed its
    tests on the CPU and on an H100, docs/BENCHMARKS.md; "padded" keeps the engine before it)."""
    return engine in ("paged", "auto")


class GenRequest:
    """A request in flight: created on the event loop, fed by the worker thread. `group`: the
    HTTP request's sequences it is one of, `prompt` the index of its prompt there (group.py)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, *, stream: bool = False,
                 group: RequestGroup | None = None, prompt: int = 0):
        self.prompt_ids, self.params, self.stream = prompt_ids, params, stream
        self.loop = asyncio.get_running_loop()
        self.created = time.perf_counter()
        self.group, self.prompt = group or RequestGroup(), prompt
        self.group.arrived(self.created)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.row: Row | None = None
        self._events: asyncio.Queue[TokenEvent | Finished | ServiceError] = asyncio.Queue()
        self._callbacks: list[Callable[[], None]] = []
        self._done = False                       # the loop has seen the outcome
        self.outcome_sent = False                # the worker has sent it

    # --- the loop's side ---
    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self._callbacks.append(fn)

    def cancel(self) -> None:
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
    def __init__(self, served: ServedModel, metrics: Metrics, limits: Limits, timeline: Timeline | None = None):
        self.served, self.metrics, self.limits = served, metrics, limits
        self.timeline = timeline or Timeline()   # the start-up's: the engine's build, its first request and step
        self._done_rows: list[Row] = []          # rows a step finished, answered once its metrics are in
        self._made = 0                           # tokens the step under way made (counted after it)
        self._wake = threading.Event()
        self._firsts = {"request", "step"}       # firsts not yet marked on the timeline
        with self.timeline.span(f"engine {served.name}: built (its cache, runner, joined weights)"):
            self.batcher = self._batcher(served, limits)
        self._lock = threading.Lock()            # submit's check-then-append against close
        self._closed = False
        metrics.track_engine(served.name, limits.max_queue)
        self._thread = threading.Thread(target=self._run, name=f"wcodec-engine-{served.name}", daemon=True)

    def _batcher(self, served: ServedModel, limits: Limits) -> Batcher | paging.Scheduler:
        """The paged scheduler for llama.py's models, batcher.py's padded batches for the others."""
        if paged_engine(limits.engine) and isinstance(served.model, LlamaForCausalLM):
            sched = paging.scheduler(served, limits.max_rows, limits.max_tokens, limits.cache, self._on_token,
                                     self._done_rows.append)
            self.metrics.track_cache(served.name, sched.blocks)
            sched.runner.on_warmed = self._wake.set         # warmed kernels: adopt them, capture graphs
            return sched
        return Batcher(served, max_rows=limits.max_rows, max_tokens=limits.max_tokens, on_token=self._on_token,
                       on_finish=self._done_rows.append)

    @property
    def _runner(self):
        """The paged scheduler's runner (its graphs, its kernels); None for batcher.py's engine."""
        return getattr(self.batcher, "runner", None)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, req: GenRequest) -> None:
        name, waiting = self.served.name, self.batcher.waiting
        with self._lock:
            if self._closed:
                raise ModelNotReady(f"model {name!r} is unloading", 1)
            if (queued := sum(not r.cancelled for r in waiting)) >= self.limits.max_queue:
                self.overloaded()
                raise QueueFull(f"model {name!r} has {queued} requests waiting (WCODEC_MAX_QUEUE)")
            req.row = Row(req.prompt_ids, req.params, self.served, owner=req)
            self.batcher.add(req.row)
        self._first("request", f"{len(req.prompt_ids)} prompt tokens")
        self.metrics.queue_depth.labels(name).set(len(waiting))
        self._wake.set()

    def overloaded(self) -> None:
        """Count a request refused with 429 before it was queued (the queue full, no grammar slot)."""
        self.metrics.requests.labels(self.served.name, "overloaded").inc()

    def close(self, untrack: bool = True) -> None:
        """No new requests; those still waiting fail with 503; the running ones finish; then the
        worker stops. `untrack=False`: the model's cache metrics are left alone (a version a reload
        replaced closes while the new version's engine reports under the same name)."""
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join()
        runner = self._runner
        if runner is not None:
            runner.close()
            if untrack:
                self.metrics.untrack_cache(self.served.name)

    def _run(self) -> None:
        while True:
            self._wake.clear()
            if self._closed:
                self._fail_waiting()
            if self.batcher.idle:
                if self._closed:
                    return
                if self._capture_while_idle():
                    continue
                self._wake.wait(self._runner.warm_due_in() if self._runner is not None else None)
                time.sleep(self.limits.batch_wait_s)         # let a burst arrive and prefill as one group
                continue
            self._step()

    def _capture_while_idle(self) -> bool:
        """One CUDA graph the runner has not captured yet (runner.py); False: none left, or no graphs."""
        runner = self._runner
        if runner is None:
            return False
        try:
            captured = runner.capture_next()
        except Exception:                        # a graph that cannot be captured: run eagerly
            log.exception("capturing a decode step failed on model %s; it runs eagerly", self.served.name)
            runner.use_graphs, captured = False, False
        if captured:
            self.metrics.set_graphs(self.served.name, len(runner.graphs), runner.capture_seconds, runner.shape_count)
        return captured

    def _fail_waiting(self) -> None:
        while self.batcher.waiting:
            row = self.batcher.waiting.popleft()
            self._finish(row.owner, ModelNotReady(f"model {self.served.name!r} was unloaded", 1))

    def _step(self) -> None:
        """One batcher step. The rows it finished are answered after the step's own metrics are
        recorded, so a client that reads /metrics after its response sees the step that made its
        last token."""
        m, name = self.metrics, self.served.name
        try:
            step = self.batcher.step()
        except Exception as e:                   # a failed step fails its rows, not the server
            log.exception("generation failed on model %s", name)
            self._answer_done_rows()
            for row in self.batcher.reset():
                self._finish(row.owner, GenerationFailed(f"generation failed: {type(e).__name__}: {e}"))
            self._count_rows()
            return
        self._first("step", f"{step.tokens} tokens, {step.rows} rows")
        self._count_rows()
        if step.tokens:
            m.batch_size.labels(name).observe(step.rows)
            m.batch_tokens.labels(name).observe(step.tokens)
        if step.preempted:
            m.preemptions.labels(name).inc(step.preempted)
        runner = self._runner
        if runner is not None:
            m.set_graphs(name, len(runner.graphs), runner.capture_seconds, runner.shape_count)
        self._answer_done_rows()

    def _count_rows(self) -> None:
        """After a step (or a failed one: its rows are gone): the waiting and running gauges, and
        the tokens it made, counted as they are made as vLLM counts them (not when a request ends)."""
        m, name = self.metrics, self.served.name
        m.queue_depth.labels(name).set(len(self.batcher.waiting))
        m.running.labels(name).set(len(self.batcher.active))
        m.generated_tokens.labels(name).inc(self._made)
        self._made = 0

    def _first(self, what: str, detail: str) -> None:
        if what in self._firsts:
            self._firsts.discard(what)
            self.timeline.mark(f"engine {self.served.name}: first {what} ({detail})")

    def _answer_done_rows(self) -> None:
        for row in self._done_rows:
            self._finish(row.owner, GenerationFailed(row.error) if row.error else row.finished())
        self._done_rows.clear()                  # the batcher's on_finish appends to this very list

    def _on_token(self, row: Row, event: TokenEvent) -> None:
        req, now, name = row.owner, time.perf_counter(), self.served.name
        self._made += 1
        if req.first_token_at is None:          # prefilled: its prompt taken in
            req.first_token_at = now
            req.group.first_token(self.metrics, name, req.prompt, (len(req.prompt_ids), row.cached_tokens),
                                  row.admitted_at, now)
        else:
            self.metrics.itl.labels(name).observe(now - req.last_token_at)
        req.last_token_at = now
        if req.stream:
            req.put(event)

    def _finish(self, req: GenRequest, outcome: Finished | ServiceError) -> None:
        if req.outcome_sent:
            return
        req.outcome_sent = True
        now, status, tpot = time.perf_counter(), "error", None
        if isinstance(outcome, Finished):
            status = "cancelled" if outcome.finish_reason is None else "ok"
            n = len(outcome.tokens)
            if n > 1 and req.first_token_at is not None:
                tpot = (now - req.first_token_at) / (n - 1)
        req.group.end(self.metrics, self.served.name, status, tpot, now)       # the request's last: counted
        req.put(outcome)
