"""Continuous batching for one model, without threads: rows (requests) in, token events out.

Each `step()`:
  1. rows that were cancelled since the last step leave, with their KV columns;
  2. decode: every running row feeds its newest token and samples the next (one forward, [B, 1]);
     rows that finish leave at once;
  3. prefill: the rest of the step's token budget (`max_tokens` less one per decoded row) goes to
     prompts. When no prefill is under way, waiting rows form the next group, first come first
     served, as many as fit the budget and the free rows; a group's left-padded prompts [G, W]
     advance by `budget // G` columns per step (a chunk), so a long prompt never stalls the
     running rows for more than one budget's worth of tokens. When the group's prompts are done,
     each of its rows samples its first token and the group joins the running batch (`merge`).

The running batch and the group each own a `PaddedKV`; rows never share a KV row, and a row's
attention sees only its own columns (the mask), so batching changes no row's tokens beyond
floating-point reordering. `on_token(row, event)` fires for every token, `on_finish(row)` once per
row, when it leaves (finished, or cancelled: `row.done`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..generation import Row, TokenEvent, left_pad, sample_rows
from ..modeling import ServedModel
from .kv import PaddedKV, cache_class


@dataclass(frozen=True)
class Step:
    rows: int           # rows decoded
    tokens: int         # tokens fed to the model: decoded rows + prompt tokens prefilled


class Group:
    """Rows whose prompts are being prefilled together, in chunks of columns."""

    def __init__(self, rows: list[Row], served: ServedModel):
        self.rows = rows
        self.ids, self.real = left_pad([r.prompt_ids for r in rows], served.pad_id, served.device)  # [G, W]
        self.kv = PaddedKV(served.device, cache_class(served.model), len(rows))
        self.done = 0                                   # columns prefilled

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def drop_cancelled(self) -> list[Row]:
        keep = [i for i, r in enumerate(self.rows) if not r.cancelled]
        gone = [r for r in self.rows if r.cancelled]
        if gone:
            idx = torch.tensor(keep, dtype=torch.long, device=self.ids.device)
            self.rows, self.ids, self.real = [self.rows[i] for i in keep], self.ids[idx], self.real[idx]
            self.kv.select(keep)
        return gone


class Batcher:
    def __init__(self, served: ServedModel, *, max_rows: int, max_tokens: int,
                 on_token: Callable[[Row, TokenEvent], None], on_finish: Callable[[Row], None]):
        self.served, self.max_rows, self.max_tokens = served, max_rows, max_tokens
        self.on_token, self.on_finish = on_token, on_finish
        self.waiting: deque[Row] = deque()      # appended by other threads (deque ops are atomic)
        self.running: list[Row] = []
        self.kv = PaddedKV(served.device, cache_class(served.model))
        self.group: Group | None = None

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.group)

    @property
    def active(self) -> list[Row]:
        """Rows holding KV: running, or in the prefill group."""
        return self.running + (self.group.rows if self.group else [])

    @torch.inference_mode()
    def step(self) -> Step:
        self._leave()
        rows = self._decode()
        return Step(rows, rows + self._prefill(self.max_tokens - rows))

    def reset(self) -> list[Row]:
        """Forget the running batch and the group (after a failed step); returns their rows."""
        rows, self.running, self.group, self.kv = self.active, [], None, \
            PaddedKV(self.served.device, cache_class(self.served.model))
        return rows

    def _decode(self) -> int:
        if not self.running:
            return 0
        ids = torch.tensor([[r.ids[-1]] for r in self.running], device=self.served.device)   # [B, 1]
        logits = self.kv.forward(self.served.model, ids, torch.ones_like(ids))              # [B, V]
        self._emit(self.running, logits)
        n = len(self.running)
        self._leave()
        return n

    def _prefill(self, budget: int) -> int:
        if self.group is not None:
            for row in self.group.drop_cancelled():
                self.on_finish(row)
            if not self.group.rows:
                self.group = None
        if self.group is None:
            self.group = self._admit(budget)
        if self.group is None:
            return 0
        g = self.group
        chunk = min(max(1, budget // len(g.rows)), g.width - g.done)
        cols = slice(g.done, g.done + chunk)
        logits = g.kv.forward(self.served.model, g.ids[:, cols], g.real[:, cols])          # [G, V]
        g.done += chunk
        if g.done == g.width:
            self.group = None
            self._emit(g.rows, logits)
            self.running += g.rows
            self.kv.merge(g.kv)
            self._leave()
        return len(g.rows) * chunk

    def _admit(self, budget: int) -> Group | None:
        """The next group: waiting rows in order while their padded prompts fit `budget` (the
        first one always, chunked if need be) and rows are free."""
        rows: list[Row] = []
        width, free = 0, self.max_rows - len(self.running)
        while self.waiting and len(rows) < free and budget > 0:
            row = self.waiting[0]
            if row.cancelled:
                self.on_finish(self.waiting.popleft())
                continue
            w = max(width, len(row.prompt_ids))
            if rows and (len(rows) + 1) * w > budget:
                break
            rows.append(self.waiting.popleft())
            width = w
        return Group(rows, self.served) if rows else None

    def _emit(self, rows: list[Row], logits: torch.Tensor) -> None:
        for row, (token, logprob) in zip(rows, sample_rows(logits, rows)):
            if not row.done:
                self.on_token(row, row.push(token, logprob))

    def _leave(self) -> None:
        keep = [i for i, r in enumerate(self.running) if not r.done]
        if len(keep) == len(self.running):
            return
        for row in self.running:
            if row.done:
                self.on_finish(row)
        self.running = [self.running[i] for i in keep]
        self.kv.select(keep)
        self.kv.trim()
