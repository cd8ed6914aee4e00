"""The KV caches of llama.py's models (the engine wraps them: service/engine/kv.py).

* `KVCache`: each layer's keys and values in buffers with room to grow along T (`KVLayer`), so a
  decode step writes its new columns in place and dropping leading columns is a view.
* `ConcatKVCache`: the same interface by concatenation (the reference the tests compare with).

    keys, values [B, KV, T, D]
"""
from __future__ import annotations

from types import SimpleNamespace

import torch


class KVLayer:
    """One layer's keys and values [B, KV, T, D]: columns start:end of buffers with room to grow
    along T, so that a step writes its new columns in place (when the room runs out the buffers
    are rebuilt twice as wide: amortised O(1) a column, where torch.cat copied the whole cache
    every step), and dropping leading columns is a view.

        buffer [B, KV, capacity, D]:   | dropped | keys: start .. end | room |
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        t = keys.shape[2]
        self.place([keys], [values], t, t + max(ROOM, t))

    def place(self, keys: list[torch.Tensor], values: list[torch.Tensor], width: int, capacity: int) -> None:
        """New buffers of `capacity` columns holding the rows of `keys` / `values` one after
        another, left-padded to `width` (`_stacked`)."""
        self.kbuf, self.vbuf = _stacked(keys, width, capacity), _stacked(values, width, capacity)
        self.start, self.end = 0, width

    @property
    def keys(self) -> torch.Tensor:
        return self.kbuf[:, :, self.start:self.end]

    @property
    def values(self) -> torch.Tensor:
        return self.vbuf[:, :, self.start:self.end]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, KV, s, D] after the last column."""
        s = k.shape[2]
        if self.end + s > self.kbuf.shape[2]:
            t = self.end - self.start
            self.place([self.keys], [self.values], t, t + max(ROOM, t, s))
        self.kbuf[:, :, self.end:self.end + s] = k
        self.vbuf[:, :, self.end:self.end + s] = v
        self.end += s

    def select(self, idx: torch.Tensor) -> None:
        self.kbuf, self.vbuf = self.kbuf[idx], self.vbuf[idx]           # the room comes along


ROOM = 16                          # spare columns a (re)built layer gets at least


def _stacked(parts: list[torch.Tensor], width: int, capacity: int) -> torch.Tensor:
    """The rows of `parts` [Bi, KV, Ti, D] one after another in a new [sum Bi, KV, capacity, D],
    each right-aligned at column `width`: zero columns before it (left padding: masked, but
    finite, so that a masked score times it stays 0), room after it (never read)."""
    _, h, _, d = parts[0].shape
    out = parts[0].new_empty(sum(p.shape[0] for p in parts), h, capacity, d)
    row = 0
    for p in parts:
        n, pad = p.shape[0], width - p.shape[2]
        out[row:row + n, :, :pad].zero_()
        out[row:row + n, :, pad:width] = p
        row += n
    return out


class KVCache:
    """Keys and values per layer, appended in place (KVLayer): DynamicCache's interface as the
    engine uses it (`layers[i].keys` / `.values`, update, get_seq_length, batch_select_indices,
    crop), and the two edits of a left-padded batch (service/engine/kv.py) done without copying
    the whole cache: `drop_front` and `merge`."""

    def __init__(self) -> None:
        self.layers: list[KVLayer] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.layers):
            self.layers.append(KVLayer(k, v))
        else:
            self.layers[layer].append(k, v)
        return self.layers[layer].keys, self.layers[layer].values

    def get_seq_length(self, layer: int = 0) -> int:
        return self.layers[layer].keys.shape[2] if layer < len(self.layers) else 0

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        for kv in self.layers:
            kv.select(idx)

    def crop(self, length: int) -> None:
        for kv in self.layers:
            kv.end = min(kv.end, kv.start + length)

    def drop_front(self, n: int) -> None:
        """Forget the first n columns of every layer (a view)."""
        for kv in self.layers:
            kv.start = min(kv.start + n, kv.end)

    def merge(self, other: KVCache, width: int) -> None:
        """`other`'s rows after these, both sides left-padded with zero columns to `width`."""
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.place([mine.keys, theirs.keys], [mine.values, theirs.values], width, width + max(ROOM, width))


class ConcatKVCache:
    """The cache KVCache replaced, kept as its reference (tests/service/engine/test_kv.py checks the two
    against each other, bench/experiments/engine_ab.py times them): DynamicCache's behaviour, every update a
    torch.cat of the whole layer. The engine treats it as any cache that is not a KVCache."""

    def __init__(self) -> None:
        self.layers: list[SimpleNamespace] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.layers):
            self.layers.append(SimpleNamespace(keys=k, values=v))
        else:
            kv = self.layers[layer]
            kv.keys, kv.values = torch.cat([kv.keys, k], dim=2), torch.cat([kv.values, v], dim=2)
        return self.layers[layer].keys, self.layers[layer].values

    def get_seq_length(self, layer: int = 0) -> int:
        return self.layers[layer].keys.shape[2] if layer < len(self.layers) else 0

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        for kv in self.layers:
            kv.keys, kv.values = kv.keys[idx], kv.values[idx]

    def crop(self, length: int) -> None:
        for kv in self.layers:
            kv.keys, kv.values = kv.keys[:, :, :length], kv.values[:, :, :length]
