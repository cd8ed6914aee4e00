"""Which exponent coder a format revision should use (issue 8's "measure rather than assume"): the
coded size of one trained-like 4096x4096 bf16 tensor's exponents, with the 4 context tables of
today's format (ctx_bits 2), under the current rANS and under the coders that decode more than one
symbol per table lookup or start from cheaper entry points. Streams only (tables excluded).

    python bench/experiments/coder_choice.py

* rANS, M = 2^12: the exact cost of today's normalised frequencies (the format's ideal; the file
  adds 24 bits a lane per segment, bench/experiments/segment_cost.py).
* tANS/FSE with 2^R states (R = 10, 11, 12): the cross-entropy of frequencies normalised to 2^R,
  a lower bound (a real table loses a little more to the spread of states).
* Canonical Huffman, codes at most L bits (L = 12, 16): exact. With one table (no context, so that
  one lookup can decode several symbols whatever their contexts), `codes per 12-bit lookup` is the
  mean number of whole codes in the next 12 bits of the stream: what a multi-symbol table decodes
  at once.
* An entry point costs 32 bits (a bit offset, or a state) per lane-piece in memory, as the resident
  index does now: at pieces of K symbols a lane, 32 / K bits a weight.
"""
from __future__ import annotations

import heapq

import numpy as np
from segment_cost import exponent_plane_counts

from codec.constants import PROB_BITS


def tans_bits(counts: np.ndarray, table_log: int) -> float:
    """Cross-entropy (bits) of `counts` [T, 256] under frequencies normalised to 2^table_log."""
    total_bits = 0.0
    for c in counts.astype(np.int64):
        if not c.any():
            continue
        scale = 1 << table_log
        f = np.where(c > 0, np.maximum(1, c * scale // c.sum()), 0)
        f[np.argmax(c)] += scale - f.sum()                     # the rounding's slack on the commonest
        used = c > 0
        total_bits += float(np.sum(c[used] * (table_log - np.log2(f[used]))))
    return total_bits


def huffman_lengths(c: np.ndarray, limit: int) -> np.ndarray:
    """Code lengths of a Huffman code of `c` (256 counts), then lengthened until every code fits
    `limit` bits and Kraft holds again (the rarest codes first)."""
    used = np.flatnonzero(c)
    lengths = np.zeros(256, np.int64)
    if len(used) == 1:
        lengths[used] = 1
        return lengths
    heap = [(int(c[s]), i, [int(s)]) for i, s in enumerate(used)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        a, _, sa = heapq.heappop(heap)
        b, _, sb = heapq.heappop(heap)
        for s in sa + sb:
            lengths[s] += 1
        heapq.heappush(heap, (a + b, tie, sa + sb))
        tie += 1
    lengths[used] = np.minimum(lengths[used], limit)
    order = used[np.argsort(c[used], kind="stable")]               # rarest first
    while np.sum(2.0 ** -lengths[used]) > 1.0:
        s = next(s for s in order if lengths[s] < limit)
        lengths[s] += 1
    return lengths


def per_lookup(code_lengths: np.ndarray, peek: int = 12) -> float:
    """Mean whole codes in each `peek`-bit window, decoding greedily (one lookup a window)."""
    lookups, i, n = 0, 0, len(code_lengths)
    cum = np.concatenate([[0], np.cumsum(code_lengths)])
    while i < n:
        j = int(np.searchsorted(cum, cum[i] + peek, side="right")) - 1   # last code ending inside
        i = max(j, i + 1)
        lookups += 1
    return n / lookups


def main() -> None:
    n, counts, rans_bits, keys = exponent_plane_counts()
    rows = [("rANS, M = 2^12 (today)", rans_bits / n, None)]
    for r in (10, 11, 12):
        rows.append((f"tANS, 2^{r} states (bound)", tans_bits(counts, r) / n, None))
    sample = keys[:1 << 20]
    for limit in (12, 16):
        lengths = np.stack([huffman_lengths(c, limit) for c in counts.astype(np.int64)])
        rows.append((f"Huffman, 4 context tables, codes <= {limit} bits", float(np.sum(counts * lengths)) / n, None))
        flat = counts.sum(axis=0).astype(np.int64)                  # one table: a lookup may span symbols
        one = huffman_lengths(flat, limit)
        rows.append((f"Huffman, one table, codes <= {limit} bits", float(np.sum(flat * one)) / n,
                     per_lookup(one[sample & 0xFF])))
    print(f"one trained-like 4096x4096 bf16 tensor, {n} exponents, 4 context tables (M = 2^{PROB_BITS})")
    print("| coder | bits/weight | ratio (streams) | codes per 12-bit lookup |")
    print("|---|---|---|---|")
    for name, bits, group in rows:
        print(f"| {name} | {bits:.4f} | {(8 + bits) / 16:.4f} | {'' if group is None else f'{group:.2f}'} |")
    for k in (64, 256, 1024):
        print(f"entry points every {k} symbols a lane: +{32 / k:.4f} bits/weight, +{32 / k / 16:.4f} of ratio")


if __name__ == "__main__":
    main()
