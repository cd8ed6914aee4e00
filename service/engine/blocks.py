"""The KV cache's blocks, nano-vllm's `block_manager` without prefix sharing: plain Python over a
free list; the tensors are service/model/paged.py's PagedCache.

A sequence is admitted only when the blocks of its whole budget (prompt + max_new_tokens) are
free, and gets them all at once: a running row never runs out of cache, so nothing is ever
preempted, and a full cache makes new requests wait in the engine's queue (whose limit answers
429). The price: a request that stops early (EOS, stop sequence) held blocks it did not use.

    table   list[int]   a sequence's blocks, in order: its token at position p is in slot
                        table[p // block_size] * block_size + p % block_size
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, blocks: int, block_size: int):
        self.blocks, self.block_size = blocks, block_size
        self.free: deque[int] = deque(range(blocks))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` could ever be admitted (the whole cache holds it)."""
        return self.blocks_for(tokens) <= self.blocks

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self.free)

    def allocate(self, tokens: int) -> list[int]:
        """The blocks of a sequence of up to `tokens` tokens (can_allocate first)."""
        n = self.blocks_for(tokens)
        if n > len(self.free):
            raise RuntimeError(f"{n} blocks asked, {len(self.free)} free")
        return [self.free.popleft() for _ in range(n)]

    def release(self, table: list[int]) -> None:
        self.free.extend(table)
        table.clear()

    @property
    def used(self) -> int:
        return self.blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.used / self.blocks if self.blocks else 0.0
