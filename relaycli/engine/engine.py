"""The library face of relay: an engine that takes request rows and yields result rows.

The CLI, a Ray Data worker, a notebook and the tests all call this. Nothing here
prints; progress is reported through an optional callback.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

from relaycli.models.registry import LoadedModel
from relaycli.config import EngineConfig
from relaycli.engine.completions import Completion, Group, completion_of, result_row, row_sequences
from relaycli.engine.block_manager import BlockManager
from relaycli.engine.constraints import ConstraintError, Grammars
from relaycli.engine.feed import Feed, Prefetch, feed_of
from relaycli.engine.heap import frozen_heap  # noqa: F401 - the job and the benchmarks take it from here
from relaycli.engine.model_runner import ModelRunner, PrefixKV, StepHandle
from relaycli.engine.module_prefixes import ModulePrefixes, PrefixRoomBusy, path_tokens
from relaycli.engine.scheduler import Scheduler
from relaycli.engine.sequence import SamplingOptions, Sequence
from relaycli.engine.stats import EngineStats
from relaycli.engine.stops import StopWatch
from relaycli.engine.vocab import Vocab
from relaycli.errors import ConfigError
from relaycli.io.requests import RequestRow, ResultRow
from relaycli.module_rows import ModulePick
from relaycli.prompts import PromptError, PromptMatcher


@dataclass
class TokenRequest:
    """A request in token ids: a row after rendering, or a benchmark's.

    own_ids: the prompt's ids after its loaded prefix (prefix_slot), or all of them where it
    has none; the prefix's ids are the artifact's and are not repeated here."""

    row_index: int
    id: str
    own_ids: list[int]
    sampling: SamplingOptions
    prefix_slot: int | None = None
    url: str | None = None
    module_pick: ModulePick | None = None  # prompt modules: the prefix is built on admission
    grammar: object | None = None  # the compiled constraint its answers must match
    n: int = 1  # completions, sharing the prompt's KV
    label: str | None = None  # how its error rows name it (RequestRow.label); None: "row N"
    queued_at: float | None = None  # perf_counter when it first reached the engine: its TTFT counts from here

    @property
    def where(self) -> str:
        return self.label if self.label is not None else f"row {self.row_index}"


@dataclass
class _Live:
    seq: Sequence
    row_index: int
    id: str
    url: str | None
    watch: StopWatch | None  # rows with stop strings: their text, decoded as it grows
    label: str  # how an error row names the row (TokenRequest.where)
    index: int = 0  # which of the row's completions
    group: Group | None = None  # n > 1: the row's completions so far


class Engine:
    def __init__(self, loaded: LoadedModel, artifacts: list = (), config: EngineConfig | None = None,
                 record_token_ids: bool = False, keep_step_logs: bool = False) -> None:
        """artifacts: loaded .relaykv artifacts (name, system_text, token_ids, keys, values).
        record_token_ids: keep each finished row's generated ids in token_ids_by_row
        (checks and benchmarks; a job does not need them).
        keep_step_logs: keep every row's TTFT and every step's batch, context and time in
        the stats (benchmarks; a job keeps bounded summaries only)."""
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.artifacts = list(artifacts)
        # a module library's rows past its system prompt are modules (relaycli.engine.module_prefixes)
        self.runner = ModelRunner(loaded, [PrefixKV([k[:len(a.token_ids)] for k in a.keys],
                                                    [v[:len(a.token_ids)] for v in a.values])
                                           for a in self.artifacts], self.config, path_tokens(self.artifacts))
        self.modules = ModulePrefixes(self.artifacts, self.runner)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.matcher = PromptMatcher(loaded.tokenizer, self.artifacts) if loaded.tokenizer else None
        self.max_context = loaded.config.max_position_embeddings
        eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer else frozenset(loaded.config.eos_token_ids)
        self.eos_ids = frozenset(eos) | frozenset(loaded.config.eos_token_ids)
        vocab_size = loaded.config.vocab_size
        self.grammars = Grammars(loaded.tokenizer, vocab_size, self.eos_ids) if loaded.tokenizer else None
        self._vocab: Vocab | None = None  # token texts, made when a row first asks for logprobs
        self.stats = EngineStats(graphs_available=self.runner.graphs is not None, keep_logs=keep_step_logs)
        self._seq_ids = itertools.count()
        self._live: dict[int, _Live] = {}
        self.token_ids_by_row: dict[int, list[int]] | None = {} if record_token_ids else None
        self._pending: StepHandle | None = None  # the launched step not yet read back
        self._unattributed = 0.0  # seconds of calls that read nothing back (the first launch)
        self._last_read: StepHandle | None = None  # the step accounted last in this generate call
        # requests whose module path waits for room that paths in use hold, in arrival order;
        # steps read back that held a finished sequence (its path is free from then on), and
        # their count when the waiting requests last tried
        self._waiting_room: deque[TokenRequest] = deque()
        self._released = 0
        self._room_tried_at = -1

    # ---- turning rows into sequences -------------------------------------------------
    def _to_token_request(self, row: RequestRow | ResultRow) -> TokenRequest | ResultRow:
        if isinstance(row, ResultRow):
            return row
        if self.matcher is None:
            return ResultRow.failed(row.row_index, row.id, f"{row.label}: this model has no tokenizer "
                                    "(dummy weights); send token ids through Engine.generate_tokens", row.url)
        pick = None
        try:
            if self.modules.wants(row):
                prepared, pick = self.modules.prepare(self.matcher, self.loaded.tokenizer, row)
            else:
                prepared = self.matcher.prepare(row.messages, row.system_prompt)
        except PromptError as exc:
            return ResultRow.failed(row.row_index, row.id, f"{row.label}: {exc}", row.url)
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer failure is this row's alone
            detail = f"{type(exc).__name__}: {exc}".encode("utf-8", "backslashreplace").decode("utf-8")
            return ResultRow.failed(row.row_index, row.id, f"{row.label}: the chat could not be rendered "
                                    f"and tokenized ({detail}); check its messages", row.url)
        if prepared.is_prefix_miss:
            self.stats.prefix_misses += 1
        elif prepared.prefix_slot is not None:
            self.stats.prefix_hits += 1
            self.stats.prompt_fallbacks += prepared.full_render
        sp = row.sampling
        opts = SamplingOptions(
            max_tokens=sp.max_tokens if sp.max_tokens is not None else self.max_context,
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            seed=sp.seed if sp.seed is not None else row.row_index, stop=tuple(sp.stop),
            ignore_eos=sp.ignore_eos, logprobs=sp.logprobs)
        grammar = None
        if row.constraint is not None:  # compiled here, on the prefetch thread, once per distinct spec
            try:
                grammar = self.grammars.compile(row.constraint)
            except ConstraintError as exc:
                return ResultRow.failed(row.row_index, row.id, f"{row.label}: {exc}", row.url)
        if pick is not None:  # the module path's prefix is found (or built) on admission
            return TokenRequest(row.row_index, row.id, list(pick.extra_ids) + prepared.own_ids, opts, None, row.url,
                                pick, grammar, sp.n, row.label)
        return TokenRequest(row.row_index, row.id, prepared.own_ids, opts, prepared.prefix_slot, row.url,
                            None, grammar, sp.n, row.label)

    def _slots_in_use(self) -> set[int]:
        """The prefix slots of the sequences queued, running, or in the step not yet read back."""
        sched = self.scheduler
        seqs = itertools.chain(sched.waiting, sched.running, self._pending.seqs if self._pending else ())
        return {s.prefix_slot for s in seqs if s.prefix_slot is not None}

    def _admit_waiting(self) -> list[ResultRow]:
        """Admit the requests that wait for room for their module path, where some may now
        fit: once a step read back since they last tried ended a sequence (no launched step
        reads its path any more), or when nothing runs (then each fits or is an error row)."""
        idle = self.scheduler.num_unfinished == 0 and self._pending is None
        if not self._waiting_room or (not idle and self._released == self._room_tried_at):
            return []
        self._room_tried_at = self._released
        waiting, self._waiting_room = self._waiting_room, deque()
        return [err for err in map(self._admit, waiting) if err is not None]

    def _admit(self, req: TokenRequest) -> ResultRow | None:
        """Queue a request, or return its error row when it can never run. A request whose
        module path must wait for room is kept in _waiting_room."""
        slot, first_position = req.prefix_slot, None
        if req.queued_at is None:
            req.queued_at = time.perf_counter()
        if req.module_pick is not None:
            try:
                slot, first_position = (self.modules.slot(req.module_pick, self._slots_in_use),
                                        req.module_pick.next_position)
            except PrefixRoomBusy:
                self._waiting_room.append(req)  # the wait counts toward its TTFT
                return None
            except ConfigError as exc:
                return ResultRow.failed(req.row_index, req.id, f"{req.where}: {exc}", req.url)
            finally:
                self.stats.module_paths_built, self.stats.module_paths_dropped = self.modules.built, self.modules.dropped
        prefix_len = 0 if slot is None else self.runner.prefixes[slot].num_tokens
        end = (prefix_len if first_position is None else first_position) + len(req.own_ids)  # positions
        if end >= self.max_context:
            size = f"has {end} tokens" if first_position is None else f"reaches position {end}"
            return ResultRow.failed(req.row_index, req.id, f"{req.where}: the prompt {size}, "
                                    f"the model's context is {self.max_context}; shorten it", req.url)
        if not req.own_ids:
            what = "is empty" if prefix_len == 0 else f"has no token after its {prefix_len}-token shared prefix"
            return ResultRow.failed(req.row_index, req.id, f"{req.where}: the prompt {what}; "
                                    "add the request's own text", req.url)
        opts = req.sampling
        max_new = min(opts.max_tokens, self.max_context - end)
        seq = Sequence(next(self._seq_ids), req.own_ids, opts, prefix_len, slot,
                       arrival_time=req.queued_at, first_position=first_position)
        if not self.scheduler.fits_ever(seq, max_new):
            return ResultRow.failed(req.row_index, req.id, f"{req.where}: prompt plus max_tokens needs "
                                    f"{seq.num_own_tokens + max_new} KV slots, the cache holds "
                                    f"{self.block_manager.num_blocks * self.runner.block_size}; lower max_tokens "
                                    "or raise --kv-cache-gb", req.url)
        forks_need = self.block_manager.blocks_with_forks(seq.num_own_tokens, req.n - 1)
        if req.n > self.config.max_num_seqs or forks_need > self.block_manager.num_blocks:
            return ResultRow.failed(req.row_index, req.id, f"{req.where}: n = {req.n} completions do not fit "
                                    f"the batch ({self.config.max_num_seqs} sequences) or the KV cache; lower n or "
                                    "raise --max-batch / --kv-cache-gb", req.url)
        seq.sampling = replace(opts, max_tokens=max_new)
        group = Group(req.n) if req.n > 1 else None
        self.stats.forks += req.n - 1
        matcher = (lambda: self.grammars.matcher(req.grammar)) if req.grammar is not None else None
        for index, one in enumerate(row_sequences(seq, req.n, self._seq_ids.__next__, matcher,
                                                  opts.logprobs is not None)):
            watch = StopWatch(opts.stop, self.loaded.tokenizer.decode) if opts.stop and self.loaded.tokenizer else None
            self._live[one.seq_id] = _Live(one, req.row_index, req.id, req.url, watch, req.where, index, group)
        self.scheduler.add(seq)
        return None

    # ---- the loop --------------------------------------------------------------------
    def generate(self, rows: Iterable[RequestRow | ResultRow],
                 on_step: Callable[[EngineStats], None] | None = None) -> Iterator[ResultRow]:
        """Answer every row; error rows (already ResultRow) pass straight through. Rows are
        rendered and tokenized on a background stage ahead of the engine (feed.Prefetch)."""
        feed = Prefetch(rows, self._to_token_request, self.config.max_pending_rows)
        try:
            yield from self.generate_tokens(feed, on_step)
        finally:
            feed.close()

    def generate_tokens(self, requests: Iterable[TokenRequest | ResultRow] | Feed,
                        on_step: Callable[[EngineStats], None] | None = None) -> Iterator[ResultRow]:
        feed = feed_of(requests)
        self._last_read = None  # a step of an earlier call is no start for this one's first step
        while True:
            for err in self._admit_waiting():
                yield self._count(err)
            room = self.config.max_pending_rows - self.scheduler.num_unfinished - len(self._waiting_room)
            if room > 0 and not feed.exhausted:
                idle = self.scheduler.num_unfinished == 0 and self._pending is None and not self._waiting_room
                for item in feed.take(room, wait=idle):
                    err = item if isinstance(item, ResultRow) else self._admit(item)
                    if err is not None:
                        yield self._count(err)
            if self.scheduler.num_unfinished == 0 and self._pending is None:
                if feed.exhausted and not self._waiting_room:
                    return
                continue
            for result in self._step():
                yield self._count(result)
            if on_step is not None:
                on_step(self.stats)

    def _count(self, result: ResultRow) -> ResultRow:
        self.stats.count_result(result)
        return result

    def _step(self) -> list[ResultRow]:
        """Launch the next step, then read back the one before it while the device works.

        Host work (reading tokens, stop checks, results, the next schedule) overlaps the
        device's step instead of following it. A sequence that reaches max_tokens is known
        to end when its last step is launched; one that ends at EOS or a stop string is
        seen a step late and has already been given one more step, whose token is dropped.
        A prefill is read back the same way: the decode step after it takes the prefill's
        tokens from the device, so the device does not wait for the host between the two
        (docs/kernels.md has what that wait costs), and the
        rows' first tokens are read right after that decode is launched. Where the step
        read back holds constrained rows, it is read between the next step's forward and
        that step's masks, which need its tokens.
        """
        t0 = time.perf_counter()
        finished: list[ResultRow] = []
        read = None  # the step read back here: this call's time is mostly waiting for it

        def read_pending() -> None:
            # A constrained row's next mask depends on the token still being computed: the
            # runner calls this between the next step's forward and its masks.
            nonlocal read
            if self._pending is not None:
                finished.extend(self._read_back(self._pending))
                read, self._pending = self._pending, None

        constrained = self._pending is not None and any(s.matcher is not None for s in self._pending.seqs)
        seqs, is_prefill = self.scheduler.schedule() if self.scheduler.num_unfinished else ([], False)
        self.stats.preemptions = self.scheduler.num_preemptions
        if not seqs and self._pending is None:
            if not self.scheduler.num_unfinished:
                return finished
            raise RuntimeError("scheduler found nothing to run with sequences pending")
        launched = None
        if seqs:
            started = time.perf_counter()
            launched = self.runner.launch(seqs, is_prefill, self._pending, read_pending if constrained else None)
            launch_seconds = time.perf_counter() - started
            if is_prefill:
                self.stats.prefill_launch_seconds += launch_seconds
            else:
                self.stats.decode_launch_seconds += launch_seconds
            for seq in seqs:
                if seq.num_completion_tokens >= seq.sampling.max_tokens or seq.position_end >= self.max_context:
                    seq.finish_reason = "length"  # unless its last token turns out to stop it first
                    self.scheduler.finish(seq)
        if self._pending is not None:
            finished += self._read_back(self._pending)
            read = self._pending
        self._pending = launched
        if launched is not None and not self.config.overlap_steps:
            finished += self._read_back(launched)
            read, self._pending = launched, None
        self._unattributed += time.perf_counter() - t0
        if read is not None and self._waiting_room and any(s.is_finished for s in read.seqs):
            self._released += 1
        if read is not None:
            self._account(read, self._unattributed)
            self._unattributed = 0.0
        return finished

    def _account(self, step: StepHandle, seconds: float) -> None:
        """Step counts and times, by the kind of step that was read back.

        seconds: the host time of the calls that led to reading it back. That time also
        holds the host's work for the step launched after it (a prefill's eager launch
        runs while the step before it computes), so where the device timestamps steps
        (CUDA) a step's time is instead the device time from the end of the step before
        it to its own end: the steps' times still add up to the job's time, and a step is
        charged with what delayed its own end, not with launching its successor."""
        if step.is_timed and self._last_read is not None and self._last_read.is_timed:
            seconds = step.seconds_after(self._last_read)
        self._last_read = step
        st = self.stats
        if step.is_prefill:
            st.add_prefill(len(step.seqs), step.num_new_tokens, seconds)
        else:
            st.add_decode(len(step.seqs), step.num_context_tokens, seconds)
            if step.graphed:
                st.graphed_decode_steps += 1
            else:
                st.eager_decode_steps += 1
                if step.eager_reason is not None:
                    st.eager_reasons[step.eager_reason] = st.eager_reasons.get(step.eager_reason, 0) + 1

    def _read_back(self, step: StepHandle) -> list[ResultRow]:
        """Put a finished step's real tokens in place of its placeholders; end sequences."""
        finished = []
        now = None
        tokens = step.tokens_list()
        self.stats.device_wait_seconds += step.wait_seconds
        logprobs = step.logprobs.rows_list() if step.logprobs is not None else {}
        for b, (seq, index, tok) in enumerate(zip(step.seqs, step.indices, tokens)):
            live = self._live.get(seq.seq_id)
            if live is None:
                continue  # it ended at an earlier token; this one was a spare step
            seq.output_ids[index] = tok
            if b in logprobs:
                seq.logprob_rows.append(logprobs[b])
            if seq.matcher is not None and not seq.matcher.accept(tok):
                seq.finish_reason = "error"  # the mask allowed it, so the grammar has a flaw
                del seq.output_ids[index + 1:]
                self.scheduler.finish(seq)
                finished.extend(self._result(self._live.pop(seq.seq_id)))
                continue
            if index == 0:
                now = now or time.perf_counter()
                seq.first_token_time = now
                self.stats.add_ttft(now - seq.arrival_time)
            if self._stops(seq, tok, index, live.watch):
                seq.finish_reason = "stop"
                del seq.output_ids[index + 1:]  # a placeholder of the step now running
                self.scheduler.finish(seq)
            elif not (seq.is_finished and index == len(seq.output_ids) - 1):
                continue  # still going (or its last token is still to come)
            finished.extend(self._result(self._live.pop(seq.seq_id)))
        return finished

    def _stops(self, seq: Sequence, tok: int, index: int, watch: StopWatch | None) -> bool:
        """Does output token `index` (= tok) end the sequence: EOS, its grammar's end, or a stop string?"""
        if seq.matcher is not None and seq.matcher.is_done:
            return True  # (also with ignore_eos: nothing may follow the end of its grammar)
        if not seq.sampling.ignore_eos and tok in self.eos_ids:
            return True
        return watch is not None and watch.push(seq.output_ids, index + 1) is not None

    def _result(self, live: _Live) -> list[ResultRow]:
        """The row's result once its (last) completion has ended; [] while others run."""
        seq = live.seq
        if self.token_ids_by_row is not None and live.index == 0:
            self.token_ids_by_row[live.row_index] = list(seq.output_ids)
        if seq.logprob_rows is not None and self._vocab is None and self.loaded.tokenizer is not None:
            self._vocab = Vocab(self.loaded.tokenizer, self.loaded.config.vocab_size)
        done = completion_of(seq, live.index, live.watch.stops if live.watch else None, self.eos_ids,
                             self.loaded.tokenizer.decode if self.loaded.tokenizer is not None else None, self._vocab)
        completions: list[Completion] = [done]
        if live.group is not None:
            live.group.done[live.index] = done
            if not live.group.complete:
                return []
            completions = [live.group.done[i] for i in range(live.group.n)]
        return [result_row(live.row_index, live.id, live.url, seq, completions, len(completions), live.label)]
