"""Continuous batching over a paged KV cache, for llama.py's models: rows (requests) in, token
events out, without threads. The same interface as batcher.py's `Batcher` (which serves
transformers' models), so the worker runs either.

Each `step()`:
  1. rows that finished or were cancelled leave; their blocks go back (blocks.py);
  2. room: every decoding row gets the block of its next position, oldest arrival first; when
     none is free, the decoding row that arrived last is preempted (vLLM's recompute): its blocks
     go back, named for the prefix cache, and it waits at the head of the line to prefill its
     prompt and generated tokens again (most of them found in that cache) and decode on;
  3. admit: waiting rows, first come first served, while rows are free and the cache has the
     blocks of their prompt and first token, and WATERMARK of the cache spare; the others wait.
     A row takes the cached blocks of its prompt's longest known prefix (blocks.py's prefix
     cache; not a row that scores its prompt) and prefills only the tokens after them. With CUDA graphs, while
     rows are decoding, admission waits up to `prefill_wait_s` to gather arrivals into one prompt
     step (whole short prompts replay a prompt bucket's graph, runner.py; longer ones run eager);
  4. chunk: the token budget (`max_tokens` less one per decoding row) goes to the prefilling rows'
     prompts in order, a chunk each, so a long prompt never stalls the decoding rows; a row that
     scores its prompt (prompt_logprobs) gets logits at every token of its chunk, such rows
     PROMPT_LOGITS tokens a step in all;
  5. one forward (runner.py): every decoding row's newest token and every chunk, each row against
     its own blocks; a decode-only step replays a CUDA graph;
  6. decoding rows sample their next token; a row whose prompt is complete samples its first and
     starts decoding (a preempted row's prefill ends in no token: it decodes on from its newest).
Pipelined (CUDA graphs; decoding rows only, all greedy, none waiting to be admitted), a step
instead launches the rows' next step, its tokens read on the device from the last launch's picks,
then pushes the last launch's tokens while the device computes: the host's work per token
(sampling's copy, detokenizing, the events) overlaps the step rather than following it. Only
while every row has its launch's block free to take: a step that must preempt waits.

A row's attention sees only its own blocks (shared ones hold the same tokens at the same
positions), so batching and the prefix cache change no row's tokens beyond floating-point
reordering. `on_token(row, event)` fires for every token, `on_finish(row)` once per row.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ValidationFailed
from .batcher import Step, drop_cancelled
from .blocks import BlockManager, names
from .inputs import Chunk, Decode
from .runner import Launched, Runner
from .logits import sample_rows
from .sampling import PROMPT_LOGITS, Row, TokenEvent


WATERMARK = 0.01                        # of the cache's blocks left free by an admission (vLLM's)


def feed(row: Row) -> list[int]:
    """What a row's prefill writes: its prompt, and once preempted its generated tokens but the
    newest (which its next decode step feeds)."""
    return row.prompt_ids + row.ids[:-1]


class Seq:
    """A row's place in the cache: its blocks, how much of its feed is in (from the first block
    past its prefix cache hits, `hit` tokens), and whether a launched step's token for it is still
    on its way (`ahead`: 0 or 1). `names`: its feed's whole blocks' names (blocks.py)."""

    def __init__(self, row: Row, table: list[int], feed_names: list[bytes], hit: int = 0):
        self.row, self.table, self.names, self.prefilled, self.hit, self.ahead = row, table, feed_names, hit, hit, 0
        self.feed, self.resumed = feed(row), bool(row.ids)

    def written(self) -> list[int]:
        """The tokens whose keys and values its returned steps wrote: the feed's prefilled part,
        then, once it decodes, each token but the newest (not fed yet)."""
        return (self.row.prompt_ids + self.row.ids)[:-1] if self.prefill_done else self.feed[:self.prefilled]

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.feed)

    @property
    def position(self) -> int:
        """Where its next decode step writes (past a launched token on its way)."""
        return len(self.row.prompt_ids) + len(self.row.ids) - 1 + self.ahead

    def decode(self) -> Decode:
        """Its next decode step; with a token on its way, the token is the device's (0 here)."""
        return Decode(self.row.ids[-1] if not self.ahead else 0, self.position, self.table)


@dataclass
class Pending:
    """A launched decode step whose tokens are not pushed yet."""
    seqs: list[Seq]
    launched: Launched


