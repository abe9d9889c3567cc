"""The output side of a generation: token ids to text deltas, and stop strings.

The scheduler deals in token ids only. On the event loop, each stream's `Detokenizer` turns the ids it
receives into deltas that are always whole UTF-8 characters and never show a part of a stop string.
A stop string found in the text ends the output there; the engine then cancels the sequence.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from .backend import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str], eos_token_ids: Collection[int]):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.eos_token_ids = set(eos_token_ids)
        self.token_ids: list[int] = []  # every id received, the EOS included
        self.text = ""  # decoded so far; cut at the stop string once one matched
        self.stopped = False  # a stop string matched: the text ends before it
        self.stop_tokens = 0  # ids up to and including the one that completed the stop string
        self._emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0

    def update(self, token_id: int, last: bool = False) -> str:
        """Take one sampled id; returns the text now safe to show. `last`: the sequence ends with it,
        so whatever is held back is shown too."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        if token_id in self.eos_token_ids:
            return self._flush()
        self._decode_new()
        for stop in self.stop:
            # Only the region that the new token could have completed needs a look.
            at = self.text.find(stop, max(0, self._emitted - len(stop)))
            if at != -1:
                self.text = self.text[:at]
                self.stopped, self.stop_tokens = True, len(self.token_ids)
                return self._take()
        if last:
            return self._flush()
        safe = len(self.text) - self._stop_prefix_overlap()
        delta = self.text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return delta

    def _ids(self) -> list[int]:
        ids = self.token_ids
        return ids[:-1] if ids and ids[-1] in self.eos_token_ids else ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self) -> None:
        ids = self.token_ids
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        full = self._decode(ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)

    def _stop_prefix_overlap(self) -> int:
        """Length of the longest text tail that could still grow into a stop string."""
        best = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def _flush(self) -> str:
        """The end: whatever is still held back (a half character at the very end) as decoded."""
        ids = self._ids()
        tail = self._decode(ids[self._prefix_offset :])
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        if len(tail) > len(prefix):
            self.text += tail[len(prefix) :]
        self._prefix_offset = self._read_offset = len(ids)
        return self._take()

    def _take(self) -> str:
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta
