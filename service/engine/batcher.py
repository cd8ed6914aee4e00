"""Continuous batching for one model, without threads: rows (requests) in, token events out.

Each `step()`:
  1. rows that were cancelled since the last step leave, with their KV columns;
  2. plan the prefill: the rest of the step's token budget (`max_tokens` less one per running
     row) goes to prompts. When no prefill is under way, waiting rows form the next group, first
     come first served, as many as fit the budget and the free rows; a group's left-padded
     prompts [G, W] advance by `budget // G` columns per step (a chunk), so a long prompt never
     stalls the running rows for more than one budget's worth of tokens;
  3. one forward (`kv.forward_all`): every running row feeds its newest token ([B, 1]) and the
     group its chunk ([G, chunk]), each against its own cache, every weight read once for both;
  4. decode: every running row samples its next token; rows that finish leave at once;
  5. prefill: when the group's prompts are done, each of its rows samples its first token and the
     group joins the running batch (`merge`).

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

from .logits import sample_rows
from .sampling import PROMPT_LOGITS, Row, TokenEvent, left_pad
from ..model.build import ServedModel
from .kv import PaddedKV, cache_class, forward_all


@dataclass(frozen=True)
class Step:
    rows: int           # rows the step ran: decoded, and prefilled (a chunk of their prompts)
    tokens: int         # tokens fed to the model: decoded rows + prompt tokens prefilled
    preempted: int = 0  # decoding rows sent back to the queue by this step (scheduler.py)


def drop_cancelled(waiting: deque[Row], gone: Callable[[Row], None]) -> None:
    """Answer and take out every cancelled row of the waiting line, wherever it stands: one behind
    a row that waits for blocks, or while the running rows fill the batch, would otherwise keep
    its place (and its queue slot, and its client) until it reached the head. Row by row, as the
    event loop's thread may append meanwhile."""
    for row in [r for r in waiting if r.cancelled]:
        waiting.remove(row)
        gone(row)


class Group:
    """Rows whose prompts are being prefilled together, in chunks of columns."""

    def __init__(self, rows: list[Row], served: ServedModel, cache: type):
        self.rows = rows
        self.ids, self.real = left_pad([r.prompt_ids for r in rows], served.pad_id, served.device)  # [G, W]
        self.kv = PaddedKV(served.device, cache, len(rows))
        self.done = 0                                   # columns prefilled
        self.scores = any(r.params.prompt_logprobs is not None for r in rows)   # logits at every column

    def score(self, logits: torch.Tensor) -> None:
        """The chunk's logits [G, chunk, V] (columns done .. done + chunk - 1): each scoring row's
        prompt positions among them (a row's prompt ends at the last column; padding in front)."""
        for i, row in enumerate(self.rows):
            if row.params.prompt_logprobs is None:
                continue
            pad = self.width - len(row.prompt_ids)                  # column of its position 0
            skip = max(0, pad - self.done)                          # padding columns of this chunk
            if skip < logits.shape[1]:
                row.score_prompt(self.done + skip - pad, logits[i, skip:])

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
        self.cache = cache_class(served.model)        # the KV cache class of the model's forward
        self.kv = PaddedKV(served.device, self.cache)
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
        drop_cancelled(self.waiting, self.on_finish)
        rows, group, chunk = len(self.running), self._plan(self.max_tokens - len(self.running)), 0
        parts = []
        if rows:
            ids = torch.tensor([[r.ids[-1]] for r in self.running], device=self.served.device)  # [B, 1]
            parts.append((self.kv, ids, torch.ones_like(ids)))
        every = group is not None and group.scores
        if group is not None:
            chunk = min(max(1, (self.max_tokens - rows) // len(group.rows)), group.width - group.done)
            chunk = max(1, min(chunk, PROMPT_LOGITS // len(group.rows))) if every else chunk
            cols = slice(group.done, group.done + chunk)
            parts.append((group.kv, group.ids[:, cols], group.real[:, cols]))                # [G, chunk]
        logits = forward_all(self.served.model, parts, every) if parts else []
        if rows:
            self._emit(self.running, logits[0][:, -1] if every else logits[0])
            self._leave()
        if group is not None:
            if every:
                group.score(logits[-1])                                                     # [G, chunk, V]
            self._prefilled(group, chunk, logits[-1][:, -1] if every else logits[-1])
        prefilled = len(group.rows) if group else 0
        return Step(rows + prefilled, rows + prefilled * chunk)

    def reset(self) -> list[Row]:
        """Forget the running batch and the group (after a failed step); returns their rows."""
        rows, self.running, self.group, self.kv = self.active, [], None, \
            PaddedKV(self.served.device, self.cache)
        return rows

    def _plan(self, budget: int) -> Group | None:
        """The group this step prefills: the one under way (less its cancelled rows), or a new one."""
        if self.group is not None:
            for row in self.group.drop_cancelled():
                self.on_finish(row)
            if not self.group.rows:
                self.group = None
        if self.group is None:
            self.group = self._admit(budget)
        return self.group

    def _prefilled(self, g: Group, chunk: int, logits: torch.Tensor) -> None:
        """`chunk` more columns of the group went in; at the end of its prompts it joins."""
        g.done += chunk
        if g.done == g.width:
            for row in g.rows:
                row.prompt_in()
            self._emit(g.rows, logits)           # before the group is let go: a failing one stays in `active`
            self.group = None
            self.running += g.rows
            self.kv.merge(g.kv)
            self._leave()

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
            rows.append(self.waiting.popleft().admit())
            width = w
        return Group(rows, self.served, self.cache) if rows else None

    def _emit(self, rows: list[Row], logits: torch.Tensor) -> None:
        for row, pick in zip(rows, sample_rows(logits, rows)):
            if not row.done:                        # a failed pick (None) has ended its row
                self.on_token(row, row.push(*pick))

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