class Scheduler:
    def __init__(self, runner: Runner, blocks: BlockManager, *, max_rows: int, max_tokens: int,
                 on_token: Callable[[Row, TokenEvent], None], on_finish: Callable[[Row], None],
                 prefill_wait_s: float = 0.0):
        self.runner, self.blocks = runner, blocks
        self.max_rows, self.max_tokens, self.prefill_wait_s = max_rows, max_tokens, prefill_wait_s
        self.on_token, self.on_finish = on_token, on_finish
        self.waiting: deque[Row] = deque()      # appended by other threads (deque ops are atomic)
        self.arrived: dict[int, float] = {}
        self.prompt_names: dict[int, list[bytes]] = {}     # a waiting row's feed's (add: off the engine's thread)
        self.preempted = 0                      # rows preempted so far (wcodec_generate_preemptions_total)
        self.running: list[Seq] = []            # decoding
        self.prefilling: list[Seq] = []
        self.pending: Pending | None = None     # a launched step (pipelined: below)

    def add(self, row: Row) -> None:
        """Queue `row`; ValidationFailed when its budget is more than the whole cache holds."""
        if not self.blocks.fits(self._budget(row)):
            raise ValidationFailed(f"{self._budget(row)} tokens (prompt + max_new_tokens) do not fit the KV "
                                   f"cache ({self.blocks.blocks} blocks of {self.blocks.block_size} tokens)")
        if self.blocks.prefix_caching:
            self.prompt_names[id(row)] = names(row.prompt_ids, self.blocks.block_size, [])
        self.arrived[id(row)] = time.perf_counter()
        self.waiting.append(row)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.prefilling or self.pending)

    @property
    def active(self) -> list[Row]:
        return [s.row for s in self.running + self.prefilling]

    @torch.inference_mode()
    def step(self) -> Step:
        was = self.preempted
        self._leave()
        drop_cancelled(self.waiting, self._gone)
        if self.pending is None:
            self.runner.adopt()                     # kernels warmed since the last step (runner.py)
        if self._pipelines():
            return self._launch()
        self._drain()
        self._make_room(preempt=True)
        self._admit()
        chunks = self._chunks(self.max_tokens - len(self.running))
        decoding = list(self.running)
        if not decoding and not chunks:
            return Step(0, 0, self.preempted - was)
        logits = self.runner.run([s.decode() for s in decoding], [c for _, c in chunks])   # [B + P, V]
        self.runner.start_warming(now=True)         # a request has been served: its kernels may compile
        self._emit([s.row for s in decoding], logits[:len(decoding)])
        done, at = [], len(decoding)
        for s, c in chunks:                         # a chunk's logits: its last token's, or each token's
            if c.every:
                s.row.score_prompt(c.start, logits[at:at + c.logit_rows])
            at += c.logit_rows
            if self._advance(s, c):
                done.append((at - 1, s))
            self.blocks.name(s.table, s.names[:s.prefilled // self.blocks.block_size])
        if fresh := [(i, s) for i, s in done if not s.resumed]:   # a resumed row decodes on from its newest token
            for _, s in fresh:
                s.row.prompt_in()
            self._emit([s.row for _, s in fresh], logits[[i for i, _ in fresh]])
        if done:
            for _, s in done:
                self.prefilling.remove(s)
                self.running.append(s)
        self._leave()
        return Step(len(decoding) + len(chunks), len(decoding) + sum(len(c.tokens) for _, c in chunks),
                    self.preempted - was)

    def reset(self) -> list[Row]:
        """Forget every running and prefilling row (after a failed step); returns their rows."""
        rows = self.active
        for s in self.running + self.prefilling:
            self.blocks.release(s.table)
        self.running, self.prefilling, self.pending = [], [], None
        return rows

    # ---- pipelined decode steps ------------------------------------------------------------------
    def _pipelines(self) -> bool:
        """Whether this step is queued behind the last one before the last one's tokens are known
        (the host's work on those tokens then overlaps the device's step): CUDA graphs, decoding
        rows only, every one greedy without a penalty, no waiting row that could be admitted, and
        the block of each row's launched position at hand."""
        return self.runner.pipelined and bool(self.running) and not self.prefilling \
            and len(self.running) <= self.runner.max_rows and not self._admissible() \
            and all(s.row.greedy for s in self.running) and self._make_room(preempt=False)

    def _admissible(self) -> bool:
        return bool(self.waiting) and len(self.running) + len(self.prefilling) < self.max_rows \
            and self._fits_now(self.waiting[0], self._hits(self.waiting[0])) and self._ready_to_admit()

    def _fits_now(self, row: Row, hits: list[int]) -> bool:
        """Whether the cache has the blocks of `row`'s feed and first decoded token (past its hits),
        with WATERMARK of the cache spare for the decoding rows' next blocks; a preempted row needs
        no spare (it held its blocks before)."""
        spare = 0 if row.ids else int(self.blocks.blocks * WATERMARK)
        return self.blocks.can_allocate(len(feed(row)) + 1, hits, spare)

    def _make_room(self, preempt: bool) -> bool:
        """Give each decoding row, oldest arrival first, the block of its next position (with a
        launched token on its way, the one after). None free: False, or with `preempt` the row
        that arrived last is preempted until one is; True once every remaining row has its block."""
        short = lambda s: s.position >= len(s.table) * self.blocks.block_size
        for s in sorted((s for s in self.running if short(s)), key=self._arrival):
            while s in self.running and short(s):
                if self.blocks.can_allocate(self.blocks.block_size):
                    s.table += self.blocks.allocate(self.blocks.block_size)
                elif not preempt:
                    return False
                else:
                    self._preempt(max(self.running, key=self._arrival))
        return True

    def _preempt(self, s: Seq) -> None:
        """Back to the head of the line: its written blocks named and released (no launched step is
        on its way: the caller drained them), to be prefilled again from the prefix cache."""
        self.running.remove(s)
        self._name_written(s)
        self.blocks.release(s.table)
        if self.blocks.prefix_caching:
            self.prompt_names[id(s.row)] = names(feed(s.row), self.blocks.block_size, [])
        self.waiting.appendleft(s.row)
        self.preempted += 1

    def _arrival(self, s: Seq) -> float:
        return self.arrived.get(id(s.row), 0.0)

    def _launch(self) -> Step:
        """Launch a step of the running rows, then push the previous launch's tokens. A row that
        those tokens finish has had one more step launched: its token is dropped, and the blocks
        it wrote were its own (the budget covers that position) until the stream has passed it."""
        prev, seqs = self.pending, list(self.running)
        where = {id(s): i for i, s in enumerate(prev.seqs)} if prev else {}
        launched = self.runner.launch([s.decode() for s in seqs], [where.get(id(s), -1) for s in seqs])
        for s in seqs:
            s.ahead += 1
        self.pending = Pending(seqs, launched)
        if prev is not None:
            self._push(prev)
        return Step(len(seqs), len(seqs))

    def _drain(self) -> None:
        if self.pending is not None:
            prev, self.pending = self.pending, None
            self._push(prev)

    def _push(self, p: Pending) -> None:
        for s, (token, logprob) in zip(p.seqs, self.runner.picks(p.launched)):
            s.ahead -= 1
            if not s.row.done:
                self.on_token(s.row, s.row.push(token, logprob))

    def _advance(self, s: Seq, c: Chunk) -> bool:
        s.prefilled = c.start + len(c.tokens)
        return s.prefill_done

    def _chunks(self, budget: int) -> list[tuple[Seq, Chunk]]:
        """Each prefilling row's next chunk while the token budget lasts; rows scoring their
        prompts (prompt_logprobs: logits at every token) share PROMPT_LOGITS tokens a step."""
        out, scored = [], PROMPT_LOGITS
        for s in self.prefilling:
            every = s.row.params.prompt_logprobs is not None and not s.resumed     # scored once
            if (budget <= 0 or (every and scored <= 0)) and out:
                break
            n = max(1, min(len(s.feed) - s.prefilled, budget, scored if every else budget))
            whole = s.prefilled == s.hit and n == len(s.feed) - s.prefilled
            out.append((s, Chunk(s.feed[s.prefilled:s.prefilled + n], s.prefilled, s.table, every, whole)))
            budget, scored = budget - n, scored - (n if every else 0)
        return out

    def _budget(self, row: Row) -> int:
        return len(row.prompt_ids) + row.params.max_new_tokens

    def _hits(self, row: Row) -> list[int]:
        """A waiting row's prefix cache hits: none for a row that scores its prompt (every token's
        logits), but once it did."""
        if row.params.prompt_logprobs is not None and not row.ids:
            return []
        return self.blocks.hits(self.prompt_names.get(id(row), []), len(feed(row)))

    def _ready_to_admit(self) -> bool:
        """Now, unless graphs run the decoding rows and the first waiting row arrived under
        `prefill_wait_s` ago while fewer rows wait than are free."""
        if not self.running or not self.runner.use_graphs or self.prefill_wait_s <= 0:
            return True
        free = self.max_rows - len(self.running) - len(self.prefilling)
        waited = time.perf_counter() - self.arrived.get(id(self.waiting[0]), 0.0)
        return waited >= self.prefill_wait_s or len(self.waiting) >= free

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_rows:
            row = self.waiting[0]
            if row.cancelled:
                self._gone(self.waiting.popleft())
                continue
            hits = self._hits(row)
            if not self._fits_now(row, hits) or not self._ready_to_admit():
                return                                      # waits for blocks (or for company)
            hit = len(hits) * self.blocks.block_size
            self.waiting.popleft()
            if not row.ids:                                 # not a preempted row, admitted again
                row.admit().cached_tokens = hit
            table = self.blocks.allocate(len(feed(row)) + 1, hits)
            self.prefilling.append(Seq(row, table, self.prompt_names.pop(id(row), []), hit))

    def _gone(self, row: Row) -> None:
        self.arrived.pop(id(row), None)
        self.prompt_names.pop(id(row), None)
        self.on_finish(row)

    def _emit(self, rows: list[Row], logits: torch.Tensor) -> None:
        for row, pick in zip(rows, sample_rows(logits, rows)):
            if not row.done:                        # a failed pick (None) has ended its row
                self.on_token(row, row.push(*pick))

    def _leave(self) -> None:
        for seqs in (self.running, self.prefilling):
            gone = [s for s in seqs if s.row.done]
            for s in gone:
                seqs.remove(s)
                self._name_written(s)                       # its answer's blocks too: a chat's next turn
                self.blocks.release(s.table)
                self._gone(s.row)

    def _name_written(self, s: Seq) -> None:
        if self.blocks.prefix_caching:
            written = s.written()
            self.blocks.name(s.table, names(written, self.blocks.block_size,
                                            s.names[:len(written) // self.blocks.block_size]))
