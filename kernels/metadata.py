"""Attention metadata for one forward step, built by the model runner, passed explicitly.

Queries are packed: the new tokens of all B sequences of the step, sequence after
sequence, N in all (decode: N == B). Each sequence's *own* keys (everything after its
shared prefix) live in the paged KV cache; its shared prefix, if any, is one of the
loaded system prefixes, kept once in memory and never copied into the paged cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class PrefixGroup:
    """The sequences of a step that share one loaded system prefix."""

    prefix_slot: int  # index into the runner's list of loaded prefixes
    num_prefix_tokens: int  # S
    seq_indices: torch.Tensor  # [b_p] int64, rows of the batch
    query_indices: torch.Tensor  # [n_p] int64, packed query rows of those sequences


@dataclass
class PrefixTable:
    """A step's prefix groups as device data, for steps whose rows use several prefixes.

    The rows are ordered by group (rows without a prefix last), so a CUDA graph captured
    with this table's buffers replays any mix of prefixes: only the data changes.
    row_group [B] int32: each row's group, num_groups where it has none (a padding row too);
    groups [num_groups + 1, 4] int32: each group's (first row, end row, first key in the
    prefix store, keys); unused entries and the last one are zeros.
    """

    row_group: torch.Tensor
    groups: torch.Tensor
    num_groups: int  # entries the table has room for (a graph's bound), not the groups in use
    max_keys: int  # the longest prefix loaded: what split plans price (kernels/planner.py)


class LayerPrefixes(list):
    """One layer's loaded prefixes: [(k, v)] by slot, each [S_slot, Hkv, D] (an emptied slot
    has no rows), plus, where the engine keeps them in one store (CUDA), the store's k and v
    [S_store, Hkv, D]: the slots are views of its first `used` rows, packed in no particular
    slot order (a reused slot takes the free rows at the end). Steps with a PrefixTable read
    the store, each group only its slot's rows (ranges())."""

    def __init__(self, pairs, store: tuple[torch.Tensor, torch.Tensor] | None = None, used: int = 0) -> None:
        super().__init__(pairs)
        self.store, self.used = store, used

    @classmethod
    def stored(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]], capacity: int = 0) -> "LayerPrefixes":
        """The pairs copied into one store of at least `capacity` rows (room for prefixes
        added later without a new store), the slots then views of it (in slot order)."""
        total = sum(k.shape[0] for k, _ in pairs)
        if len(pairs) <= 1 and capacity <= total:
            return cls(pairs, pairs[0] if pairs else None, total)
        k0, v0 = pairs[0]
        rows = max(total, capacity)
        # zeros: rows past `used` are never read, but a tile's masked keys still enter p @ v
        k_store = torch.zeros((rows, *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
        v_store = torch.zeros((rows, *v0.shape[1:]), dtype=v0.dtype, device=v0.device)
        layer = cls([], (k_store, v_store), 0)
        for pair in pairs:
            layer.append(layer._write([pair]))
        return layer

    def ranges(self) -> list[tuple[int, int]]:
        """(first row in the store, rows) of each slot. Without a store: the rows the slots
        would take in one, in slot order (what the PyTorch reference reads a table with)."""
        if self.store is not None:
            return [(self._start(k), k.shape[0]) for k, _ in self]
        starts = itertools.accumulate((k.shape[0] for k, _ in self), initial=0)
        return [(start, k.shape[0]) for start, (k, _) in zip(starts, self)]

    def appended(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], slot: int | None = None,
                 capacity: int = 0) -> "LayerPrefixes":
        """These prefixes and one more, made of consecutive pieces (k, v) that may sit on
        another device or in another dtype (a module path's parts, read from its artifact),
        in slot `slot` (an emptied one) or a new last slot: copied straight into the store's
        free rows where they suffice (the store, and so any graph that names it, stays),
        else into a new store of at least `capacity` rows."""
        rows = sum(k.shape[0] for k, _ in pieces)
        if self.store is None or self.used + rows > self.store[0].shape[0]:
            like = self.store[0] if self.store is not None else self[0][0]
            return LayerPrefixes.stored(placed(list(self), joined(pieces, like.device, like.dtype), slot), capacity)
        layer = LayerPrefixes(list(self), self.store, self.used)
        return LayerPrefixes(placed(list(self), layer._write(pieces), slot), self.store, layer.used)

    def without(self, slots: set[int]) -> "LayerPrefixes":
        """These prefixes with the given slots emptied (no rows; the slot numbers of the
        others stay). In a store the slots left are moved down, in the order of their rows,
        so the freed rows join the free ones at the end: the same store, new views. A caller
        must make sure no launched step still reads the store."""
        if self.store is None:
            return LayerPrefixes([(k.new_empty((0, *k.shape[1:])), v.new_empty((0, *v.shape[1:])))
                                  if s in slots else (k, v) for s, (k, v) in enumerate(self)])
        (k_store, v_store), at = self.store, 0
        pairs = [(k_store[:0], v_store[:0])] * len(self)
        for s in sorted((s for s in range(len(self)) if s not in slots and self[s][0].shape[0]),
                        key=lambda s: self._start(self[s][0])):
            start, rows = self._start(self[s][0]), self[s][0].shape[0]
            if start != at:  # down, never up; a clone where the ranges overlap
                src_k, src_v = k_store[start:start + rows], v_store[start:start + rows]
                if start < at + rows:
                    src_k, src_v = src_k.clone(), src_v.clone()
                k_store[at:at + rows].copy_(src_k)
                v_store[at:at + rows].copy_(src_v)
            pairs[s] = (k_store[at:at + rows], v_store[at:at + rows])
            at += rows
        return LayerPrefixes(pairs, self.store, at)

    def _start(self, k: torch.Tensor) -> int:
        """The store row a slot's view begins at (0 for an emptied slot: a view of no
        elements may have no address)."""
        if k.numel() == 0:
            return 0
        k_store = self.store[0]
        return (k.data_ptr() - k_store.data_ptr()) // (k_store.stride(0) * k_store.element_size())

    def _write(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the pieces into the store's next free rows; the (k, v) views of them."""
        (k_store, v_store), start = self.store, self.used
        for k, v in pieces:
            k_store[self.used:self.used + k.shape[0]].copy_(k)
            v_store[self.used:self.used + k.shape[0]].copy_(v)
            self.used += k.shape[0]
        return k_store[start:self.used], v_store[start:self.used]


def placed(pairs: list, pair, slot: int | None) -> list:
    """pairs with `pair` in slot `slot` (an emptied one) or appended."""
    if slot is None:
        return pairs + [pair]
    assert slot < len(pairs) and pairs[slot][0].shape[0] == 0, "only an emptied slot takes a new prefix"
    return pairs[:slot] + [pair] + pairs[slot + 1:]


def joined(pieces: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive (k, v) pieces as one (k, v) on device, in dtype."""
    return (torch.cat([k.to(device, dtype) for k, _ in pieces]),
            torch.cat([v.to(device, dtype) for _, v in pieces]))


def prefix_table_rows(row_slots: list[int | None], ranges: list[tuple[int, int]],
                      num_groups: int) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """The host side of a PrefixTable: (row_group, groups rows) for rows ordered by group.

    row_slots: each row's prefix slot (None: no prefix), rows of one slot together and rows
    without one last; ranges: every loaded slot's (first row in the store, rows), as
    LayerPrefixes.ranges gives them. A group is a run of rows of one slot, numbered in row
    order; num_groups entries plus the closing zero entry. Raises ValueError when the rows are not so ordered or need
    more than num_groups groups."""
    row_group: list[int] = []
    groups: list[tuple[int, int, int, int]] = []
    slots: list[int] = []  # each group's slot
    for row, slot in enumerate(row_slots):
        if slot is None:
            row_group.append(num_groups)
            continue
        if row_group and row_group[-1] == num_groups:
            raise ValueError("rows without a prefix must come last")
        if not slots or slots[-1] != slot:
            if slot in slots:
                raise ValueError(f"the rows of prefix slot {slot} are not together")
            slots.append(slot)
            groups.append((row, row, *ranges[slot]))
        lo, _, key0, keys = groups[-1]
        groups[-1] = (lo, row + 1, key0, keys)
        row_group.append(len(groups) - 1)
    if len(groups) > num_groups:
        raise ValueError(f"{len(groups)} prefix groups, the table holds {num_groups}")
    groups += [(0, 0, 0, 0)] * (num_groups + 1 - len(groups))
    return row_group, groups


@dataclass
class AttentionMetadata:
    is_decode: bool  # every sequence has exactly one new query
    cu_seqlens_q: torch.Tensor  # [B+1] int32, packed query offsets
    max_seqlen_q: int
    context_lens: torch.Tensor  # [B] int32, own tokens including this step's new ones; 0: a padding
    # row of a decode graph (one query, output dropped): the paged Triton kernel reads nothing for it
    max_context_len: int
    block_tables: torch.Tensor  # [B, max_blocks] int32, own KV blocks
    slot_mapping: torch.Tensor  # [N] int64, flat cache slot of each new token's k/v
    block_size: int
    prefix_groups: list[PrefixGroup] = field(default_factory=list)
    # own keys of the real rows, summed on the host: what a decode step's split and tile plan
    # prices (relaycli.kernels.planner.context_tokens). None: num_seqs x max_context_len. A decode
    # graph sets its key's representative total (relaycli.engine.cuda_graph).
    context_tokens: int | None = None
    # several prefixes in one step, as device data (decode graphs); prefix_groups is then empty
    prefix_table: PrefixTable | None = None
    # the step is a CUDA graph's (captured, or the eager pass before its capture): plans whose
    # host work a capture pays once (tensor descriptors, a second stream) are taken
    graphed: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        num_seqs = self.context_lens.shape[0]
        assert self.cu_seqlens_q.shape == (num_seqs + 1,), "cu_seqlens_q must be [B+1]"
        assert self.block_tables.shape[0] == num_seqs, "block_tables must be [B, max_blocks]"
        assert self.slot_mapping.dim() == 1, "slot_mapping must be [N]"

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_queries(self) -> int:
        return self.slot_mapping.shape[0]

    def padded_indices(self) -> dict[str, torch.Tensor]:
        """Index tensors for the padded (pure PyTorch) path, computed once per step.

        query_seq [N], query_local [N]: row and column of each packed query in [B, Tq_max].
        query_ctx_pos [N]: each query's index among its sequence's own tokens (causal limit).
        ctx_slots [B, C_max]: flat cache slot of every own key (0 where past the end).
        ctx_valid [B, C_max]: key exists.
        """
        if "padded" in self._cache:
            return self._cache["padded"]
        device = self.context_lens.device
        cu = self.cu_seqlens_q.to(torch.int64)
        q_lens = cu[1:] - cu[:-1]
        num_queries = int(cu[-1])
        query_seq = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), q_lens)
        query_local = torch.arange(num_queries, device=device) - cu[:-1][query_seq]
        ctx_lens = self.context_lens.to(torch.int64)
        query_ctx_pos = ctx_lens[query_seq] - q_lens[query_seq] + query_local
        cols = torch.arange(self.max_context_len, device=device)
        ctx_valid = cols[None, :] < ctx_lens[:, None]
        block_idx = torch.clamp(cols // self.block_size, max=self.block_tables.shape[1] - 1)
        blocks = self.block_tables.to(torch.int64)[:, block_idx]
        ctx_slots = torch.where(ctx_valid, blocks * self.block_size + cols % self.block_size, 0)
        out = dict(query_seq=query_seq, query_local=query_local, query_ctx_pos=query_ctx_pos,
                   ctx_slots=ctx_slots, ctx_valid=ctx_valid)
        self._cache["padded"] = out
        return out
