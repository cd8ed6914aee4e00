"""service/engine/kv.py's PaddedKV over service/model/kvcache.py's in-place KVCache (buffers with room,
a start offset, rebuilt on select and merge) holds exactly what it holds over a cache grown by
torch.cat (kv.py's generic DynamicCache path): the same keys and values, bit for bit, after every
append, select, trim, merge and crop, in a random sequence of them that outgrows every buffer."""
from __future__ import annotations

import random

import torch

from service.model import kvcache
from service.engine.kv import PaddedKV

LAYERS, HEADS, DIM = 3, 2, 4


def _append(pair: list[PaddedKV], g: torch.Generator, cols: int, padded: bool) -> None:
    """`cols` new columns for every row of both caches (left padding in a first chunk), what
    the model's layers write through `update`; both get the same values."""
    rows = pair[0].rows
    real = torch.ones(rows, cols, dtype=torch.long)
    if padded:
        for r in range(rows):
            real[r, :torch.randint(0, cols, (), generator=g)] = 0
    for layer in range(LAYERS):
        k, v = (torch.randn(rows, HEADS, cols, DIM, generator=g) for _ in range(2))
        outs = [kv.cache.update(k, v, layer) for kv in pair]
        assert all(torch.equal(a, b) for a, b in zip(*outs))
    for kv in pair:
        kv._advance(real)


def _fresh(g: torch.Generator, rows: int, width: int) -> list[PaddedKV]:
    pair = [PaddedKV(torch.device("cpu"), cache, rows) for cache in (kvcache.KVCache, kvcache.ConcatKVCache)]
    _append(pair, g, width, padded=True)
    return pair


def _same(pair: list[PaddedKV]) -> None:
    ours, ref = pair
    assert torch.equal(ours.lengths, ref.lengths) and ours.width == ref.width
    assert torch.equal(ours.mask(), ref.mask())
    assert len(ours.cache.layers) == len(ref.cache.layers)
    for a, b in zip(ours.cache.layers, ref.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.keys.shape[2] == ours.width


def test_in_place_cache_equals_the_concatenating_one() -> None:
    rnd, g = random.Random(0), torch.Generator().manual_seed(0)
    pair = _fresh(g, 5, 7)
    _same(pair)
    for _ in range(300):
        op = rnd.choice(["step"] * 6 + ["chunk", "select", "merge"])
        if op == "step" and pair[0].rows:
            _append(pair, g, 1, padded=False)                     # a decoding step: in place
        elif op == "chunk" and pair[0].rows:
            _append(pair, g, rnd.randint(2, 40), padded=False)    # may outgrow the room: rebuilt
        elif op == "select":
            keep = rnd.sample(range(pair[0].rows), rnd.randint(0, pair[0].rows))
            for kv in pair:
                kv.select(keep)
                kv.trim()                                          # a view that starts later
        elif op == "merge":
            other = _fresh(g, rnd.randint(1, 4), rnd.randint(1, 30))
            for kv, new in zip(pair, other):
                kv.merge(new)                                      # zero columns left-pad the narrower
        _same(pair)


def test_layer_grows_geometrically_and_writes_in_place() -> None:
    g = torch.Generator().manual_seed(1)
    cache = kvcache.KVCache()
    k = torch.randn(2, HEADS, 3, DIM, generator=g)
    cache.update(k, k, 0)
    buffers, grown = cache.layers[0].kbuf, 0
    for step in range(200):
        one = torch.randn(2, HEADS, 1, DIM, generator=g)
        keys, _ = cache.update(one, one, 0)
        assert keys.shape[2] == 4 + step and torch.equal(keys[:, :, -1:], one)
        if cache.layers[0].kbuf is not buffers:
            buffers, grown = cache.layers[0].kbuf, grown + 1
    assert grown <= 5                                    # 19, 38, 76, 152, 304 columns: doubling
    cache.crop(10)
    assert cache.get_seq_length() == 10 and torch.equal(cache.layers[0].keys[:, :, :3], k)
