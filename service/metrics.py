"""Every Prometheus metric of the service, on one registry per app (no process-wide state).

Decode   wcodec_decode_batch_duration_seconds{model,codec,device}   one observation per layer batch;
                                                   codec: the one holding most of the batch's
                                                   decoded bytes (float, raw, gguf, int8)
         wcodec_decode_compressed_bytes_total{model,codec,device}   per tensor codec
         wcodec_decode_decoded_bytes_total{model,codec,device}
Loads    wcodec_model_load_duration_seconds{model,phase}   phase: read, h2d, decode, build, total
                                                   (read and h2d overlap decode: they are the
                                                   busy time of their own stage)
         wcodec_model_load_throughput_bytes_per_second{model}   decoded bytes / total, last load
         wcodec_model_loads_total{model,result}       result: ok, failed, oom, rejected
         wcodec_model_state{model,state}               1 for the model's current state, else 0
Memory   wcodec_gpu_memory_allocated_bytes, wcodec_gpu_memory_reserved_bytes   torch.cuda totals
                                                   (0 on a CPU-only server)
         wcodec_model_memory_allocated_bytes{model,device}   bytes of the model's resident weights
         wcodec_model_memory_reserved_bytes{model,device}    CUDA: growth of the allocator's reserve
                                                   over its load; CPU: same as allocated
         wcodec_model_weight_bytes{model,weights}            its weights' bytes, decoded or compressed
                                                   (wcodec_model_resident_bytes{model,mode}: the same,
                                                   a deprecated alias for one release)
         wcodec_model_host_weight_bytes{model}          host bytes of a GPU model's weights (compressed
                                                   mode's embedding table, page-locked: fixed.py)
Weights  wcodec_forward_decode_duration_seconds{model,weights}  layer decodes per forward (compressed)
Host     wcodec_host_cache_bytes, wcodec_host_cache_entries   compressed archives kept in host memory
cache                                              between loads (service/load/hostcache.py)
         wcodec_host_cache_pinned_bytes            of those, page-locked (CUDA): hits copy in place
         wcodec_host_cache_hits_total{model}, wcodec_host_cache_misses_total{model}   loads that found
                                                   their archive there / that read the file (cache on)
Generate wcodec_generate_requests_total{model,status}  status: ok, error, cancelled, overloaded,
                                                   validation (a 422, 400 on /v1: refusals.py);
                                                   one per HTTP request (n, best_of > 1, a list of
                                                   prompts: once, as TGI counts best_of; so are its
                                                   duration, TTFT and TPOT: engine/group.py); another
                                                   4xx (404, 413) only in wcodec_http_requests_total
         wcodec_generate_request_duration_seconds{model}   buckets to 1920 s (_LONG, as the HTTP one)
         ..._time_to_first_token_seconds{model},
         ..._time_per_output_token_seconds{model}
         wcodec_generate_queue_duration_seconds{model}, ..._prefill_duration_seconds{model}   the time to
                                                   first token in two: arrival to admission (waiting
                                                   for a free row, blocks, or a step to end), admission
                                                   to the first token (the prompt's steps)
         wcodec_generate_prompt_tokens_total{model}, wcodec_generate_generated_tokens_total{model}
                                                   a prompt once prefilled (vLLM's prompt_tokens;
                                                   once for its n sequences, as the usage),
                                                   each token after the step that made it (as
                                                   vLLM's generation_tokens; not at request end)
         wcodec_generate_prompt_cached_tokens_total{model}   of the prompt tokens, those whose keys and
                                                   values the prefix cache held (vLLM's
                                                   prefix_cache_hits; the hit rate: its rate over
                                                   the prompt tokens')
         wcodec_generate_inter_token_latency_seconds{model}   one observation per token after the first
         wcodec_generate_queue_depth{model}    requests waiting to join the running batch
         wcodec_generate_queue_capacity{model}
         wcodec_generate_running_requests{model}   rows in the running batch, decoding or prefilling
                                                   (vLLM's num_requests_running), after each step
         wcodec_generate_batch_size{model}     rows a step ran, decoded or prefilled (as TGI's
                                                   tgi_batch_current_size: one observation per step
                                                   that did work)
         wcodec_generate_batch_tokens{model}   tokens fed per step: decoded rows + prompt tokens
KV cache wcodec_kv_cache_blocks{model}, wcodec_kv_cache_blocks_used{model}   the paged cache's blocks
                                                   (service/engine/blocks.py), all / held by rows
         wcodec_kv_cache_usage{model}          blocks_used / blocks (a row takes blocks as it
                                                   decodes; cached blocks none holds count as free)
         wcodec_generate_preemptions_total{model}   decoding rows sent back to the queue for lack
                                                   of a free block, to be prefilled again (vLLM's
                                                   num_preemptions)
         wcodec_engine_cuda_graphs{model}      decode steps captured (service/engine/runner.py)
         wcodec_engine_cuda_graph_shapes{model}   the step shapes it captures while idle (the graphs
                                                   gauge reaches this once all are)
         wcodec_engine_graph_capture_seconds{model}   what those captures cost, summed
Start-up wcodec_process_start_to_ready_seconds        from the process's start (the kernel's record) to
                                                   the first model ready: /health/ready's first 200;
                                                   NaN until then
HTTP     wcodec_http_requests_total{method,route,status}, wcodec_http_request_duration_seconds{...}
                                                   route is the path template ("/models/{name}")
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .timeline import process_age

STATES = ("available", "loading", "ready", "unloading", "failed")
LOAD_PHASES = ("read", "h2d", "decode", "build", "total")
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# a whole request: 4096 tokens at a CPU's 20-100 ms a step is 80-410 s; doubling to 32 min as
# vLLM's e2e latency does (TGI's durations stop near 145 s), 4 series a label set more than _SLOW
_LONG = (*_SLOW, 240.0, 480.0, 960.0, 1920.0)
# a request's phases: a GPU's queue and prefill take 2-50 ms, its first token 7 ms alone; a queue
# behind long requests on a CPU waits minutes, so the top buckets are _LONG's (vLLM's TTFT: 2 560 s)
_REQUEST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            *_LONG[len(_SLOW):])
# between tokens: 4-7 ms a step on an H200 (docs/BENCHMARKS.md), 20-100 ms on a CPU
_TOKEN = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})   # others: "OTHER"


LOAD_RESULTS = ("ok", "failed", "oom", "rejected")
WEIGHTS = ("decoded", "compressed")
REQUEST_STATUSES = ("ok", "error", "cancelled", "overloaded", "validation")


def _cuda_total(fn) -> float:
    return float(fn()) if torch.cuda.is_available() and torch.cuda.is_initialized() else 0.0


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        dec = ["model", "codec", "device"]
        self.decode_seconds = Histogram("wcodec_decode_batch_duration_seconds",
                                        "Decode latency of one layer batch", dec, buckets=_FAST, registry=r)
        self.decode_compressed = Counter("wcodec_decode_compressed_bytes", "Compressed bytes decoded", dec,
                                         registry=r)
        self.decode_decoded = Counter("wcodec_decode_decoded_bytes", "Bytes of decoded tensors", dec, registry=r)
        self.load_seconds = Histogram("wcodec_model_load_duration_seconds", "Model load time by phase",
                                      ["model", "phase"], buckets=_SLOW, registry=r)
        self.load_throughput = Gauge("wcodec_model_load_throughput_bytes_per_second",
                                     "Decoded bytes per second of the last load", ["model"], registry=r)
        self.loads = Counter("wcodec_model_loads", "Model loads by result", ["model", "result"], registry=r)
        self.state = Gauge("wcodec_model_state", "1 for the model's current state", ["model", "state"],
                           registry=r)
        mem = ["model", "device"]
        self.model_allocated = Gauge("wcodec_model_memory_allocated_bytes", "Bytes of a model's resident weights",
                                     mem, registry=r)
        self.weight_bytes = Gauge("wcodec_model_weight_bytes", "Device bytes of a model's weights as they are "
                                  "held (decoded tensors, or compressed streams, index and scratch)",
                                  ["model", "weights"], registry=r)
        self.host_weight_bytes = Gauge("wcodec_model_host_weight_bytes", "Host bytes of a model's weights while it "
                                       "serves from the GPU (compressed mode's embedding table, page-locked)",
                                       ["model"], registry=r)
        self._resident_bytes = Gauge("wcodec_model_resident_bytes", "Deprecated alias of wcodec_model_weight_bytes "
                                     "(label mode = weights); removed in the next release", ["model", "mode"],
                                     registry=r)
        self.forward_decode_seconds = Histogram("wcodec_forward_decode_duration_seconds",
                                                "Layer decode time per forward pass (weights=compressed models)",
                                                ["model", "weights"], buckets=_FAST, registry=r)
        self.model_reserved = Gauge("wcodec_model_memory_reserved_bytes", "Allocator reserve taken by a model",
                                    mem, registry=r)
        Gauge("wcodec_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated (0 without a GPU)",
              registry=r).set_function(lambda: _cuda_total(torch.cuda.memory_allocated))
        Gauge("wcodec_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved (0 without a GPU)",
              registry=r).set_function(lambda: _cuda_total(torch.cuda.memory_reserved))
        self.host_cache_hits = Counter("wcodec_host_cache_hits", "Loads whose archive was in the host cache",
                                       ["model"], registry=r)
        self.host_cache_misses = Counter("wcodec_host_cache_misses", "Loads that read their archive's file "
                                         "(host cache on)", ["model"], registry=r)
        self._host_cache_bytes = Gauge("wcodec_host_cache_bytes", "Bytes of compressed archives kept in host "
                                       "memory", registry=r)
        self._host_cache_entries = Gauge("wcodec_host_cache_entries", "Archives kept in host memory", registry=r)
        self._host_cache_pinned = Gauge("wcodec_host_cache_pinned_bytes", "Of the host cache's bytes, those "
                                        "page-locked for the GPU's copies", registry=r)
        self.start_to_ready = Gauge("wcodec_process_start_to_ready_seconds", "Seconds from the process's start "
                                    "to its first ready model (NaN until then)", registry=r)
        self.start_to_ready.set(math.nan)
        self.ready_after: float | None = None
        self._generation(r)
        self._cache(r)
        self.http_requests = Counter("wcodec_http_requests", "HTTP requests", ["method", "route", "status"],
                                     registry=r)
        self.http_seconds = Histogram("wcodec_http_request_duration_seconds", "HTTP request latency",
                                      ["method", "route", "status"], buckets=_LONG, registry=r)

    def _generation(self, r: CollectorRegistry) -> None:
        m = ["model"]
        self.requests = Counter("wcodec_generate_requests", "Generation requests by status", ["model", "status"],
                                registry=r)
        self.request_seconds = Histogram("wcodec_generate_request_duration_seconds",
                                         "Queueing plus generation time", m, buckets=_LONG, registry=r)
        self.ttft = Histogram("wcodec_generate_time_to_first_token_seconds", "Time to first token", m,
                              buckets=_REQUEST, registry=r)
        self.queue_seconds = Histogram("wcodec_generate_queue_duration_seconds", "Time from a request's arrival "
                                       "to its admission into the running batch", m, buckets=_REQUEST, registry=r)
        self.prefill_seconds = Histogram("wcodec_generate_prefill_duration_seconds", "Time from a request's "
                                         "admission to its first token (its prompt's steps)", m, buckets=_REQUEST,
                                         registry=r)
        self.tpot = Histogram("wcodec_generate_time_per_output_token_seconds", "Time per output token "
                              "after the first", m, buckets=_TOKEN, registry=r)
        self.prompt_tokens = Counter("wcodec_generate_prompt_tokens", "Prompt tokens", m, registry=r)
        self.prompt_cached_tokens = Counter("wcodec_generate_prompt_cached_tokens", "Prompt tokens found in the "
                                            "prefix cache, not prefilled", m, registry=r)
        self.generated_tokens = Counter("wcodec_generate_generated_tokens", "Generated tokens", m, registry=r)
        self.queue_depth = Gauge("wcodec_generate_queue_depth", "Requests waiting for a batch", m, registry=r)
        self.running = Gauge("wcodec_generate_running_requests", "Requests in the running batch, decoding or "
                             "prefilling (a request with n > 1 counts n)", m, registry=r)
        self.queue_capacity = Gauge("wcodec_generate_queue_capacity", "Waiting requests before 429 "
                                    "(WCODEC_MAX_QUEUE)", m, registry=r)
        self.itl = Histogram("wcodec_generate_inter_token_latency_seconds", "Time between two tokens of "
                             "a request", m, buckets=_TOKEN, registry=r)
        self.batch_size = Histogram("wcodec_generate_batch_size", "Rows a step of the running batch ran (decoded or prefilled)",
                                    m, buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.batch_tokens = Histogram("wcodec_generate_batch_tokens", "Tokens fed to the model per step "
                                      "(decoded rows + prompt tokens)", m,
                                      buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), registry=r)

    def _cache(self, r: CollectorRegistry) -> None:
        m = ["model"]
        self.cache_blocks = Gauge("wcodec_kv_cache_blocks", "Blocks of the paged KV cache", m, registry=r)
        self.cache_used = Gauge("wcodec_kv_cache_blocks_used", "KV cache blocks held by rows", m, registry=r)
        self.preemptions = Counter("wcodec_generate_preemptions", "Decoding rows preempted for lack of a free "
                                   "KV cache block (prefilled again)", m, registry=r)
        self.cache_usage = Gauge("wcodec_kv_cache_usage", "Fraction of the KV cache's blocks held by rows", m,
                                 registry=r)
        self.graphs = Gauge("wcodec_engine_cuda_graphs", "Decode steps captured as CUDA graphs", m, registry=r)
        self.graph_shapes = Gauge("wcodec_engine_cuda_graph_shapes", "Decode step shapes the engine captures "
                                  "while idle: wcodec_engine_cuda_graphs reaches this once all are", m, registry=r)
        self.capture_seconds = Gauge("wcodec_engine_graph_capture_seconds", "Seconds spent capturing CUDA "
                                     "graphs of decode steps", m, registry=r)

    def track_cache(self, model: str, blocks) -> None:
        """A paged engine's cache (a service/engine/blocks.py BlockManager), read at each scrape."""
        self.cache_blocks.labels(model).set(blocks.blocks)
        self.cache_used.labels(model).set_function(lambda: blocks.used)
        self.cache_usage.labels(model).set_function(lambda: blocks.usage)
        self.preemptions.labels(model)                 # at 0 from the start, as rate() needs
        self.set_graphs(model, 0, 0.0, 0)

    def untrack_cache(self, model: str) -> None:
        for gauge in (self.cache_blocks, self.cache_used, self.cache_usage):
            with contextlib.suppress(KeyError):
                gauge.remove(model)
        self.set_graphs(model, 0, 0.0, 0)

    def set_graphs(self, model: str, graphs: int, seconds: float, shapes: int) -> None:
        self.graphs.labels(model).set(graphs)
        self.graph_shapes.labels(model).set(shapes)
        self.capture_seconds.labels(model).set(seconds)

    def track_model(self, model: str) -> None:
        """Create the model's labelled counters at 0: rate() and increase() never count a series'
        first sample, so a first failed load would otherwise go unseen."""
        for result in LOAD_RESULTS:
            self.loads.labels(model, result)
        self.host_cache_hits.labels(model)
        self.host_cache_misses.labels(model)

    def untrack_model(self, model: str) -> None:
        """Remove every series labelled with `model` (its file left the store): a failed model's
        state would otherwise stay 1 and keep its alert firing, and the dashboards list it."""
        for metric in [v for v in vars(self).values() if isinstance(v, MetricWrapperBase)]:
            with contextlib.suppress(ValueError):            # a metric without a model label
                metric.remove_by_labels({"model": model})

    def track_engine(self, model: str, max_queue: int) -> None:
        """The same for a serving model's request counters; its queue capacity, and its gauges of
        requests at 0."""
        for status in REQUEST_STATUSES:
            self.requests.labels(model, status)
        self.queue_capacity.labels(model).set(max_queue)
        self.queue_depth.labels(model).set(0)
        self.running.labels(model).set(0)

    def watch_host_cache(self, cache) -> None:
        """The host cache's size and entries, read at each scrape."""
        self._host_cache_bytes.set_function(lambda: cache.nbytes)
        self._host_cache_entries.set_function(lambda: len(cache))
        self._host_cache_pinned.set_function(lambda: cache.pinned_bytes)

    def set_state(self, model: str, state: str) -> None:
        for s in STATES:
            self.state.labels(model, s).set(1.0 if s == state else 0.0)
        if state == "ready" and self.ready_after is None:
            self.ready_after = process_age()
            self.start_to_ready.set(self.ready_after)

    def set_memory(self, model: str, device: str, allocated: int, reserved: int) -> None:
        self.model_allocated.labels(model, device).set(allocated)
        self.model_reserved.labels(model, device).set(reserved)

    def set_weight_bytes(self, model: str, weights: str | None, nbytes: int, host: int = 0) -> None:
        """`nbytes` for the way the model's weights are held now, 0 for the other (None: unloaded);
        `host`: the bytes of them kept in host memory."""
        self.host_weight_bytes.labels(model).set(host)
        for mode in WEIGHTS:
            value = nbytes if mode == weights else 0
            self.weight_bytes.labels(model, mode).set(value)
            self._resident_bytes.labels(model, mode).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HttpMetricsMiddleware:
    """Counts and times every HTTP request by method, route template and status (pure ASGI, so
    streamed responses are timed to their last byte)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, start = 500, time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "<unmatched>")
            method = scope["method"] if scope["method"] in HTTP_METHODS else "OTHER"   # bounded: any token parses
            labels = (method, route, str(status))
            self.metrics.http_requests.labels(*labels).inc()
            self.metrics.http_seconds.labels(*labels).observe(time.perf_counter() - start)
