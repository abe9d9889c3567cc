"""Who may log in to the console: failed logins per client IP, agent names, rejoin tokens.

The right token is never refused. Wrong tokens are counted per client IP, each wrong token once;
after `security.console_login_failures_per_min` of them in a minute, each login from that IP waits
before its token is checked, one second doubling with each further failure up to `MAX_LOGIN_DELAY_S`,
the right token's too (an answer that came at once would tell a guesser it was right). A login with
a rejoin token this server signed (an agent who logged in before) does not wait. The server assigns
agent ids; the `rejoin` token it hands out (an HMAC of the id) is the only way back to one, so no
agent can pose as another.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

from cachetools import TTLCache

from ..seams import ConsoleBus, StoreUnavailable

MAX_AGENT_NAME_CHARS = 60
LOGIN_WINDOW_S = 60.0  # failed logins are counted per client IP over this window
FIRST_LOGIN_DELAY_S = 1.0  # the wait of a login from an IP at the limit, doubling per failure beyond
MAX_LOGIN_DELAY_S = 30.0
MAX_TOKENS_KEPT = 64  # wrong tokens remembered per IP and window, so a repeated one counts once


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


def login_delay(failures: int, limit: int) -> float:
    """Seconds a login waits after `failures` wrong tokens from its IP (0.0 below `limit`)."""
    if not limit or failures < limit:
        return 0.0
    return min(MAX_LOGIN_DELAY_S, FIRST_LOGIN_DELAY_S * 2.0 ** min(failures - limit, 32))


@dataclass
class Failures:
    """One IP's wrong tokens in its window: how many, and the digests of those remembered."""

    count: int = 0
    seen: set[bytes] = field(default_factory=set)


class LoginFailures:
    """Wrong console tokens per client IP in a window from its first failure, each distinct token
    counted once (an agent's page retrying an old token is one failure, not a lock-out)."""

    def __init__(self, limit: int, max_ips: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.windows: TTLCache[str, Failures] = TTLCache(maxsize=max_ips, ttl=LOGIN_WINDOW_S, timer=clock)

    def failed(self, ip: str, attempt: bytes) -> bool:
        """Count a wrong token (`attempt`: its digest) of `ip`; False when it was already counted."""
        window = self.windows.get(ip)
        if window is None:
            window = self.windows[ip] = Failures()
        if attempt in window.seen:
            return False
        if len(window.seen) < MAX_TOKENS_KEPT:
            window.seen.add(attempt)
        window.count += 1
        return True

    def delay(self, ip: str) -> float:
        """Seconds a login from `ip` waits now before its token is checked."""
        window = self.windows.get(ip)
        return login_delay(window.count if window else 0, self.limit)


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
            except StoreUnavailable:
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
