"""CUDA graphs of the decode step (only the decode step: prefill shapes vary too much).

A decode step is many small launches (about 45 a layer), so eagerly the host, not the
GPU, sets its pace. A graph replays all of them with one launch. Graphs are captured
lazily per (batch bucket, context bucket, prefix slot, attention plan) on static input buffers:
- batch bucket: the next size of BATCH_BUCKETS; padded rows write their k/v to a
  scratch block that no sequence owns, have no own context (the paged kernels read
  nothing for them, not even their prefix; relay's system kernel still computes them
  against the prefix it reads once for all rows) and their outputs are dropped;
- context bucket: 256, 1024, 4096, ... above the longest own context; the kernels read
  each row's true length from context_lens, the bucket only sizes their split plan;
- prefix slot: the loaded prefix every sequence of the step shares (or none); MIXED
  where the rows use several (or some use none): the rows are then ordered by prefix,
  and which rows use which prefix is data in the step's PrefixTable buffers, so one
  graph serves every mix, up to MAX_TABLE_GROUPS prefixes in a step. A step whose rows
  all share one prefix keeps a graph of its own, which takes the fused own-key kernel
  where it pays (its tensor descriptors name the prefix);
- attention plan: relay's plan of the step (kernels/planner.py decode_graph_plan: its kind,
  splits and tiles), which the step prices by its real own keys (their sum, known on the
  host), not by the bucket's bound: the same bucket holds steps of 40 and of 250 keys a
  row, and under a long prompt the two want different system tiles. A graph is captured
  with its key's representative total, which gives the same plan.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from relaycli.kernels.metadata import AttentionMetadata, PrefixGroup, PrefixTable, prefix_table_rows
from relaycli.engine.sequence import Sequence
from relaycli.engine.staging import stage

# Padding rows cost what real rows cost in the matrix products, which are bound by flops
# from about 64 rows on. Above 64 the buckets are 32 apart up to 256 and 64 apart up to
# 512, so a step pays for at most 31 (63) padding rows; powers of two made a batch of
# 129 cost as much as one of 256. Below 64 the weights' bytes set the time and powers of
# two lose little. Each key costs a warm-up pass and two captures, paid at start-up when
# the bench (or a caller) captures every key first, else the first time a job meets it.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MIN_CONTEXT_BUCKET = 256
CONTEXT_BUCKET_GROWTH = 4
# The most graphs a job keeps: a new key past it takes the place of the least recently
# replayed one. A job of batch limit 256 and own contexts up to 4,096 keys has 42 bucket
# pairs, and relay's steps about 1.9 plans each on llama3-8b heads (all_keys: 68-78 keys
# under 2,048-16,384 prefix tokens); a library of many module paths adds keys of each path
# as the job goes on, and the paths in use change.
MAX_GRAPHS = 128
# The prefix slot of a key whose rows use several prefixes, and the most a step may use:
# a bound on the PrefixTable's entries (device data, 16 bytes each), not on the work, since
# a tile of rows walks only the groups its rows are in. 64 holds a batch over a library of
# dozens of documents (each module path is a prefix) or as many --prompt artifacts.
MIXED = "mixed"
MAX_TABLE_GROUPS = 64

# Why a decode step ran eagerly (EngineStats counts them).
EAGER_TOO_LARGE = "batch above the largest graph bucket"
EAGER_TOO_MANY_PREFIXES = f"more than {MAX_TABLE_GROUPS} prefixes in one step"


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, scratch_block: int) -> None:
        # Keep what the step needs, not the runner: no reference cycle, so the KV cache
        # is freed as soon as the engine goes.
        self.model, self.attention, self.prefixes = runner.model, runner.attention, runner.prefixes
        self.layer_ops = runner.layer_ops
        dev = runner.device
        self.block_size = runner.block_size
        self.max_context = runner.mc.max_position_embeddings
        # larger batches than the largest bucket run eagerly (key() returns None)
        self.max_bs = next((b for b in BATCH_BUCKETS if b >= max_num_seqs), BATCH_BUCKETS[-1])
        max_blocks = -(-self.max_context // self.block_size)
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((self.max_bs,), scratch_block * self.block_size, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)  # 0: padding
        self.block_tables = torch.full((self.max_bs, max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.host_tables = np.empty((self.max_bs, max_blocks), dtype=np.int32)  # staging for block_tables
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(self.max_bs, dtype=torch.int64, device=dev)
        # the PrefixTable of MIXED steps (relaycli.kernels.metadata): each row's group, each group's range
        self.prefix_ranges = self._ranges()  # each slot's (first row, rows) in the prefix store
        # a runner that adds prefixes as the job runs (module paths) gets the full table
        # up front, so its graphs outlive the additions (prefix_added)
        self.table_groups = MAX_TABLE_GROUPS if runner.adds_prefixes else max(1, min(len(self.prefixes),
                                                                                    MAX_TABLE_GROUPS))
        self.row_group = torch.full((self.max_bs,), self.table_groups, dtype=torch.int32, device=dev)
        self.groups = torch.zeros(self.table_groups + 1, 4, dtype=torch.int32, device=dev)
        # One logits buffer for every graph: each graph's own output would stay allocated
        # (about 65 MB a key at 256 rows of a 128k vocabulary in bf16). Steps run in stream
        # order, so a step's sampling reads its logits before the next replay writes them.
        self.logits = torch.empty(self.max_bs, runner.mc.vocab_size, dtype=runner.dtype, device=dev)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # each writes self.logits
        self.num_heads = runner.mc.num_attention_heads
        # own keys in all that a key's graph is captured with (the first step that met it,
        # or capture_all's sample); any total of the key plans the same
        self.key_tokens: dict[tuple, int] = {}
        self.pool = None
        self.num_replays = 0
        self.num_captures = 0
        self.num_evicted = 0  # graphs dropped for a new key past MAX_GRAPHS
        self.capture_seconds = 0.0  # captures of new keys (their first step's eager pass not included)
        self.eager_reason: str | None = None  # why the last key() gave None

    def prefix_added(self, slot: int) -> None:
        """A prefix was written into free rows of the store, in `slot`: the captured graphs
        stay valid (the other prefixes and the store did not move; a PrefixTable step reads
        each group's key range from its buffers, and a longer prefix only changes the split
        plan of later keys), except any of that slot alone, which named its old rows."""
        self.prefix_ranges = self._ranges()
        self._drop([key for key in self.graphs if key[2] == slot])

    def _ranges(self) -> list[tuple[int, int]]:
        layers = self.attention.prefix_layers
        return layers[0].ranges() if layers else []

    def key(self, seqs: list[Sequence]) -> tuple | None:
        """The graph that can run this step, or None (eager_reason says why):
        (batch bucket, context bucket, prefix slot or MIXED, attention plan)."""
        slots = {s.prefix_slot for s in seqs}
        if len(seqs) > self.max_bs:
            self.eager_reason = EAGER_TOO_LARGE
            return None
        if len(slots - {None}) > self.table_groups:
            self.eager_reason = EAGER_TOO_MANY_PREFIXES
            return None
        slot = next(iter(slots)) if len(slots) == 1 else MIXED
        own = [s.num_own_tokens for s in seqs]
        tokens = sum(own)
        key = self._bucket(len(seqs), max(own), slot, tokens)
        self.key_tokens.setdefault(key, tokens)
        return key

    def deal(self, seqs: list[Sequence], key: tuple) -> list[Sequence]:
        """The step's sequences in the row order its graph should run them: by prefix slot
        for a MIXED key (its PrefixTable wants the rows of a prefix together, rows without
        one last; the given order within each), else the order the key's attention plan
        asks for (kernels/planner.py row_order), or as given. Any order computes the same
        outputs (each row is its own sequence's)."""
        if key[2] == MIXED:
            return sorted(seqs, key=lambda s: len(self.prefixes) if s.prefix_slot is None else s.prefix_slot)
        order = self.attention.row_order(key[3], [s.num_own_tokens for s in seqs], self.num_heads)
        return seqs if order is None else [seqs[j] for j in order]

    def _bucket(self, num_seqs: int, longest: int, slot: int | None, tokens: int) -> tuple:
        bs = next(b for b in BATCH_BUCKETS if b >= num_seqs)
        ctx = min(context_bucket(longest), self.max_context)
        return bs, ctx, slot, self._plan(bs, slot, tokens, ctx)

    def _plan(self, bs: int, slot: int | str | None, tokens: int, ctx: int):
        mixed = slot == MIXED
        return self.attention.graph_plan(bs, self.num_heads, None if mixed else slot, tokens, ctx, mixed=mixed)

    def all_keys(self, max_num_seqs: int, max_context: int, slots: list[int | None]) -> list[tuple]:
        """Every key a step of at most max_num_seqs sequences, none longer than
        max_context own tokens, with one of these prefix slots, can have. A key's plans
        are sampled at own-key totals a factor 2 apart, from every row full down to one
        key in all: the plan changes where the system kernel's splits double, so each of
        its plans spans such a factor (a plan missed would be captured when first met)."""
        top_bs, top_ctx, _, _ = self._bucket(min(max_num_seqs, self.max_bs), max(max_context, 1), None, 1)
        ctxs = [MIN_CONTEXT_BUCKET]
        while ctxs[-1] < top_ctx:
            ctxs.append(ctxs[-1] * CONTEXT_BUCKET_GROWTH)
        keys = []
        for slot in slots:
            for bs in (b for b in BATCH_BUCKETS if b <= top_bs):
                for ctx in ctxs:
                    ctx = min(ctx, self.max_context)
                    tokens = bs * ctx
                    while tokens >= 1:
                        key = (bs, ctx, slot, self._plan(bs, slot, tokens, ctx))
                        if key not in keys:
                            keys.append(key)
                            self.key_tokens.setdefault(key, tokens)
                        tokens //= 2
        return keys

    def capture_all(self, max_num_seqs: int, max_context: int, slots: list[int | None]) -> int:
        """Capture every key of all_keys before a job runs (as servers do at start-up), so
        no step of the job waits for a capture or its kernel compiles. Call it with no
        sequence in flight: the buffers are pointed at the scratch block first, so the
        captures' passes write only there. MAX_GRAPHS bounds only the keys a job
        captures as it meets them; this captures all. Returns how many were captured."""
        before = len(self.graphs)
        for key in self.all_keys(max_num_seqs, max_context, slots):
            if key not in self.graphs:
                self._reset_rows(0, key[0], -(-key[1] // self.block_size))
                meta = self._meta(key)
                self._forward(key[0], meta)  # compiles the plan's kernels (on the scratch block)
                self._capture(key, meta)
        return len(self.graphs) - before

    def _reset_rows(self, lo: int, hi: int, width: int) -> None:
        """Rows lo..hi point at the scratch block: padding, or a capture with no sequences."""
        self.input_ids[lo:hi].zero_()
        self.positions[lo:hi].zero_()
        self.slot_mapping[lo:hi].fill_(self.scratch_block * self.block_size)
        self.context_lens[lo:hi].fill_(0)  # padding: the kernels skip the row
        self.block_tables[lo:hi, :width].fill_(self.scratch_block)

    def _fill(self, seqs: list[Sequence], bs: int, ctx: int, input_ids: torch.Tensor, mixed: bool = False) -> None:
        """Write this step's inputs into the graph's buffers. input_ids [n] is on the device
        (it may be the previous step's output, not yet on the host). The host values go
        through pinned memory: a copy from pageable memory may wait for the step still
        running, and the engine prepares this step while that one runs."""
        n = len(seqs)
        bsz = self.block_size
        width = -(-ctx // bsz)  # only the columns this context bucket reads
        rows = decode_rows(seqs, bsz)
        tables = pack_block_tables([s.block_table for s in seqs], width, self.scratch_block, self.host_tables)
        dev = self.input_ids.device
        dev_rows = stage(torch.from_numpy(rows), dev)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(dev_rows[0])
        self.slot_mapping[:n].copy_(dev_rows[1])
        self.context_lens[:n].copy_(dev_rows[2])
        # tables is a strided view of the staging array: stage() copies it dense and pinned
        self.block_tables[:n, :width].copy_(stage(torch.from_numpy(tables), dev))
        if bs > n:  # rows left from a larger earlier step must not touch real blocks
            self._reset_rows(n, bs, width)
        if mixed:
            slots = [s.prefix_slot for s in seqs] + [None] * (bs - n)
            row_group, groups = prefix_table_rows(slots, self.prefix_ranges, self.table_groups)
            self.row_group[:bs].copy_(stage(torch.tensor(row_group, dtype=torch.int32), dev))
            self.groups.copy_(stage(torch.tensor(groups, dtype=torch.int32), dev))

    def _meta(self, key: tuple) -> AttentionMetadata:
        """The metadata a key's graph is captured with: its buffers, its buckets, and the
        own-key total its system plan is priced at."""
        bs, ctx, slot, plan = key
        groups, table = [], None
        if slot == MIXED:
            table = PrefixTable(self.row_group[:bs], self.groups, self.table_groups,
                                max(rows for _, rows in self.prefix_ranges))
        elif slot is not None:
            prefix = self.prefixes[slot]
            groups = [PrefixGroup(slot, prefix.num_tokens, self.rows[:bs], self.rows[:bs])]
        return AttentionMetadata(
            is_decode=True, cu_seqlens_q=self.cu_seqlens_q[:bs + 1], max_seqlen_q=1,
            context_lens=self.context_lens[:bs], max_context_len=ctx,
            block_tables=self.block_tables[:bs, :-(-ctx // self.block_size)],
            slot_mapping=self.slot_mapping[:bs], block_size=self.block_size, prefix_groups=groups,
            prefix_table=table,
            # a key without a plan serves every total of its bucket: priced at the bound
            context_tokens=self.key_tokens.get(key) if key[3] is not None else None, graphed=True)

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        model = self.model
        hidden = model(self.input_ids[:bs], self.positions[:bs], self.attention.attend_fn(meta), self.layer_ops)
        return model.compute_logits(hidden, out=self.logits[:bs])

    def run(self, seqs: list[Sequence], key: tuple, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [len(seqs), vocab] (the model's dtype) of one decode step, through the graph for key.
        input_ids [len(seqs)] int64 on the device. A key's first step runs its graph's plan
        eagerly on the graph's buffers (compiling any kernel it needs; the step's answer), and
        then the graph is captured, once, for every later step of the key."""
        bs, ctx, slot, _ = key
        self._fill(seqs, bs, ctx, input_ids, mixed=slot == MIXED)
        graph = self.graphs.pop(key, None)
        if graph is None:
            meta = self._meta(key)
            self._forward(bs, meta)
            self.make_room()
            self._capture(key, meta)
        else:
            self.graphs[key] = graph  # the most recently replayed last
            graph.replay()
            self.num_replays += 1
        return self.logits[:len(seqs)]

    def make_room(self) -> None:
        """Drop the least recently replayed graphs (the dict's first) until one more fits
        under MAX_GRAPHS. Graphs share one memory pool for their passes' temporaries and
        write their logits outside it, so a graph can go while the others stay."""
        oldest = list(self.graphs)[:max(0, len(self.graphs) - MAX_GRAPHS + 1)]
        self._drop(oldest)
        self.num_evicted += len(oldest)

    def _drop(self, keys: list[tuple]) -> None:
        """Forget these keys' graphs, once none may still be replaying."""
        if keys and self.logits.is_cuda:
            torch.cuda.synchronize(self.logits.device)
        for key in keys:
            del self.graphs[key]

    def _capture(self, key: tuple, meta: AttentionMetadata) -> torch.cuda.CUDAGraph:
        """Capture the step for key on the buffers as they are (filled, or reset). Every kernel
        it launches must have run before (an eager pass of the same plan compiles them)."""
        started = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(key[0], meta)
        self.pool = graph.pool()
        self.graphs[key] = graph
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - started
        return graph


def context_bucket(longest: int) -> int:
    """The context bucket of a step whose longest own context is `longest` tokens (before
    the model's limit): MIN_CONTEXT_BUCKET, grown CONTEXT_BUCKET_GROWTH-fold until it holds it."""
    ctx = MIN_CONTEXT_BUCKET
    while ctx < longest:
        ctx *= CONTEXT_BUCKET_GROWTH
    return ctx


def decode_rows(seqs: list[Sequence], block_size: int) -> np.ndarray:
    """[3, n] int64: each row's position, cache slot and own context length in a decode
    step (the row feeds in its last own token), as arrays rather than row by row."""
    n = len(seqs)
    rows = np.empty((3, n), dtype=np.int64)
    rows[2] = [s.num_own_tokens for s in seqs]
    last = rows[2] - 1  # the own index of the token each row feeds in
    rows[0] = np.fromiter((s.position_base for s in seqs), dtype=np.int64, count=n) + last
    blocks = np.fromiter((s.block_table[i] for s, i in zip(seqs, (last // block_size).tolist())),
                         dtype=np.int64, count=n)
    rows[1] = blocks * block_size + last % block_size
    return rows


def pack_block_tables(tables: list[list[int]], width: int, fill: int, out: np.ndarray) -> np.ndarray:
    """Rows of block ids padded with `fill` to `width` columns, written into out[:len(tables),
    :width] and returned (a view). One masked numpy store rather than a nested-list tensor,
    which spares the host most of that work in a full decode step."""
    n = len(tables)
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
    if n and int(lens.max()) > width:
        raise ValueError(f"a block table has {int(lens.max())} blocks, more than the {width} columns asked for")
    packed = out[:n, :width]
    packed.fill(fill)
    packed[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=out.dtype, count=int(lens.sum()))
    return packed
