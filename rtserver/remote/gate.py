"""`SendGate`: holds upstream requests for a moment so that the requests of a burst leave together.

Continuous-batching servers admit requests only between iterations, so a burst's first request sent
alone would start an iteration alone while the rest wait. A request waits until none has been started
(`arrived`) for `window_s` and every request taking its connection (`expect`) has come, for at most
`max_hold_s`. A lone request pays `window_s`; `window_s = 0` turns the gate off.
"""

from __future__ import annotations

import asyncio


class SendGate:
    def __init__(self, window_s: float, max_hold_s: float):
        self.window_s = window_s
        self.max_hold_s = max(max_hold_s, window_s)
        self._group: asyncio.Future[None] | None = None
        self._first = 0.0
        self._last = 0.0  # loop time of the latest `arrived`
        self._pending: set[object] = set()  # tickets of requests started and not yet at the gate
        self.arrivals = 0  # requests started
        self.requests = 0  # requests that went through the gate
        self.groups = 0  # groups released: requests / groups is the mean group size

    def arrived(self) -> None:
        """A request has been started; it comes to `wait` a few loop turns later. Starts, not arrivals
        at the gate, tell whether a burst is still coming in: the hub starts a whole burst first."""
        self.arrivals += 1
        if self.window_s > 0:
            self._last = asyncio.get_running_loop().time()

    def expect(self) -> object:
        """A request is taking its connection to the server and will come to `wait` (or `forget`) with
        the ticket returned: until then its group is not let go (bounded by `max_hold_s`)."""
        ticket = object()
        if self.window_s > 0:
            self._pending.add(ticket)
        return ticket

    def forget(self, ticket: object) -> None:
        """The request of `ticket` will not come to the gate (its connection failed), or has come."""
        self._pending.discard(ticket)

    async def wait(self, ticket: object | None = None) -> None:
        """Return when this request's group is released (at once when the gate is off). `ticket`: the
        one `expect` gave this request, if any."""
        self._pending.discard(ticket)
        self.requests += 1
        if self.window_s <= 0:
            self.groups += 1
            return
        loop = asyncio.get_running_loop()
        group = self._group
        if group is None:
            group = self._group = loop.create_future()
            self._first = loop.time()
            self._after_queued(group)
        # shielded: one waiter cancelled (its client left) must not cancel the group's future
        await asyncio.shield(group)

    def _after_queued(self, group: asyncio.Future[None]) -> None:
        # two hops to the end of the ready queue: the tasks queued by this loop turn's I/O poll (the
        # handlers of messages just read, which start requests) run before `_release_when_quiet` looks
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._release_when_quiet, group)

    def _release_when_quiet(self, group: asyncio.Future[None]) -> None:
        if group is not self._group:
            return  # released already
        loop = asyncio.get_running_loop()
        now = loop.time()
        last_call = self._first + self.max_hold_s
        if now < last_call:
            due = self._last + self.window_s
            if now < due:  # a request was started since: look again when it is quiet
                loop.call_at(min(due, last_call), self._after_queued, group)
                return
            if self._pending:  # started ones still connecting: look again a window later
                loop.call_at(min(now + self.window_s, last_call), self._after_queued, group)
                return
        self._group = None
        self.groups += 1
        group.set_result(None)  # the waiters resume in the order they joined, in one loop turn
