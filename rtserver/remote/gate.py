"""`SendGate`: holds upstream requests for a moment so that the requests of a burst leave together.

Why: llama-server (like other continuous-batching servers) admits new requests only between its decode
iterations. A burst reaches the hub within a few ms, but leaves it spread over the hub's own
per-request work (HTTP parsing, the chat template, the upstream request); the first request then starts
an iteration on its own and the others wait for that iteration to end. Held until the burst has stopped
arriving and then written one right after another, they reach the server together. Measured
(docs/remote-bench-history.md, runs A and B): driven directly, llama-server took all 32 requests of
the burst into its first iteration; through the hub without the gate the first request came alone,
~1 ms after the hub read it, and the other 31 waited for its iteration (~30 ms) before theirs began.

What "arriving" means: a request is started (`arrived()`, called by the backend when a generation or
a label score begins, in the loop turn that handled its client's message), not when it reaches the gate:
the hub handles every message of a burst before the first upstream request is written, so the gaps
between requests reaching the gate say nothing about whether more are coming, while requests keep
being started every few hundred microseconds for as long as the hub is taking a burst in.

A request waits until no request has been started for `window_s` and every request that is taking
its connection to the server (`expect`) has come to the gate (connecting after the window has passed
while the hub is busy, or one request finding a kept-alive connection and coming at once, would
otherwise be let go alone and start the server's iteration alone), and never longer than `max_hold_s`
after its group's first (a steady stream of requests is not held back without end): a lone request
pays `window_s`. A request whose connection fails is `forget`-ed. Before letting a group go the gate
lets the loop run the tasks already queued (the handlers of messages read in the same loop turn), so a
request read but not yet started still counts. `window_s = 0` turns the gate off.
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
        """A request has been started (it comes to `wait` a few loop turns later)."""
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
