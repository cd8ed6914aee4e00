"""A step's rows as the model's inputs (runner.py's Runner builds its steps with these): decode rows
and prompt chunks -> ids and service/model/paged.py's Context, eagerly, or every prompt token as
a decode row of its sequence when its chunk is short (`reads`).

    ids, positions, slots [N]   tables [B, M]   lengths [B]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import fixed, paged

SHORT_PROMPT = 256                 # a chunk whose tokens, as decode rows, read no more keys than a prompt of
                                   # this many tokens does (S (S + 1) / 2) attends as decode rows


@dataclass
class Decode:
    """A decode row: its newest token goes in at `position`, it then sees position + 1 keys."""
    token: int
    position: int
    table: list[int]


@dataclass
class Chunk:
    """Prompt tokens start:start + len(tokens) of a sequence; `every`: logits at each of them (its
    prompt's log-probabilities), not just the last; `whole`: they are the whole prompt past its
    prefix cache hits, the chunk it would be prefilled as alone."""
    tokens: list[int]
    start: int
    table: list[int]
    every: bool = False
    whole: bool = False

    @property
    def logit_rows(self) -> int:
        return len(self.tokens) if self.every else 1


def reads(c: Chunk) -> int:
    """Keys a chunk's tokens read as decode rows (token i sees start + i + 1): a prompt's tail past its
    prefix cache hits reads few, whatever its start."""
    n = len(c.tokens)
    return n * c.start + n * (n + 1) // 2


class StepInputs:
    """Runner's input building (a mixin: it reads the runner's block_size, cache, device and fused)."""

    def _tables(self, tables: list[list[int]], width: int, rows: int) -> torch.Tensor:
        """[rows, width] block tables, padded with the padding block (host)."""
        pad = self.cache.pad_block
        return torch.tensor([t[:width] + [pad] * (width - len(t[:width])) for t in tables]
                            + [[pad] * width] * (rows - len(tables)), dtype=torch.long)

    def _decode_inputs(self, decodes: list[Decode], rows: int, width: int) -> tuple[torch.Tensor, ...]:
        """Host tensors of `decodes` padded to `rows`: ids, positions, slots [rows], tables [rows, width],
        lengths [rows]."""
        pad, bs = rows - len(decodes), self.block_size
        ids = torch.tensor([d.token for d in decodes] + [0] * pad, dtype=torch.long)
        positions = torch.tensor([d.position for d in decodes] + [0] * pad, dtype=torch.long)
        tables = self._tables([d.table for d in decodes], width, rows)
        slots = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs     # pad rows: pad block
        lengths = positions + 1
        return ids, positions, slots, tables, lengths

    def _width(self, decodes: list[Decode]) -> int:
        return -(-max(d.position + 1 for d in decodes) // self.block_size)

    @staticmethod
    def _fused_prompts(chunks: list[Chunk]) -> bool:
        """Whether a step's prompt rows leave it to the fused op (`_shape`'s `fuse`): each chunk a
        whole prompt that alone would be fused (fixed.fused_prompt)."""
        return all(c.whole and fixed.fused_prompt(len(c.tokens)) for c in chunks)

    def _prompts_as_rows(self, chunks: list[Chunk]) -> bool:
        """Whether the chunks' tokens go in as decode rows (`_as_decode_rows`)."""
        return self.fused is not None and getattr(self.fused, "prompts_as_decode_rows", True) and bool(chunks) \
            and all(reads(c) <= SHORT_PROMPT * (SHORT_PROMPT + 1) // 2 for c in chunks)

    def _eager_inputs(self, decodes: list[Decode], chunks: list[Chunk]) -> tuple[torch.Tensor, paged.Context]:
        if self._prompts_as_rows(chunks):
            return self._as_decode_rows(decodes, chunks)
        b, bs = len(decodes), self.block_size
        ids, pos, slots, tables, lengths = self._decode_inputs(decodes, b, self._width(decodes)) if b else \
            (torch.zeros(0, dtype=torch.long),) * 5
        ids, pos, slots, prefills, last, start = [ids], [pos], [slots], [], list(range(b)), b
        for c in chunks:
            end = c.start + len(c.tokens)
            table = torch.tensor(c.table[:-(-end // bs)], dtype=torch.long)
            context = (table[:, None] * bs + torch.arange(bs)).flatten()[:end]                  # [end] slots
            ids.append(torch.tensor(c.tokens, dtype=torch.long))
            pos.append(torch.arange(c.start, end))
            slots.append(context[c.start:])
            prefills.append(paged.Prefill(start, len(c.tokens), c.start, context.to(self.device)))
            start += len(c.tokens)
            last.extend(range(start - c.logit_rows, start))
        dev = self.device
        ctx = paged.Context(torch.cat(pos).to(dev), torch.cat(slots).to(dev), b, tables.to(dev) if b else None,
                            lengths.to(dev) if b else None, prefills, torch.tensor(last, device=dev),
                            int(lengths.max()) if b else None)
        return torch.cat(ids).to(dev), ctx

    def _as_decode_rows(self, decodes: list[Decode], chunks: list[Chunk]) -> tuple[torch.Tensor, paged.Context]:
        """Every prompt token as a decode row of its sequence (it sees its position + 1 keys, its
        own chunk's earlier ones written in the same step): one attention launch a layer for the
        whole step, where SDPA took one per chunk (Triton's step, short prompts only: a token
        reads its keys alone, O(S^2) reads a chunk)."""
        ids, ctx = self._eager_inputs(decodes + self._prompt_rows(chunks), [])
        ctx.last = self._last_rows(decodes, chunks).to(self.device)
        return ids, ctx

    @staticmethod
    def _prompt_rows(chunks: list[Chunk]) -> list[Decode]:
        return [Decode(t, c.start + i, c.table) for c in chunks for i, t in enumerate(c.tokens)]

    @staticmethod
    def _last_rows(decodes: list[Decode], chunks: list[Chunk]) -> torch.Tensor:
        """Rows of `decodes + _prompt_rows(chunks)` whose logits a step gives: each decode's, each
        chunk's last (each of its rows where `every`)."""
        rows, end = list(range(len(decodes))), len(decodes)
        for c in chunks:
            end += len(c.tokens)
            rows.extend(range(end - c.logit_rows, end))
        return torch.tensor(rows)
