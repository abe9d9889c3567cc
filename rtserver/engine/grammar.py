"""Structured output on the local engine. llguidance compiles `OutputFormat`s against the model's tokenizer
(`Grammars`). Each sequence has a `Constraint`. It masks its logits row to the tokens that keep the text
valid, and follows the tokens it samples.

llguidance computes a step's allowed tokens as a bitmask in microseconds. Compiling a format is done once
per format, off the scheduler thread. So is its first mask, which builds the lexer.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .output_format import OutputFormat, OutputFormatError
from .token_bytes import ll_tokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

# a step's logits: [n, vocab] float32, or its n rows (views, masked and read in place)
Rows = torch.Tensor | list[torch.Tensor]
MAX_FORMATS = 128  # compiled formats kept (a task's are pinned; a client's drop out least recently used)


def _limits() -> LLParserLimits:
    """Bounds on the work of one compile and one mask step, whoever wrote the format."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_grammar_size=100_000, verbose_errors=False)


class ConstraintError(RuntimeError):
    """A sampled token the grammar does not allow. The mask kept every other."""


class Constraint:
    """No constraint: free text. The null object of `GrammarConstraint`."""

    active = False

    def fill(self, words: np.ndarray) -> None:
        """Write this step's allowed tokens into uint32 `words`: bit i of word j is token 32j + i."""

    def advance(self, token: int) -> bool:
        """Follow a sampled token. True when the text is complete (nothing may follow)."""
        return False

    def rollback(self, tokens: int) -> None:
        """Forget the last `tokens` followed (drafts checked ahead: Sampler.verify)."""


FREE = Constraint()


def word_bit(token: int) -> tuple[int, np.uint32]:
    """Where a token sits in a packed mask. The index of its 32-bit word, and its bit there."""
    return token >> 5, np.uint32(1 << (token & 31))


