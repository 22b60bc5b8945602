"""Paged KV blocks for each sequence's own tokens. Plain Python: no torch here.

A shared system prefix is never stored here: it is loaded once and read by every
sequence that uses it, so blocks only ever hold a request's own tokens.

The n completions of one row share its prompt's blocks (`fork`): a block is counted by
every sequence that holds it and is free when the last one lets it go. Shared blocks are
only ever read (they hold prompt tokens); the prompt's last block, when it is partial, is
copied for each fork (copy-on-write at fork time), since each completion writes its own
tokens after the prompt there.

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
        self.refs = [0] * num_blocks  # sequences holding each block

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def blocks_with_forks(self, num_tokens: int, forks: int) -> int:
        """Blocks a prompt of num_tokens and its forks need at its prefill: one copy of a
        partial last block a fork."""
        return self.blocks_for(num_tokens) + forks * (num_tokens % self.block_size != 0)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_with_forks(seq.num_own_tokens, len(seq.forks)) <= self.num_free_blocks

    def _take(self) -> int:
        block = self.free_blocks.pop()
        self.refs[block] = 1
        return block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares parent's full blocks; a partial last block is copied to a new one
        (child.copy_block says which: the model runner copies it after the parent's prefill)."""
        assert not child.block_table, "sequence already has blocks"
        table = list(parent.block_table)
        if parent.num_own_tokens % self.block_size:
            if not self.free_blocks:
                raise RuntimeError("fork called without can_allocate")
            child.copy_block = (table[-1], self._take())
            table[-1] = child.copy_block[1]
        for block in table:
            if child.copy_block is None or block != child.copy_block[1]:
                self.refs[block] += 1
        child.block_table = table

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all own tokens the sequence has now (prompt and any output)."""
        assert not seq.block_table, "sequence already has blocks"
        need = self.blocks_for(seq.num_own_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError("allocate called without can_allocate")
        seq.block_table = [self._take() for _ in range(need)]

    def grow(self, seq: Sequence) -> bool:
        """Room for one more own token (a decode step): a new block when the last one is
        full. False, and nothing changed, when that needs a block and none is free."""
        if seq.num_own_tokens <= len(seq.block_table) * self.block_size:
            return True
        if not self.free_blocks:
            return False
        seq.block_table.append(self._take())
        return True

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
        seq.num_cached_own = 0
