"""Continuous batching: which sequences run in the next step. Plain Python.

Each step is either a prefill step (new sequences' own prompt tokens, as many as the
token budget and free blocks allow) or a decode step (one token for every running
sequence). Prefills are gathered: while sequences are decoding, a prefill round starts
only once min_prefill_seqs waiting sequences fit the free slots and blocks (or every
waiting sequence does), and then runs until the slots are full. A prefill step is not
captured in a CUDA graph, so each one costs a whole eager forward pass of host time;
refilling a slot the moment one sequence finishes would pay that once per request.
A row's n completions are forked from its sequence when its prefill is scheduled: they
share its prompt's blocks and start from its prefill's logits, so the prompt is computed
once. When the cache runs out during decode, the newest sequence is preempted: its blocks
are freed and it is recomputed later (its prefix is never recomputed). A decode step
lists its sequences longest own context first.

A round takes the waiting sequences by shared prefix: preempted ones first, then those
sharing the prefix of the one that has waited longest, then those whose prefix the running
batch holds most of, then those whose prefix most others in the queue share (a prefix's
sequences in arrival order). A decode step reads each prefix in it once for all its rows,
so a batch of few prefixes reads fewer bytes a step; and since every round takes the
longest-waiting sequence, a row of a rarely used prefix waits about as long as it would in
arrival order. Any order gives each row the same function of its own tokens.
"""

from __future__ import annotations

from collections import Counter, deque

from relaycli.config import EngineConfig
from relaycli.engine.block_manager import BlockManager
from relaycli.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.min_prefill_seqs = config.min_prefill_seqs
        self.is_filling = False  # a prefill round is under way: keep filling free slots
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def fits_ever(self, seq: Sequence, extra_tokens: int) -> bool:
        """Could this sequence, grown by extra_tokens, ever fit the whole cache?"""
        need = self.block_manager.blocks_for(seq.num_own_tokens + extra_tokens)
        return need <= self.block_manager.num_blocks

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """-> (sequences, is_prefill). Empty when nothing can run."""
        scheduled: list[Sequence] = []
        num_tokens = 0
        if not self.is_filling and self.waiting:
            self.is_filling = self._round_can_start()
            if self.is_filling:
                self._order_by_prefix()
        while self.is_filling and self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            own = seq.num_own_tokens
            if scheduled and num_tokens + own > self.max_num_batched_tokens:
                break
            if len(self.running) + len(scheduled) + 1 + len(seq.forks) > self.max_num_seqs:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            scheduled.append(seq)
            num_tokens += own
            for child in seq.forks:  # the row's other completions: its prompt KV, shared
                self.block_manager.fork(seq, child)
                child.status = SequenceStatus.RUNNING
                scheduled.append(child)
            seq.forks = []
        if scheduled:
            self.running.extend(scheduled)
            return scheduled, True
        self.is_filling = False
        decode: list[Sequence] = []
        grow = self.block_manager.grow
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below
            while not grow(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                decode.append(seq)
        # Longest own context first: the attention kernels launch a batch's programs in
        # row order, so the longest ones start first and the short ones fill in behind
        # them, instead of one long request starting last and running alone (longest
        # processing time first). The order of a decode batch is otherwise free, and it
        # is stable from step to step (every row grows by one token; ties keep their order).
        decode.sort(key=lambda s: s.num_own_tokens, reverse=True)
        return decode, False

    def _order_by_prefix(self) -> None:
        """The waiting sequences in the order a round takes them (the module docstring)."""
        held = Counter(seq.prefix_slot for seq in self.running)
        queued = Counter(seq.prefix_slot for seq in self.waiting)
        if len(held.keys() | queued.keys()) > 1:
            first = {slot: rank for rank, slot in enumerate(queued)}  # arrival order of the prefixes
            # sequence ids follow admission: the longest-waiting one not preempted (preempted
            # ones have an output and come first anyway)
            oldest = min((seq for seq in self.waiting if not seq.output_ids), key=lambda seq: seq.seq_id,
                         default=None)
            due = oldest.prefix_slot if oldest is not None else None
            self.waiting = deque(sorted(self.waiting, key=lambda seq: (
                not seq.output_ids, oldest is None or seq.prefix_slot != due, -held[seq.prefix_slot],
                -queued[seq.prefix_slot], first[seq.prefix_slot])))

    def _round_can_start(self) -> bool:
        """A round starts when nothing else would run, or when the next min_prefill_seqs
        waiting sequences (all of them, if fewer wait) fit both the free slots and the
        free KV blocks: a cache-bound batch must not refill one sequence at a time."""
        if not self.running:
            return True
        want = min(self.min_prefill_seqs, len(self.waiting))
        if self.max_num_seqs - len(self.running) < want:
            return False
        blocks = sum(self.block_manager.blocks_for(self.waiting[i].num_own_tokens) for i in range(want))
        return blocks <= self.block_manager.num_free_blocks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """No more steps for this sequence. With steps read back one late, a sequence can
        end (at EOS) after it was preempted, so it may be waiting instead of running."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
