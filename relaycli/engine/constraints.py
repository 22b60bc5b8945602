"""Constrained answers: a row's JSON schema, regex, choices or grammar as a token mask.

xgrammar compiles each distinct constraint once per job (`Grammars`, a cache shared by
every row; rows are compiled on the prefetch thread, ahead of the engine) into a grammar
whose matcher, one per sequence, says which tokens may come next. Before a step samples,
each constrained row's allowed tokens are written as a bitmask (32 tokens an int32) on
the host, copied to the device and applied to the logits there (`apply_masks`): a token
the grammar forbids gets -inf. Rows without a constraint pay nothing; a step without one
runs no code here. Each sampled token is then accepted into its row's matcher; the end
of the grammar is reached when it accepts an end-of-sequence token (finish_reason stop).

xgrammar is an optional dependency (`pip install 'relay-batch[structured]'`); without it a
constrained row is an error row naming that fix, never an unconstrained answer.
"""

from __future__ import annotations

import re
import threading

import torch

from relaycli.engine.staging import stage
from relaycli.engine.vocab import Vocab
from relaycli.io.structured import STRUCTURED_FIX, ConstraintSpec


_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:94: " before a message


class ConstraintError(ValueError):
    """A constraint that cannot be used: the message names the field and the fix."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ConstraintError(f"constrained answers need xgrammar, which is not installed; {STRUCTURED_FIX}") from None
    return xgrammar


def choices_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose answers are exactly the given strings."""
    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    return "root ::= " + " | ".join(literal(c) for c in choices)


class Grammars:
    """Compiled constraints of one job, by spec (each compiled once), and their matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler = None
        self._compiled: dict[str, object] = {}
        self._batch = None  # fills a step's masks on all cores (xgrammar's BatchGrammarMatcher)
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()

    def _compiler_of(self, xgr):
        if self._compiler is None:
            vocab = Vocab(self._tokenizer, self.vocab_size)
            kinds = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
                     "raw": xgr.VocabType.RAW}
            info = xgr.TokenizerInfo(vocab.raw, kinds[vocab.kind], vocab_size=self.vocab_size,
                                     stop_token_ids=self._eos, add_prefix_space=vocab.kind == "byte_fallback")
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def prepare_in_background(self, specs: list[ConstraintSpec]) -> threading.Thread:
        """Import xgrammar, build the job's compiler and compile specs (those of the job's
        first rows) on a thread of their own, so that the rows find them ready instead of
        holding the prefetch thread for about a second at the job's start. Errors are left
        for compile() to report, naming the row."""
        def prepare() -> None:
            for spec in specs:
                try:
                    self.compile(spec)
                except ConstraintError:
                    pass
        thread = threading.Thread(target=prepare, name="relay-grammars", daemon=True)
        thread.start()
        return thread

    def compile(self, spec: ConstraintSpec):
        """The compiled grammar of spec (from the cache after its first time); a
        ConstraintError naming spec's field when it does not compile."""
        key = spec.key
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
            if key in self._errors:
                raise ConstraintError(self._errors[key])
            xgr = _xgrammar()
            try:
                compiled = self._compile(self._compiler_of(xgr), spec)
            except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
                detail = _LOG_PREFIX.sub("", " ".join(str(exc).split()))[:200] or type(exc).__name__
                what = {"json_schema": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
                        "choices": "choices", "grammar": "EBNF grammar (with a rule named root)"}[spec.kind]
                self._errors[key] = f"'{spec.field}' is no {what} relay can use ({detail}); fix it or remove the field"
                raise ConstraintError(self._errors[key]) from None
            self._compiled[key] = compiled
            return compiled

    @staticmethod
    def _compile(compiler, spec: ConstraintSpec):
        # JSON on one line: no whitespace beyond one space after ':' and ',', so the
        # model spends no tokens on indentation
        if spec.kind == "json_object":  # OpenAI's JSON mode: any JSON object
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.source if isinstance(spec.source, dict) else
                                                ("{}" if spec.source else '{"not": {}}'),
                                                any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "choices":
            return compiler.compile_grammar(choices_grammar(spec.source))
        return compiler.compile_grammar(spec.source)

    def matcher(self, compiled) -> RowMatcher:
        xgr = _xgrammar()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        return RowMatcher(xgr.GrammarMatcher(compiled), self._batch)


class RowMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, batch) -> None:
        self._m, self._batch = matcher, batch

    @staticmethod
    def fill_all(matchers: list[RowMatcher], bitmask: torch.Tensor) -> None:
        """Row i of bitmask from matchers[i], the rows filled in parallel (one step's masks)."""
        if matchers:
            matchers[0]._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask)

    def accept(self, token: int) -> bool:
        """Take the sampled token; False when the grammar does not allow it."""
        return bool(self._m.accept_token(token))

    @property
    def is_done(self) -> bool:
        """The grammar has ended (its end-of-sequence token was accepted)."""
        return bool(self._m.is_terminated())


def apply_masks(logits: torch.Tensor, matchers: list[RowMatcher | None]) -> torch.Tensor:
    """logits [B, V] with -inf where a row's grammar forbids the token. Rows without a
    matcher, or whose grammar has ended (a step the row is no longer part of: its token is
    dropped), are unchanged. Returns logits itself when no row is masked, else a new tensor."""
    rows = [b for b, m in enumerate(matchers) if m is not None and not m.is_done]
    if not rows:
        return logits
    batch, vocab = logits.shape
    words = (vocab + 31) // 32
    filled = torch.empty((len(rows), words), dtype=torch.int32)
    RowMatcher.fill_all([matchers[b] for b in rows], filled)
    bitmask = filled if len(rows) == batch else torch.full((batch, words), -1, dtype=torch.int32)  # -1: all allowed
    if len(rows) < batch:
        bitmask[rows] = filled
    # Bit j of word w allows token 32 w + j. Read as bytes (little-endian, as on x86 and
    # GPUs), byte k of word w holds tokens 32 w + 8 k + s for bit s: unpacking bytes makes a
    # [B, V] mask of uint8, a quarter of what unpacking the int32 words would.
    as_bytes = stage(bitmask, logits.device).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    forbidden = ((as_bytes[:, :, None] >> shifts) & 1).view(batch, words * 32)[:, :vocab] == 0
    return logits.masked_fill(forbidden, float("-inf"))