def closing_reserve(max_tokens: int) -> int:
    """How many of a sequence's last tokens steer its text to an end. See `Closers`."""
    return min(64, max(24, max_tokens // 4))


class Closers:
    """Token sets a text near its token limit is steered to, most closing first. First come tokens of `"]}`
    that open with a quote; inside a string they end it. Then come tokens of `]}` alone, then of `"]},:`.
    Where the grammar allows one of a set, the mask keeps that set alone. So strings, numbers and arrays end
    instead of running to the limit.
    """

    TIERS = ((b'"', b'"]}'), (b"", b"]}"), (b"", b'"]},:'))  # (opening, made only of)

    def __init__(self, tiers: list[np.ndarray]):
        self.tiers = tiers

    @classmethod
    def of(cls, ll_tokenizer: LLTokenizer, vocab_size: int) -> Closers:
        tiers = [np.zeros((vocab_size + 31) // 32, dtype=np.uint32) for _ in cls.TIERS]
        for t in range(min(vocab_size, ll_tokenizer.vocab_size)):
            if ll_tokenizer.is_special_token(t):
                continue
            text = ll_tokenizer.decode_bytes([t])
            for tier, (opening, chars) in zip(tiers, cls.TIERS, strict=True):
                if text.startswith(opening) and text and not text.strip(chars):
                    word, bit = word_bit(t)
                    tier[word] |= bit
        return cls(tiers)

    def narrow(self, words: np.ndarray) -> None:
        """Keep the first tier that `words` allows any token of. Keep all of `words` when none."""
        for tier in self.tiers:
            narrowed = words & tier
            if narrowed.any():
                words[:] = narrowed
                return


NO_CLOSERS = Closers([])  # steers nothing: before the tokenizer is loaded, and in checks


class GrammarConstraint(Constraint):
    """One sequence's place in its grammar. Its last `closing_reserve` tokens are special. There it ends as
    soon as the text is complete, and otherwise prefers closing tokens. So a long text still ends valid.
    """

    active = True

    def __init__(self, matcher: LLMatcher, eos_ids: set[int], closers: Closers, max_tokens: int):
        self.matcher = matcher
        self.eos_ids = sorted(eos_ids)  # the sequence's own: its stop token ids too
        self.closers = closers
        self.closing_after = max(0, max_tokens - closing_reserve(max_tokens))
        self.tokens = 0

    def fill(self, words: np.ndarray) -> None:
        m = self.matcher
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if m.is_error():
            raise ConstraintError(m.get_error())
        closing = self.tokens >= self.closing_after
        if m.is_accepting():  # every end-of-sequence id may end a complete text, not just llguidance's
            if closing:
                words[:] = 0
            for t in self.eos_ids:
                word, bit = word_bit(t)
                words[word] |= bit
        elif closing:
            self._steer(words)

    def _steer(self, words: np.ndarray) -> None:
        """Text the grammar forces (a required key, say) goes in as its canonical tokens, one each step. A
        sampler might pick however many pieces; this does not. Otherwise closers lead.
        """
        forced = self.matcher.compute_ff_tokens()
        word, bit = word_bit(forced[0]) if forced else (0, np.uint32(0))
        if words[word] & bit:
            words[:] = 0
            words[word] = bit
        else:
            self.closers.narrow(words)

    def advance(self, token: int) -> bool:
        m = self.matcher
        if not m.consume_token(token):
            raise ConstraintError(m.get_error() or f"token {token} is not allowed here")
        self.tokens += 1
        return bool(m.is_stopped())

    def rollback(self, tokens: int) -> None:
        if tokens and not self.matcher.rollback(tokens):
            raise ConstraintError(self.matcher.get_error() or f"cannot take back {tokens} tokens")
        self.tokens -= tokens


# Byte value -> the 8 logit offsets it stands for (0 where its bit is set, -inf elsewhere): a mask
# row becomes the row's additive bias by one gather of 32-byte rows.
_BIAS = np.array([[0.0 if (b >> i) & 1 else -np.inf for i in range(8)] for b in range(256)], dtype=np.float32)


def apply_masks(constraints: list[Constraint], logits: Rows) -> list[Exception | None]:
    """Mask each constrained row of `logits` to its allowed tokens, in place. `logits` is [n, vocab]
    float32, or n rows. A row whose grammar fails gets the error in its place. The others are masked.
    """
    errors: list[Exception | None] = [None] * len(constraints)
    rows = [i for i, c in enumerate(constraints) if c.active]
    if not rows:
        return errors
    vocab = logits[0].shape[-1]
    words = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.uint32)
    for j, i in enumerate(rows):
        try:
            constraints[i].fill(words[j])
        except Exception as exc:  # this sequence's grammar alone
            errors[i] = exc
            continue
        bias = _BIAS.take(words[j].view(np.uint8), axis=0).reshape(-1)[:vocab]
        row = logits[i].numpy()  # the same memory
        np.add(row, bias, out=row)
    return errors


class Grammars:
    """The formats compiled for one tokenizer. llguidance's view of it is built once. Each compiled format
    is kept as a pristine matcher. Every sequence of that format copies it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: LLTokenizer | None = None
        self._closers = NO_CLOSERS
        self._compiled: OrderedDict[OutputFormat, LLMatcher] = OrderedDict()
        self._pinned: set[OutputFormat] = set()
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = ll_tokenizer(self._hf, self.vocab_size, self.eos_ids)
                self._closers = Closers.of(self._tokenizer, self.vocab_size)
            return self._tokenizer

    def compile(self, fmt: OutputFormat, *, pin: bool = False) -> None:
        """Compile `fmt` (and compute its first mask) unless done; raises OutputFormatError. Slow for a
        big grammar: call it off the event loop. `pin` keeps it for good (a task's format)."""
        if fmt.free:
            return
        with self._lock:
            if fmt in self._compiled:
                self._compiled.move_to_end(fmt)
                if pin:
                    self._pinned.add(fmt)
                return
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(), fmt.grammar(), log_level=0, limits=_limits())
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
        try:  # a matcher whose grammar failed to build is in its error state: the first mask says so
            GrammarConstraint(matcher, set(), NO_CLOSERS, sys.maxsize).fill(words)
        except ConstraintError as exc:
            raise OutputFormatError(f"{fmt.kind}: {exc}") from None
        if not words.any():
            raise OutputFormatError(f"{fmt.kind}: the grammar allows no text at all")
        with self._lock:
            self._compiled[fmt] = matcher
            if pin:
                self._pinned.add(fmt)
            self._evict()

    def _evict(self) -> None:
        for fmt in list(self._compiled):
            if len(self._compiled) <= MAX_FORMATS:
                return
            if fmt not in self._pinned:
                del self._compiled[fmt]

    def constraint(self, fmt: OutputFormat, eos_ids: set[int], max_tokens: int) -> Constraint:
        """A new sequence's constraint for `fmt`, compiled here if it is not already. `eos_ids` are the ids
        that end the sequence, allowed once the text is complete. `max_tokens` is its limit.
        """
        if fmt.free:
            return FREE
        self.compile(fmt)
        with self._lock:
            pristine = self._compiled.get(fmt)
            if pristine is None:  # evicted in between by other formats
                raise OutputFormatError(f"{fmt.kind}: too many formats in use; try again")
            return GrammarConstraint(pristine.deep_copy(), eos_ids, self._closers, max_tokens)
