"""Who may log in to the console: failed logins per client IP, agent names, rejoin tokens.

After `security.console_login_failures_per_min` wrong tokens from one client IP, every login from
it is refused for the rest of the minute. The server assigns agent ids; the `rejoin` token it hands
out (an HMAC of the id) is the only way back to one, so no agent can pose as another.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import unicodedata
from collections.abc import Callable

from cachetools import TTLCache

from ..cluster import ClusterUnavailable
from ..seams import ConsoleBus

MAX_AGENT_NAME_CHARS = 60
LOGIN_WINDOW_S = 60.0  # failed logins are counted per client IP over this window


def agent_name(raw: object) -> str:
    """A display name: one line, no control, format (bidi overrides) or surrogate characters."""
    if not isinstance(raw, str):
        return "Agent"
    kept = "".join(
        c for c in raw[: 4 * MAX_AGENT_NAME_CHARS] if unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co")
    )
    return " ".join(kept.split())[:MAX_AGENT_NAME_CHARS] or "Agent"


def digest(text: str) -> bytes:
    """Equal-length digests compare in constant time, telling nothing of the text, not its length."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class LoginFailures:
    """Failed console logins per client IP in a window from its first failure; at the limit every
    login is refused, a right token too, so a guesser learns nothing more."""

    def __init__(self, limit: int, max_ips: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        # per IP: [the window's end, failures in it]
        self.windows: TTLCache[str, list[float]] = TTLCache(maxsize=max_ips, ttl=LOGIN_WINDOW_S, timer=clock)

    def check(self, ip: str, failed: bool = False) -> float:
        """Count a failure first if `failed`: seconds until the IP may try again (0.0: it may now)."""
        window = self.windows.get(ip)
        if failed:
            if window is None:
                window = self.windows[ip] = [self.clock() + LOGIN_WINDOW_S, 0]
            window[1] += 1
        if window is None or window[1] < self.limit:
            return 0.0
        return max(0.001, window[0] - self.clock())


class RejoinTokens:
    """Signs agent ids under a key all nodes share (clustered: in Redis; alone: this process's)."""

    def __init__(self, bus: ConsoleBus):
        self.bus = bus
        self._key: bytes | None = None

    async def key(self) -> bytes | None:
        """The signing key; None while Redis cannot give it (no rejoin token then)."""
        if self._key is None:
            try:
                self._key = (await self.bus.shared_secret("rejoin")).encode()
            except ClusterUnavailable:
                return None
        return self._key

    @staticmethod
    def token(agent_id: str, key: bytes) -> str:
        return f"{agent_id}.{hmac.new(key, agent_id.encode(), hashlib.sha256).hexdigest()}"

    def agent_id(self, given: object, key: bytes | None) -> str | None:
        """The agent id a valid `rejoin` token names (an id this server gave out), else None."""
        if key is None or not isinstance(given, str) or given.count(".") != 1:
            return None
        agent_id = given.split(".")[0]
        if not agent_id or not hmac.compare_digest(digest(self.token(agent_id, key)), digest(given)):
            return None
        return agent_id
