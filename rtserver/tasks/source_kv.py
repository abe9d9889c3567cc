"""Sources computed ahead: each chunk of the knowledge index as a knowledge turn's prompt holds it.

A knowledge turn's sources are segments (backend.Inserted): the engine computes each one once and copies its
KV into every prompt that holds it. Computing them in the background, at start-up and after each re-index,
spares the first customer who asks about an article that wait. Work runs at background priority, a few
chunks at a time, so customers' turns go first.
"""

from __future__ import annotations

import asyncio
import logging

from ..engine.backend import InferenceBackend, Inserted, Priority, SamplingParams
from .chat import ChatTask
from .citations import INSTRUCTION, QUESTION, source_text

log = logging.getLogger("rtserver.knowledge")

AT_ONCE = 4  # chunks in flight


class SourceWarmer:
    """Computes the sources' KV of the first `knowledge.warm_sources` chunks; `done` of `total` so far."""

    def __init__(self, chat: ChatTask, backend: InferenceBackend):
        self.chat = chat
        self.backend = backend
        self.done = 0
        self.total = 0

    async def warm(self) -> None:
        """Each chunk once, as the prompt of a turn with `top_k` sources gives it."""
        kb = self.chat.knowledge
        if kb is None or kb.index is None or kb.settings.warm_sources <= 0:
            return
        hits = await asyncio.to_thread(kb.index.chunks, kb.settings.warm_sources)
        self.done, self.total = 0, len(hits)
        share = max(8, kb.settings.source_tokens // kb.settings.top_k)  # as citations.retrieved cuts them
        first = self.chat.encode([{"role": "user", "content": "x"}])
        public = first.ids[: first.public_tokens]
        fixed = [
            self._ids(INSTRUCTION + "\n"),
            *(self._ids(f"[{n}]") for n in range(1, kb.settings.top_k + 1)),
        ]
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        for hit in hits:
            queue.put_nowait(self._ids(source_text(hit, share, self.chat.cut)))

        async def worker() -> None:
            while not queue.empty():
                parts = [*fixed, queue.get_nowait(), self._ids(QUESTION)]
                at, segments = len(public), []
                for part in parts:
                    segments.append((at, at + len(part)))
                    at += len(part)
                block = Inserted(len(public), at, tuple(segments))
                prompt = public + [i for part in parts for i in part] + self._ids("?")
                params = SamplingParams(max_new_tokens=1, priority=Priority.BACKGROUND)
                try:
                    stream = self.backend.generate(prompt, params, public_tokens=len(public), inserted=block)
                    await stream.result()
                except Exception as exc:  # busy or failing: that source is computed on first use instead
                    log.debug("knowledge: a source was not computed ahead (%s)", exc)
                self.done += 1

        await asyncio.gather(*(worker() for _ in range(AT_ONCE)))
        log.info("knowledge: %d sources computed ahead", self.done)

    def _ids(self, text: str) -> list[int]:
        return self.chat.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
