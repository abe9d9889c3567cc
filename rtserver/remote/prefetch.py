"""`Prefetcher`: a session's next-turn prefix sent to its server before its next message comes.

When a reply ends the hub hands over how to compute the tokens the session's next prompt will start
with (tasks/chat.py `next_turn_prefix`: the history, the end of the reply and the next user header;
computed only when the prefetch is about to be sent, so a turn that comes first never paid for it),
and they go to the session's server `PREFETCH_DELAY_S` later as a one-token, non-streamed completion
(`max_tokens: 0` still samples one token in llama-server 11434; vLLM and rtserver require at least
1), so its prefix cache holds them when the next message comes and that turn prefills only the
message. It is optional work: it goes only where the URL is up with room for one more request beside
it, bypasses the send gate, is not retried, does not count as a failure of the URL, and a failure is
only logged. A session has at most one; a newer one, a disconnect or a reset cancels it. The
session's next turn cancels it when it has not been written yet, and otherwise waits for it at most
`PREFETCH_WAIT_S`: a server with slots (llama-server) would give a turn sent while its slot is busy
another slot, without the session's cache, which costs far more than waiting for a prefill of a few
tokens. The delay is for clients that answer at once (scripts, load tests): their next message comes
before a prefetch could be done, so it would only add a server iteration to wait for; waiting
`PREFETCH_DELAY_S` first, their prefetch is cancelled unsent, while a person, who takes seconds to
read and type, still finds the prefix computed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable

from ..engine.backend import SamplingParams
from .client import Upstreams
from .pool import BackendUnavailable, Upstream
from .sse import UpstreamProtocolError
from .wire import PREFETCH_RESPONSE_LIMIT, completion_body, describe, read_head

log = logging.getLogger("rtserver.remote")

PREFETCH_WAIT_S = 0.5  # the longest a turn waits for its session's prefetch already sent (see above)
PREFETCH_DELAY_S = 0.2  # from the end of a reply to its prefetch's request (see above)
# what `counts` counts: started, done (answered 200), skipped (no room), failed, cancelled, waited for
# by the session's next turn, overtaken (that turn stopped waiting)
OUTCOMES = ("started", "done", "skipped", "failed", "cancelled", "waited", "overtaken")

Prefix = Callable[[], list[int] | None]


class _Prefetch:
    """A session's next-turn prefetch in flight."""

    task: asyncio.Task[None]

    def __init__(self) -> None:
        self.sent = False  # being written to the server: cancelling it no longer spares the server


class Prefetcher:
    """At most one prefetch per session, counted by outcome (see the module docstring)."""

    def __init__(self, ups: Upstreams):
        self.ups = ups
        self.entries: dict[Hashable, _Prefetch] = {}
        self.counts = dict.fromkeys(OUTCOMES, 0)

    def prefetch(self, prefix: Prefix, session_key: Hashable) -> None:
        self.cancel(session_key)
        try:
            up = self.ups.pool.choose(session_key)
        except BackendUnavailable:
            return
        entry = _Prefetch()
        entry.task = asyncio.get_running_loop().create_task(self._run(up, prefix, session_key, entry))
        entry.task.add_done_callback(lambda _: self._forget(session_key, entry))
        self.entries[session_key] = entry

    def cancel(self, session_key: Hashable) -> None:
        entry = self.entries.pop(session_key, None)
        if entry is not None and not entry.task.done():
            entry.task.cancel()

    def stop(self) -> None:
        for key in list(self.entries):
            self.cancel(key)

    def _forget(self, session_key: Hashable, entry: _Prefetch) -> None:
        if entry.task.cancelled():
            self.counts["cancelled"] += 1
        if self.entries.get(session_key) is entry:
            del self.entries[session_key]

    async def _run(self, up: Upstream, prefix: Prefix, session_key: Hashable, entry: _Prefetch) -> None:
        await asyncio.sleep(PREFETCH_DELAY_S)
        try:
            prompt_ids = prefix()  # only now: a turn that came within the delay never paid for it
        except Exception as exc:
            log.debug("no next-turn prefix for session %s (%s)", session_key, exc)
            return
        if not prompt_ids:
            return  # the template does not split safely there (tasks/chat.py next_turn_prefix)
        lease = self.ups.reuse_of(up).own_lease(session_key)  # only into the session's own cache
        if lease is None or not self.ups.pool.try_acquire_spare(up):
            if lease is not None:
                lease.release()
            self.counts["skipped"] += 1
            return
        self.counts["started"] += 1
        try:
            body = completion_body(
                prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=1), False, self.ups.model
            )
            body.update(lease.fields(prompt_ids))
            entry.sent = True
            async with asyncio.timeout(self.ups.settings.timeout_s):
                async with self.ups.completion(up, body, gated=False) as resp:
                    head = await read_head(resp, PREFETCH_RESPONSE_LIMIT)
            if not head.lstrip().startswith("{"):
                raise UpstreamProtocolError(f"an answer that is not JSON: {head[:80]!r}")
            lease.wrote(prompt_ids, [])
            self.counts["done"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.counts["failed"] += 1
            log.warning("next-turn prefetch on %s failed (no harm done): %s", up.url, describe(exc))
        finally:
            lease.release()
            self.ups.pool.release(up)

    async def settle(self, session_key: Hashable | None) -> None:
        """Before a session's turn: drop its prefetch if not written yet, else wait for it (bounded)."""
        entry = self.entries.get(session_key) if session_key is not None else None
        if entry is None or entry.task.done():
            return
        if not entry.sent:
            self.cancel(session_key)
            return
        self.counts["waited"] += 1
        done, _ = await asyncio.wait({entry.task}, timeout=PREFETCH_WAIT_S)
        if not done:
            self.counts["overtaken"] += 1
            self.cancel(session_key)
