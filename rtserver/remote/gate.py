"""`SendGate`: holds upstream requests for a moment so that the requests of a burst leave together.

Why: llama-server (like other continuous-batching servers) admits new requests only between its decode
iterations. A burst reaches the hub within a few ms, but leaves it spread over the hub's own
per-request work (HTTP parsing, the chat template, the upstream request); the first request then starts
an iteration on its own and the others wait for that iteration to end. Held until the burst has stopped
arriving and then written one right after another, they reach the server together.

A request waits until no other has joined its group for `window_s`, and never longer than `max_hold_s`
after the group's first (a steady stream of requests is not held back without end): a lone request
pays `window_s`. `window_s = 0` turns the gate off.
"""

from __future__ import annotations

import asyncio


class SendGate:
    def __init__(self, window_s: float, max_hold_s: float):
        self.window_s = window_s
        self.max_hold_s = max(max_hold_s, window_s)
        self._group: asyncio.Future[None] | None = None
        self._first = 0.0
        self._last = 0.0
        self.requests = 0  # requests that went through the gate
        self.groups = 0  # groups released: requests / groups is the mean group size

    async def wait(self) -> None:
        """Return when this request's group is released (at once when the gate is off)."""
        self.requests += 1
        if self.window_s <= 0:
            self.groups += 1
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        group = self._group
        if group is None:
            group = self._group = loop.create_future()
            self._first = now
            loop.call_at(now + self.window_s, self._release_when_quiet, group)
        self._last = now
        # shielded: one waiter cancelled (its client left) must not cancel the group's future
        await asyncio.shield(group)

    def _release_when_quiet(self, group: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        due = min(self._last + self.window_s, self._first + self.max_hold_s)
        if loop.time() < due:  # someone joined since this check was set: look again when it is quiet
            loop.call_at(due, self._release_when_quiet, group)
            return
        self._group = None
        self.groups += 1
        group.set_result(None)  # the waiters resume in the order they joined, in one loop turn
