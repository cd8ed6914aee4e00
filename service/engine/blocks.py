"""The KV cache's blocks, nano-vllm's `block_manager` with vLLM's automatic prefix caching: plain
Python over a free list; the tensors are service/model/paged.py's PagedCache.

A sequence takes the blocks of its prompt and first token when it is admitted, then one block
at a time as it decodes (scheduler.py, which preempts the latest arrival when none is free); a
full cache makes new requests wait in the engine's queue (whose limit answers 429). A sequence
whose whole budget (prompt + max_new_tokens) is more than the cache is refused (`fits`).

    table   list[int]   a sequence's blocks, in order: its token at position p is in slot
                        table[p // block_size] * block_size + p % block_size

The prefix cache. A block whose every token's keys and values are written is named by a digest
of all the tokens up to its end, so its name says its whole prefix (and so every position):

    name[i] = blake2b(name[i - 1] || tokens[i * block_size : (i + 1) * block_size])    name[-1] = b""

A new sequence takes, as they are, the held blocks of the longest run of its prompt's leading
names (`hits`) and computes only the tokens after them. The rules that keep that exact:
  - hits cover tokens before the prompt's last one only: the last is always computed, since its
    logits give the first token (vLLM's rule);
  - a block is named only once a step that wrote all its tokens has returned (`name`: the prompt's
    blocks as its chunks go in, the generated tokens' when the sequence leaves), and a named block
    is never written again: a sequence writes only at positions past its hits;
  - `refs` counts the sequences holding a block. A named block that none holds waits in the free
    list with its name, the least recently released at the head; allocating takes the head and
    forgets its name (LRU eviction). A table is released tail first, so a shared prefix outlives
    the tails after it, and unnamed blocks go to the head, before any named one.
blake2b, not Python's hash(): a collision would hand a request another one's keys and values
(vLLM's CVE-2025-25183, its prefix cache on hash()).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def names(tokens: Sequence[int], block_size: int, after: list[bytes]) -> list[bytes]:
    """`after` (the names of tokens' first len(after) blocks) with the names of its later whole blocks."""
    out, i = list(after), len(after)
    while (i + 1) * block_size <= len(tokens):
        block = tokens[i * block_size:(i + 1) * block_size]
        h = hashlib.blake2b(out[-1] if out else b"", digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little") for t in block))
        out.append(h.digest())
        i += 1
    return out


class BlockManager:
    def __init__(self, blocks: int, block_size: int, prefix_caching: bool = True):
        self.blocks, self.block_size, self.prefix_caching = blocks, block_size, prefix_caching
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(blocks))   # the head goes first
        self.refs = [0] * blocks
        self.name_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` could ever be admitted (the whole cache holds it)."""
        return self.blocks_for(tokens) <= self.blocks

    def hits(self, prompt_names: list[bytes], prompt_tokens: int) -> list[int]:
        """The held blocks of the longest run of the prompt's leading names, its last token left out."""
        out: list[int] = []
        for name in prompt_names[:(prompt_tokens - 1) // self.block_size] if self.prefix_caching else ():
            block = self.block_of.get(name)
            if block is None:
                break
            out.append(block)
        return out

    def can_allocate(self, tokens: int, hits: Sequence[int] = (), spare: int = 0) -> bool:
        """Whether `tokens` (past `hits`) can be allocated with `spare` blocks still free after."""
        idle_hits = sum(1 for b in hits if not self.refs[b])           # free blocks the hits take
        return self.blocks_for(tokens) - len(hits) + spare <= len(self.free) - idle_hits

    def allocate(self, tokens: int, hits: Sequence[int] = ()) -> list[int]:
        """The blocks of a sequence of up to `tokens` tokens, `hits` (from `hits`) first (can_allocate first)."""
        if not self.can_allocate(tokens, hits):
            raise RuntimeError(f"{self.blocks_for(tokens) - len(hits)} blocks asked, {len(self.free)} free")
        for b in hits:
            if not self.refs[b]:
                del self.free[b]
            self.refs[b] += 1
        table = list(hits)
        for _ in range(self.blocks_for(tokens) - len(hits)):
            b, _ = self.free.popitem(last=False)
            self.block_of.pop(self.name_of.pop(b, b""), None)          # evicted
            self.refs[b] = 1
            table.append(b)
        return table

    def name(self, table: list[int], table_names: list[bytes]) -> None:
        """Name `table`'s first len(table_names) blocks, whose tokens are all written; a block
        already named, or whose name another block holds, stays as it is."""
        if not self.prefix_caching:
            return
        for b, name in zip(table, table_names):
            if b not in self.name_of and name not in self.block_of:
                self.name_of[b], self.block_of[name] = name, b

    def release(self, table: list[int]) -> None:
        for b in reversed(table):
            self.refs[b] -= 1
            if not self.refs[b]:
                self.free[b] = None
                if b not in self.name_of:
                    self.free.move_to_end(b, last=False)
        table.clear()

    @property
    def used(self) -> int:
        return self.blocks - len(self.free)

    @property
    def cached(self) -> int:
        """Named blocks none holds: what a later prompt may still find."""
        return sum(1 for b in self.free if b in self.name_of)

    @property
    def usage(self) -> float:
        return self.used / self.blocks if self.blocks else 0.0
