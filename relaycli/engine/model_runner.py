"""The only engine part that holds device state: weights, the paged KV cache, the
loaded prefixes' KV, and the per-step tensors built from the scheduler's choice."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from relaycli.kernels.backend import PagedAttention, default_impl, layer_ops, triton_runs_on
from relaycli.kernels.metadata import AttentionMetadata, LayerPrefixes, PrefixGroup, joined, placed
from relaycli.kernels.triton_plan import default_block_size
from relaycli.models.registry import LoadedModel
from relaycli.config import EngineConfig
from relaycli.errors import ConfigError
from relaycli.engine.constraints import apply_masks
from relaycli.engine.cuda_graph import pack_block_tables
from relaycli.engine.logprobs import StepLogprobs, step_logprobs
from relaycli.engine.sampler import Sampler
from relaycli.engine.sequence import Sequence
from relaycli.engine.staging import to_device

_CPU_DEFAULT_KV_GB = 2.0


class PrefixKV:
    """One loaded shared prefix: per-layer keys (post-RoPE) and values [S, Hkv, D]."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        assert len(keys) == len(values) and keys, "one (K, V) pair per layer"
        self.keys, self.values = keys, values

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[0]


def _available_cpu_bytes() -> int:
    """Memory the kernel can give without swapping: MemAvailable (free plus reclaimable
    page cache) where /proc says it, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _out_of_memory(exc: BaseException) -> bool:
    """Whether an allocation failed for want of memory (torch's out-of-memory errors are
    RuntimeErrors)."""
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its pages come from calloc, which the kernel maps to zero
    pages on first touch: a cache of gigabytes costs nothing until a job writes to it
    (torch.zeros writes every byte up front). Zeros, not garbage: a masked key of a
    never-written slot still enters p @ v, and 0 * NaN would poison the output."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    return torch.from_numpy(np.zeros(numel * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, prefixes: list[PrefixKV], config: EngineConfig,
                 later_tokens: int = 0) -> None:
        """prefixes: the shared prefixes loaded now; later_tokens: how many prefix tokens
        add_prefix may bring while the engine runs (module paths), kept free beside the cache."""
        self.model = loaded.model
        self.mc = loaded.config
        self.device = loaded.model.device
        self.dtype = loaded.model.dtype
        self.block_size = config.block_size or default_block_size(self.device)
        if config.attention_impl == "triton" and not triton_runs_on(self.device):
            raise ConfigError(f"--attention-impl triton needs a CUDA GPU with Triton, and this run is on "
                             f"{self.device}; use auto, torch or cpu-flash")
        impl = config.attention_impl
        if impl == "auto":
            impl = default_impl(self.device)
        self.attention_impl = impl
        # The prompts' KV goes to the device first, so the cache's budget is what is left.
        prefixes = self._on_device(prefixes)
        # Several prefixes are then copied into one store (kernels/metadata.py LayerPrefixes)
        # while these copies are alive, with room for the prefixes added later: the cache
        # leaves room for that store too. Later prefixes take at most a third of the free
        # memory up front; more grow the store when they come.
        store = impl == "triton"
        now_tokens = sum(p.num_tokens for p in prefixes)
        per_token = self.bytes_per_block() // self.block_size
        # --prefix-cache-gb bounds the paths' rows: unused paths are dropped for room, and
        # the store grows up to the bound. Without it the store grows when the paths in
        # use fill it.
        self.max_prefix_tokens, self.prefix_cache_gb = None, config.prefix_cache_gb
        self.num_fixed_prefix_tokens = now_tokens  # the artifacts' prefixes, never dropped
        self.num_fixed_prefixes = len(prefixes)
        self._empty_slots: set[int] = set()  # slots a drop emptied, taken again by add_prefix
        if config.prefix_cache_gb is not None:
            if self.device.type == "cuda" and config.prefix_cache_gb * 1024**3 > self._free_bytes():
                raise ConfigError(f"--prefix-cache-gb {config.prefix_cache_gb:g} is more than the "
                                  f"{self._free_bytes() / 1024**3:.1f} GiB free on {self.device}; lower it")
            self.max_prefix_tokens = now_tokens + int(config.prefix_cache_gb * 1024**3 // per_token)
        self.adds_prefixes = bool(later_tokens)  # module paths come while the engine runs
        store_tokens = 0
        if store and later_tokens:
            room = int(self._free_bytes() / 3 // per_token) if self.device.type == "cuda" else later_tokens
            store_tokens = now_tokens + min(later_tokens, room)
            if self.max_prefix_tokens is not None:
                store_tokens = min(store_tokens, self.max_prefix_tokens)
        copy_tokens = max(store_tokens, now_tokens if store and len(prefixes) > 1 else 0)
        self.num_blocks = self._num_blocks(config, copy_tokens * per_token)
        # One more block than the block manager hands out: a scratch block that padded
        # rows of a graphed decode step write to.
        shape = (self.num_blocks + 1, self.block_size, self.mc.num_key_value_heads, self.mc.head_dim)
        layers = range(self.mc.num_hidden_layers)
        try:
            self.k_caches = [zeroed(shape, self.dtype, self.device) for _ in layers]
            self.v_caches = [zeroed(shape, self.dtype, self.device) for _ in layers]
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
            self.k_caches = self.v_caches = []
            gib = (self.num_blocks + 1) * self.bytes_per_block() / 1024**3
            raise ConfigError(f"the KV cache ({gib:.1f} GiB) does not fit in {self.device}'s memory "
                             f"({type(exc).__name__}); lower --kv-cache-gb or leave it out") from None
        # The Triton impl keeps each layer's prefixes in one store: a decode step whose rows
        # use several of them reads it through a PrefixTable (one graph for any mix).
        self.attention = PagedAttention(self.k_caches, self.v_caches,
                                        [(p.keys, p.values) for p in prefixes],
                                        "relay" if config.relay else "no-relay", impl,
                                        self.mc.head_dim ** -0.5, store=store, store_tokens=store_tokens)
        layers = self.attention.prefix_layers
        self.prefixes = [PrefixKV([layer[i][0] for layer in layers], [layer[i][1] for layer in layers])
                         for i in range(len(prefixes))]
        self.layer_ops = layer_ops(impl, self.device)  # fused norm/rope/activation kernels, or None: eager
        self.sampler = Sampler(self.device, "triton" if impl == "triton" else "torch")
        self.graphs = None
        if config.cuda_graphs and self.device.type == "cuda" and impl == "triton":
            from relaycli.engine.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(self, config.max_num_seqs, scratch_block=self.num_blocks)

    @property
    def prefix_tokens(self) -> int:
        """Rows the loaded prefixes take."""
        return sum(p.num_tokens for p in self.prefixes)

    def prefix_room(self) -> int | None:
        """Rows one more prefix may take before unused ones must go: what --prefix-cache-gb
        leaves, else the store's free rows; None where nothing bounds it (a prefix list)."""
        if self.max_prefix_tokens is not None:
            return self.max_prefix_tokens - self.prefix_tokens
        layer = self.attention.prefix_layers[0] if self.attention.prefix_layers else None
        if layer is None or layer.store is None:
            return None
        return layer.store[0].shape[0] - layer.used

    def check_prefix_bound(self, tokens: int) -> None:
        """ConfigError where a prefix of `tokens` rows could never fit --prefix-cache-gb,
        whatever else is dropped (the artifacts' own prefixes stay)."""
        if self.max_prefix_tokens is not None and tokens > self.max_prefix_tokens - self.num_fixed_prefix_tokens:
            raise ConfigError(f"its module path ({tokens} tokens, {self._gib(tokens):.3g} GiB) is longer than "
                              f"--prefix-cache-gb {self.prefix_cache_gb:g} holds; raise it")

    def add_prefix(self, pieces: list[PrefixKV]) -> int:
        """Load one more shared prefix while the engine runs (a prompt-module path), given
        as consecutive pieces (views of an artifact's rows, on the host); its slot: the
        lowest one a drop emptied, else a new one, so the slots stay as few as the prefixes.

        Where the prefixes live in one store (Triton), the pieces are copied straight into
        the store's free rows (captured decode graphs stay valid), or a larger store is made
        (with room for the next paths, see below; the graphs, which point into the old one,
        are dropped).
        ConfigError where the device's memory, or --prefix-cache-gb, cannot hold it."""
        layers = self.attention.prefix_layers
        tokens = sum(p.num_tokens for p in pieces)
        self.check_prefix_bound(tokens)
        if self.max_prefix_tokens is not None and tokens > self.prefix_room():
            raise ConfigError(f"its module path ({tokens} tokens) does not fit in --prefix-cache-gb "
                              f"{self.prefix_cache_gb:g} beside the paths loaded; drop unused ones first")
        slot = min(self._empty_slots) if self._empty_slots else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no launched step still reads the old store
        # A store that must grow takes twice the rows in use, within --prefix-cache-gb and
        # a third of the free memory (the rest stays for the steps' activations).
        needed = self.prefix_tokens + tokens
        headroom = 2 * needed if self.max_prefix_tokens is None else min(2 * needed, self.max_prefix_tokens)
        store = layers[0].store
        if self.device.type == "cuda" and store is not None and layers[0].used + tokens > store[0].shape[0]:
            per_token = self.bytes_per_block() // self.block_size
            headroom = min(headroom, needed + int(self._free_bytes() / 3 // per_token))
        grown = None
        try:
            grown = self._grown(layers, pieces, slot, headroom)
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
        if grown is None:
            # No room for the headroom: a store of just the rows needed. Tried out here, not
            # in the handler above, whose traceback would keep the first try's stores alive.
            try:
                grown = self._grown(layers, pieces, slot, 0)
            except (RuntimeError, MemoryError) as exc:
                if not _out_of_memory(exc):
                    raise
                raise ConfigError(f"a shared prefix of {tokens} tokens ({self._gib(tokens):.1f} GiB) does not fit "
                                  f"beside the KV cache in {self.device}'s memory; lower --kv-cache-gb") from None
        # every layer's store has the same rows, so all grow or none does
        in_place = layers[0].store is not None and grown[0].store[0] is layers[0].store[0]
        if slot is None:
            slot = len(layers[0])  # a new last slot
        self._empty_slots.discard(slot)
        self._set_prefix_layers(grown, keep_graphs=in_place, added=slot)
        return slot

    def _grown(self, layers: list[LayerPrefixes], pieces: list[PrefixKV], slot: int | None,
               capacity: int) -> list[LayerPrefixes]:
        """Each layer's prefixes with the pieces' rows in `slot` (None: a new last one)."""
        grown = []
        for i, layer in enumerate(layers):
            parts = [(p.keys[i], p.values[i]) for p in pieces]
            if self.attention_impl == "triton":
                grown.append(layer.appended(parts, slot, capacity))
            else:
                grown.append(LayerPrefixes(placed(list(layer), joined(parts, self.device, self.dtype), slot)))
        return grown

    def drop_prefixes(self, slots: set[int]) -> None:
        """Free the rows of these prefixes (module paths no sequence uses); their slots stay,
        empty, for the next prefixes added, and the others keep theirs. The store keeps its
        size: the prefixes left move down in it."""
        assert not slots & set(range(self.num_fixed_prefixes)), "the artifacts' prefixes stay"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no launched step still reads the rows that move
        self._set_prefix_layers([layer.without(slots) for layer in self.attention.prefix_layers])
        self._empty_slots |= slots

    def _set_prefix_layers(self, layers: list[LayerPrefixes], keep_graphs: bool = False,
                           added: int | None = None) -> None:
        """Make these the loaded prefixes. Decode graphs, whose pointers know the old ones,
        are dropped to be captured again, unless keep_graphs (a prefix, in slot `added`,
        written into the store's free rows, nothing moved)."""
        self.attention.prefix_layers[:] = layers
        self.prefixes[:] = [PrefixKV([layer[s][0] for layer in layers], [layer[s][1] for layer in layers])
                            for s in range(len(layers[0]))]
        if self.graphs is not None and keep_graphs:
            self.graphs.prefix_added(added)
        elif self.graphs is not None:
            from relaycli.engine.cuda_graph import DecodeGraphs
            old = self.graphs
            self.graphs = DecodeGraphs(self, old.max_bs, scratch_block=self.num_blocks)
            self.graphs.num_captures, self.graphs.capture_seconds = old.num_captures, old.capture_seconds
            self.graphs.num_evicted = old.num_evicted

    def _on_device(self, prefixes: list[PrefixKV]) -> list[PrefixKV]:
        """The prefixes' KV in the run's device and dtype; ConfigError where it does not fit."""
        try:
            return [PrefixKV([k.to(self.device, self.dtype) for k in p.keys],
                             [v.to(self.device, self.dtype) for v in p.values]) for p in prefixes]
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            tokens = sum(p.num_tokens for p in prefixes)
            raise ConfigError(f"the prompts' KV ({tokens} tokens, {self._gib(tokens):.1f} GiB) does not fit in {self.device}'s "
                             f"free memory ({type(exc).__name__}); pass fewer or shorter --prompt files") from None

    def _gib(self, tokens: int) -> float:
        """GiB of KV that many tokens take in every layer."""
        return tokens * self.bytes_per_block() / self.block_size / 1024**3

    def bytes_per_block(self) -> int:
        return (2 * self.mc.num_hidden_layers * self.block_size * self.mc.num_key_value_heads * self.mc.head_dim
                * self.dtype.itemsize)

    def _free_bytes(self) -> int:
        """Memory a new allocation on this device can take. On CUDA, blocks PyTorch caches
        but no tensor uses (say, a prefix prefill's activations) count as taken in
        mem_get_info: they are handed back first."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            return torch.cuda.mem_get_info(self.device)[0]
        return _available_cpu_bytes()

    def _num_blocks(self, config: EngineConfig, copy_bytes: int = 0) -> int:
        per_block = self.bytes_per_block()
        if config.kv_cache_gb is not None:
            budget = config.kv_cache_gb * 1024**3
            free = self._free_bytes() - copy_bytes
            if budget > free:  # on the CPU an allocation this large may succeed, then be killed when touched
                raise ConfigError(f"--kv-cache-gb {config.kv_cache_gb:g} is more than the {free / 1024**3:.1f} GiB "
                                 f"free on {self.device}; lower it or leave it out")
        elif self.device.type == "cuda":
            free = self._free_bytes() - copy_bytes
            # Leave room for the activations of the largest prefill step (hidden states,
            # q/k/v, the MLP's gate/up and its product, in the run dtype) and the logits.
            per_token = 4 * self.mc.hidden_size + 3 * self.mc.intermediate_size
            reserve = 2 * 1024**3 + config.max_num_batched_tokens * per_token * self.dtype.itemsize
            budget = max(free * config.kv_cache_memory_fraction - reserve, per_block)
        else:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(_CPU_DEFAULT_KV_GB * 1024**3, 0.25 * avail)
        return max(int(budget // per_block) - 1, 1)

    def prepare(self, seqs: list[Sequence], is_prefill: bool, decode_ids: torch.Tensor | None = None):
        """-> input_ids [N], positions [N], metadata, rows of the last query of each sequence.
        decode_ids [B] on the device: a decode step's input ids (see decode_input_ids)."""
        input_ids: list[int] = []
        starts, ends, bases, prefix_slots, num_blocks = [], [], [], [], []
        for seq in seqs:
            start = seq.num_cached_own if is_prefill else seq.num_own_tokens - 1
            # A decode step needs only the last token: no copy of the whole sequence per step.
            input_ids.extend(seq.own_ids()[start:] if is_prefill else [seq.last_token])
            starts.append(start)
            ends.append(seq.num_own_tokens)
            bases.append(seq.position_base)
            prefix_slots.append(-1 if seq.prefix_slot is None else seq.prefix_slot)
            num_blocks.append(len(seq.block_table))
        # (a padded table entry would name block 0, another sequence's: every token needs its own block)
        assert (np.asarray(ends) <= np.asarray(num_blocks) * self.block_size).all(), \
            "a sequence's blocks must hold all its tokens"
        # Positions and cache slots of every new token in a few array operations (a prefill
        # step has thousands of tokens): token j of the step is own token own[j] of row[j].
        lens = np.subtract(ends, starts)
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        width = max(num_blocks)
        tables = pack_block_tables([s.block_table for s in seqs], width, 0, np.empty((len(seqs), width), np.int64))
        row = np.repeat(np.arange(len(seqs)), lens)
        own = np.arange(cu[-1]) - np.repeat(cu[:-1] - starts, lens)
        slots = tables[row, own // self.block_size] * self.block_size + own % self.block_size
        positions = own + np.repeat(bases, lens)
        seq_slot = np.asarray(prefix_slots)
        token_slot = seq_slot[row]
        dev = self.device
        meta = AttentionMetadata(
            is_decode=not is_prefill,
            cu_seqlens_q=to_device(cu, torch.int32, dev),
            max_seqlen_q=int(lens.max()),
            context_lens=to_device(ends, torch.int32, dev),
            max_context_len=max(ends),
            block_tables=to_device(tables, torch.int32, dev),
            slot_mapping=to_device(slots, torch.int64, dev),
            block_size=self.block_size,
            context_tokens=sum(ends),
            prefix_groups=[PrefixGroup(slot, self.prefixes[slot].num_tokens,
                                       to_device(np.flatnonzero(seq_slot == slot), torch.int64, dev),
                                       to_device(np.flatnonzero(token_slot == slot), torch.int64, dev))
                           for slot in np.unique(seq_slot[seq_slot >= 0]).tolist()],
        )
        last_rows = to_device(cu[1:] - 1, torch.int64, dev)
        ids = decode_ids if decode_ids is not None else to_device(input_ids, torch.int64, dev)
        return ids, to_device(positions, torch.int64, dev), meta, last_rows

    def decode_input_ids(self, seqs: list[Sequence], prev: "StepHandle | None") -> torch.Tensor:
        """[B] int64 on the device: each sequence's last token. Where that token is the one
        the previous step is still computing (a placeholder on the host), it is gathered
        from that step's device output, so this step can launch before it is read back."""
        rows = prev.rows if prev is not None else {}
        src_rows = [rows.get(s.seq_id) for s in seqs]
        if len(seqs) == len(rows) and src_rows == list(range(len(seqs))):
            return prev.tokens  # the same batch as the step before: its output is this input
        from_prev = [r is not None for r in src_rows]
        dev = self.device
        host_ids = to_device([0 if p else s.last_token for s, p in zip(seqs, from_prev)], torch.int64, dev)
        if not any(from_prev):
            return host_ids
        src = to_device([r or 0 for r in src_rows], torch.int64, dev)
        return torch.where(to_device(from_prev, torch.bool, dev), prev.tokens[src], host_ids)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, prev: "StepHandle | None" = None,
               before_sampling: Callable[[], None] | None = None) -> "StepHandle":
        """Queue one forward step and its sampling on the device and return at once.

        Each sequence gets a placeholder token at the end of its output_ids (so its
        length, positions and KV slots are right for the next step); StepHandle.tokens_list()
        gives the real ids once the device is done. prev: the step launched just before,
        not yet read back, whose tokens this step's decode inputs may be.
        before_sampling: called once the forward is queued and before the grammar masks are
        made: where the caller reads prev back, so constrained rows' matchers take prev's
        tokens while the device computes this step.
        """
        decode_ids = None
        key = eager_reason = None
        if not is_prefill and self.graphs is not None:
            key = self.graphs.key(seqs)
            eager_reason = self.graphs.eager_reason if key is None else None
        if key is not None:  # the rows in the order the graph runs them (by prefix; the fused plan's deal)
            seqs = self.graphs.deal(seqs, key)
        # A prefill computes the sequences that are not forks; a fork takes its parent's logits.
        computed = [s for s in seqs if s.fork_of is None] if is_prefill else seqs
        num_new = sum(s.num_own_tokens - s.num_cached_own for s in computed) if is_prefill else len(seqs)
        num_context = sum(s.num_own_tokens for s in seqs)  # decode: the own keys its queries attend to
        if is_prefill:
            assert prev is None or not any(s.seq_id in prev.rows for s in seqs), \
                "a prefill must not start from a token that is still being computed"
        else:
            decode_ids = self.decode_input_ids(seqs, prev)
        if key is not None:
            logits = self.graphs.run(seqs, key, decode_ids)
        else:
            input_ids, positions, meta, last_rows = self.prepare(computed, is_prefill, decode_ids)
            hidden = self.model(input_ids, positions, self.attention.attend_fn(meta), self.layer_ops)
            logits = self.model.compute_logits(hidden[last_rows])
            if len(computed) < len(seqs):
                logits = self._fork(seqs, computed, logits)
        if before_sampling is not None:
            before_sampling()
        masked = [b for b, s in enumerate(seqs) if s.matcher is not None]
        if masked:  # constrained rows: their grammar's mask
            logits = apply_masks(logits, [s.matcher for s in seqs])
        tokens = self.sampler.sample_tensor(logits, [s.sampling for s in seqs], [len(s.output_ids) for s in seqs],
                                            masked)
        logprobs = step_logprobs(logits, tokens, [s.sampling.logprobs for s in seqs])
        indices = []
        for seq in seqs:
            seq.num_cached_own = seq.num_own_tokens
            indices.append(len(seq.output_ids))
            seq.output_ids.append(PLACEHOLDER_TOKEN)
        return StepHandle(seqs, is_prefill, indices, tokens, num_new, num_context, key is not None, eager_reason,
                          logprobs)

    def _fork(self, seqs: list[Sequence], computed: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """A prefill's logits for every sequence, forks taking their parent's row; each
        fork's copy of its parent's partial last block is queued after the prefill wrote it."""
        row = {s.seq_id: i for i, s in enumerate(computed)}
        src = [row[(s.fork_of or s).seq_id] for s in seqs]
        copies = [s.copy_block for s in seqs if s.copy_block is not None]
        if copies:
            dev = self.device
            frm = to_device([a for a, _ in copies], torch.int64, dev)
            to = to_device([b for _, b in copies], torch.int64, dev)
            for cache in (*self.k_caches, *self.v_caches):
                cache.index_copy_(0, to, cache.index_select(0, frm))
        for s in seqs:
            s.fork_of, s.copy_block = None, None
        return logits.index_select(0, to_device(src, torch.int64, self.device))

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One step, waited for: the next token of each sequence (appended to its output_ids)."""
        handle = self.launch(seqs, is_prefill)
        tokens = handle.tokens_list()
        for seq, i, tok in zip(seqs, handle.indices, tokens):
            seq.output_ids[i] = tok
        return tokens


PLACEHOLDER_TOKEN = 0  # stands in for a token the device has not yet returned; never read as one


class StepHandle:
    """A launched step: its sequences, where each one's new token goes in its output_ids,
    and the sampled ids, copied to the host without blocking (read with tokens_list())."""

    def __init__(self, seqs: list[Sequence], is_prefill: bool, indices: list[int], tokens: torch.Tensor,
                 num_new_tokens: int, num_context_tokens: int, graphed: bool = False,
                 eager_reason: str | None = None, logprobs: StepLogprobs | None = None) -> None:
        self.seqs, self.is_prefill, self.indices = seqs, is_prefill, indices
        self.logprobs = logprobs  # the rows that asked for logprobs (copied back with the tokens)
        self.graphed = graphed  # replayed from a CUDA graph
        self.eager_reason = eager_reason  # why a decode step that could have been graphed was not
        self.num_new_tokens = num_new_tokens  # tokens this step computed
        self.num_context_tokens = num_context_tokens  # own tokens its queries attend to, summed
        self.tokens = tokens  # [B] int64 on the device: the next step's inputs
        self.rows = {s.seq_id: b for b, s in enumerate(seqs)}
        self._event = None  # on CUDA: marks the step done on the device (its tokens copied back)
        self.wait_seconds = 0.0  # how long reading the tokens back waited for the device
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        else:
            self._host = tokens

    @property
    def is_timed(self) -> bool:
        """Whether the device timestamps the step's end (CUDA), for seconds_after."""
        return self._event is not None

    def seconds_after(self, earlier: "StepHandle") -> float:
        """Device time from the end of an earlier timed step to the end of this one; both
        must have been read back (tokens_list), so both have ended."""
        return earlier._event.elapsed_time(self._event) / 1e3

    def tokens_list(self) -> list[int]:
        """The sampled ids, waiting for the device if it is not done (wait_seconds: how long)."""
        if self._event is not None and not self._event.query():
            started = time.perf_counter()
            self._event.synchronize()
            self.wait_seconds = time.perf_counter() - started
        return self._host.tolist()
