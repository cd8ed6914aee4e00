"""The KV cache of a batch whose rows come and go: one cache of the model's kind, left-padded
(service/model/kvcache.py's KVCache for the models it serves, else transformers' `DynamicCache`).

Read me first. Every row's real tokens sit at the right end of the cache; the columns before them
are padding, masked out of attention:

    layer.keys, layer.values   [B, H, S, D]   row b's real tokens are its last lengths[b] columns
    lengths                    [B]            real tokens per row; also the next token's position
    mask()                     [B, S]         1 where a column is one of the row's real tokens

Prefill (left-padded prompts) and every decoding step (one column for every row) keep that true,
so the mask is never stored, only derived from `lengths`. Three operations change the rows:
`merge` appends the rows of another batch (the narrower side is left-padded with zero columns),
`select` keeps some rows (their KV leaves with them), and `trim` drops leading columns that are
padding for every remaining row. service/model/kvcache.py's KVCache keeps each layer in buffers with
room to grow: a step's columns are written in place, `trim` moves a start offset (a view), and
`merge` / `select` rebuild the buffers (a few times per request, not every step); transformers'
caches take the generic path (torch.cat every step, slicing, concatenating).

Why transformers' `DynamicCache` and not its continuous-batching manager
(`transformers.generation.continuous_batching`, paged attention): that manager seeds sampling for
the whole process (`torch.manual_seed`), so TGI's per-request `seed` could not reproduce a
request; per-request sampling covers only processors switched on in the generation config when it
starts, and has no repetition penalty; and it owns the thread, the queue (a blocking put, no 429)
and the scheduler, which here belong to the engine. `DynamicCache` already selects rows
(`batch_select_indices`); what it lacks, adding rows of another length, is `merge` below.
The cache is created without the model's config, so every layer is a full `DynamicLayer`: a
sliding-window layer would drop columns on its own and break the right alignment (the model's
mask still applies its window, so only memory is lost). A model of service/model/llama.py gets that
file's KVCache (the same interface): serving it never imports transformers, which costs 1-2 s on
the start-up's critical path (measured: the first engine's creation took 1.1 s on the CPU, 2.0 s
on an H100 box, all of it that import).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ..model import kvcache, llama


def cache_class(model: torch.nn.Module) -> type:
    """The KV cache a model's forward takes: its own (service/model/llama.py), else DynamicCache."""
    if isinstance(model, llama.LlamaForCausalLM):
        return kvcache.KVCache
    from transformers import DynamicCache
    return DynamicCache


class PaddedKV:
    def __init__(self, device: torch.device, cache: type, rows: int = 0):
        self.cache = cache()
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # [B]
        self.width = 0                                                       # S

    @property
    def rows(self) -> int:
        return self.lengths.numel()

    def mask(self) -> torch.Tensor:
        cols = torch.arange(self.width, device=self.lengths.device)        # [S]
        return (cols >= self.width - self.lengths[:, None]).long()        # [B, S]

    def _segment(self, ids: torch.Tensor, real: torch.Tensor) -> llama.Segment:
        """The model's inputs for `ids` [B, q] (`real` [B, q]: 1 for a token, 0 for left padding)
        after this cache: mask [B, S + q], positions [B, q]."""
        real = real.long()
        mask = torch.cat([self.mask(), real], dim=1)                        # [B, S + q]
        pos = (self.lengths[:, None] + real.cumsum(-1) - 1).clamp(min=0)    # [B, q]
        return llama.Segment(ids, mask, pos, self.cache)

    def _advance(self, real: torch.Tensor) -> None:
        """`real` [B, q] went in: the cache holds q more columns."""
        self.lengths = self.lengths + real.long().sum(-1)
        self.width += real.shape[1]

    def select(self, keep: list[int]) -> None:
        """Keep rows `keep` (in that order); the others' KV is freed."""
        if len(keep) == self.rows:
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.lengths.device)
        if self.width:
            self.cache.batch_select_indices(idx)
        self.lengths = self.lengths[idx]

    def trim(self) -> None:
        """Drop the leading columns that no remaining row uses."""
        width = int(self.lengths.max()) if self.rows else 0
        drop = self.width - width
        if drop > 0:
            if isinstance(self.cache, kvcache.KVCache):
                self.cache.drop_front(drop)
            else:
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[..., drop:, :], layer.values[..., drop:, :]
            self.width = width
        if not self.rows:
            self.cache, self.width = type(self.cache)(), 0

    def merge(self, other: PaddedKV) -> None:
        """Append `other`'s rows after this batch's."""
        if not self.rows:
            self.cache, self.lengths, self.width = other.cache, other.lengths, other.width
            return
        width = max(self.width, other.width)
        if isinstance(self.cache, kvcache.KVCache):
            self.cache.merge(other.cache, width)        # one copy into buffers with room to grow
        else:
            for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
                mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
                mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.width = width


def forward_all(model: torch.nn.Module, parts: list[tuple[PaddedKV, torch.Tensor, torch.Tensor]],
                every: bool = False) -> list[torch.Tensor]:
    """Feed several batches, each (kv, ids [B, q], real [B, q]: 1 for a token, 0 for left padding)
    after its own cache, which grows by q columns; returns each one's last-position logits [B, V]
    in float32 (`every`: each position's, [B, q, V]). service/model/llama.py's models take them in
    one pass (`forward_segments`: each weight read once for a decoding step and a prompt chunk
    together); transformers' models get one forward per batch."""
    segments = [kv._segment(ids, real) for kv, ids, real in parts]
    keep = 0 if every else 1                                   # transformers' logits_to_keep: 0 is all
    if isinstance(model, llama.LlamaForCausalLM):
        outs = model.forward_segments(segments, logits_to_keep=keep)
    else:
        name = _cache_keyword(model)
        outs = [model(input_ids=s.ids, attention_mask=s.attention_mask, position_ids=s.position_ids,
                      **{name: s.cache}, use_cache=True, logits_to_keep=keep).logits for s in segments]
    for kv, _, real in parts:
        kv._advance(real)
    return [out.float() if every else out[:, -1].float() for out in outs]


def _cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a transformers model's forward takes its cache by: `cache` from transformers
    5.24 (where `past_key_values` is deprecated, to go in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, width, D], zero columns in front."""
    return F.pad(t, (0, 0, width - t.shape[-2], 0)) if t.shape[-2] < width else t
