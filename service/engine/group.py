"""The engine requests of one HTTP request, counted once in the per-request metrics.

A request with `n` or `best_of` > 1, or OpenAI's list of prompts, is one engine request a sequence
(inference.start_many), so that they batch with everything else. The metrics of a request count it
once, as TGI counts a best_of request and OpenAI's usage an n > 1 one: wcodec_generate_requests_total
when its last sequence ends (its status the worst of theirs: error, cancelled, ok), its duration
from the first sequence's arrival to the last one's end, its time to first token (and that time's
queue and prefill) at the first token any sequence makes, its time per output token the mean of its
sequences', and each prompt's tokens once, as the usage counts them. The tokens themselves are all
counted (the steps made them), as the inter-token latency of every sequence.

A group whose sequences were not all queued (start_many refused one: 429, 422, 503) never ends
here: the refusal is what counts it (Engine.overloaded, or the 422's status="validation")."""
from __future__ import annotations

import threading

from ..metrics import Metrics

_WORST = ("ok", "cancelled", "error")          # a status after these is worse


class RequestGroup:
    def __init__(self, size: int = 1):
        self.size = size                         # sequences the HTTP request asks for
        self.created: float | None = None        # its first sequence's arrival
        self.first_token_at: float | None = None
        self._lock = threading.Lock()            # the worker ends sequences; the loop creates them
        self._ended = 0
        self._status = "ok"
        self._prompts: set[int] = set()          # prompts whose tokens are counted
        self._tpot: list[float] = []

    def arrived(self, now: float) -> None:
        with self._lock:
            self.created = now if self.created is None else self.created

    def first_token(self, metrics: Metrics, model: str, prompt: int, tokens: tuple[int, int],
                    admitted_at: float | None, now: float) -> None:
        """A sequence's first token: its prompt's tokens and, of them, those the prefix cache held
        (`tokens`; once a prompt, as its first sequence found them), and the request's time to first
        token, split at `admitted_at` into queue and prefill (the group's first token only)."""
        with self._lock:
            new_prompt, first = prompt not in self._prompts, self.first_token_at is None
            self._prompts.add(prompt)
            self.first_token_at = now if first else self.first_token_at
        if new_prompt:
            metrics.prompt_tokens.labels(model).inc(tokens[0])
            metrics.prompt_cached_tokens.labels(model).inc(tokens[1])
        if first:
            metrics.ttft.labels(model).observe(now - self.created)
            if admitted_at is not None:
                metrics.queue_seconds.labels(model).observe(admitted_at - self.created)
                metrics.prefill_seconds.labels(model).observe(now - admitted_at)

    def end(self, metrics: Metrics, model: str, status: str, tpot: float | None, now: float) -> None:
        """A sequence's end (`tpot`: its time per output token, None for fewer than 2 tokens); the
        last one's counts the request."""
        with self._lock:
            self._ended += 1
            self._status = max(self._status, status, key=_WORST.index)
            self._tpot += [] if tpot is None else [tpot]
            if self._ended != self.size:
                return
            status, tpot = self._status, sum(self._tpot) / len(self._tpot) if self._tpot else None
        metrics.requests.labels(model, status).inc()
        metrics.request_seconds.labels(model).observe(now - self.created)
        if tpot is not None:
            metrics.tpot.labels(model).observe(tpot)
