"""Paged KV blocks for each sequence's own tokens. Plain Python: no torch here.

A shared system prefix is never stored here: it is loaded once and read by every
sequence that uses it, so blocks only ever hold a request's own tokens.

Free blocks are a stack: a sequence gets the blocks freed last. A job then touches only
as many blocks as it ever holds at once, so on the CPU, where the cache's pages are
mapped when first written, the process's memory stays flat however many rows pass
through a large cache (a queue would walk every block of it). Steps run in order on one
stream, so a block freed while a launched step still writes it is reused only after.
"""

from __future__ import annotations

from relaycli.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_for(seq.num_own_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all own tokens the sequence has now (prompt and any output)."""
        assert not seq.block_table, "sequence already has blocks"
        need = self.blocks_for(seq.num_own_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError("allocate called without can_allocate")
        seq.block_table = [self.free_blocks.pop() for _ in range(need)]

    def grow(self, seq: Sequence) -> bool:
        """Room for one more own token (a decode step): a new block when the last one is
        full. False, and nothing changed, when that needs a block and none is free."""
        if seq.num_own_tokens <= len(seq.block_table) * self.block_size:
            return True
        if not self.free_blocks:
            return False
        seq.block_table.append(self.free_blocks.pop())
        return True

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_own = 0
