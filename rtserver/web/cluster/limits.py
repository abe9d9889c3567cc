"""Cluster-wide per-IP limits: the client IP's token bucket and `security.max_sessions_per_ip`, each one
Lua script run atomically in Redis (redis-py `register_script`: EVALSHA, loaded again by itself after a
Redis restart). Time is Redis's own `TIME`, so nodes with skewed clocks share one bucket correctly.
Per-connection buckets stay local (rtserver/web/ratelimit.py): a connection lives on one node. Failed
console logins per IP are a counter per one-minute window (`security.console_login_failures_per_min`).

Sessions per IP: a sorted set per IP of the sessions it holds, each scored by when it stops counting.
A connected session's score is a lease the holding node renews with its heartbeat (as long as its
record's TTL once it has one, so a dead node's sessions count until they expire). On disconnect a
session with a record stays held until the record expires (`sessions.idle_timeout_s`); an empty one,
which has no record and nothing to resume elsewhere, leaves the set. At the cap a new session is
refused with the time until the first one stops counting: a flood from one address never makes
another customer's conversation go, and holds no more than its cap.
"""

from __future__ import annotations

from typing import Any

from . import Cluster

# KEYS[1] bucket hash; ARGV rate, burst → seconds to wait as a string (0 = taken)
TOKEN_BUCKET = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1]) or burst
local ts = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""

# the zset lives as long as its longest-held member (EXPIRE never shortens it)
KEEP_KEY = """
local function keep(key, seconds)
  if redis.call('TTL', key) < seconds then redis.call('EXPIRE', key, seconds) end
end
"""

# KEYS[1] the IP's session zset; ARGV session id, cap (0: none), seconds it counts from now → '0'
# admitted, else the seconds until the first held session stops counting
SESSION_SLOT = (
    KEEP_KEY
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cap = tonumber(ARGV[2])
local hold = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and cap > 0 and redis.call('ZCARD', KEYS[1]) >= cap then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(tonumber(first[2]) - now)
end
local cur = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]))
if not cur or cur < now + hold then redis.call('ZADD', KEYS[1], now + hold, ARGV[1]) end
keep(KEYS[1], math.ceil(hold) + 1)
return '0'
"""
)

# KEYS[1] the IP's session zset; ARGV session id, seconds it still counts (0: it leaves now)
HOLD = (
    KEEP_KEY
    + """
if tonumber(ARGV[2]) <= 0 then return redis.call('ZREM', KEYS[1], ARGV[1]) end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
keep(KEYS[1], math.ceil(tonumber(ARGV[2])) + 1)
return 1
"""
)

# KEYS: one zset per session (its IP's); ARGV (session id, seconds) per key in KEYS' order (a slot
# another node's ZREM took by mistake — the session moved here meanwhile — comes back with it)
RENEW = (
    KEEP_KEY
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i, key in ipairs(KEYS) do
  local hold = tonumber(ARGV[2 * i])
  redis.call('ZADD', key, now + hold, ARGV[2 * i - 1])
  keep(key, math.ceil(hold) + 1)
end
return #KEYS
"""
)

# KEYS[1] the IP's failed-login counter; ARGV limit, window ms, '1' to count a failure first → ms until
# the window ends when the IP is at the limit, else 0 (the window starts at its first failure)
LOGIN_FAILURES = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[3] == '1' then
  n = redis.call('INCR', KEYS[1])
  if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
end
if n < tonumber(ARGV[1]) then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  ttl = tonumber(ARGV[2])
end
return ttl
"""


class ClusterLimits:
    def __init__(
        self, cluster: Cluster, rate: float, burst: int, max_sessions_per_ip: int, hold_s: float = 0.0
    ):
        self.cluster = cluster
        self.rate, self.burst = rate, burst
        self.max_sessions_per_ip = max_sessions_per_ip
        self.lease_s = cluster.heartbeat_s * 3 + 1
        self.hold_s = max(self.lease_s, hold_s)  # a session with a record: as long as the record
        r = cluster.redis
        self._bucket = r.register_script(TOKEN_BUCKET)
        self._slot = r.register_script(SESSION_SLOT)
        self._hold = r.register_script(HOLD)
        self._renew = r.register_script(RENEW)
        self._login_failures = r.register_script(LOGIN_FAILURES)

    def _ip_key(self, ip: str) -> str:
        return self.cluster.key("ipsessions", ip)

    async def take(self, ip: str) -> float:
        """The IP's bucket, cluster-wide: 0.0 when allowed, else seconds to wait."""
        wait: Any = await self.cluster.call(
            lambda: self._bucket(keys=[self.cluster.key("ipbucket", ip)], args=[self.rate, self.burst])
        )
        return float(wait)

    async def claim_session(
        self, ip: str, session_id: str, capped: bool = True, stored: bool = False
    ) -> float:
        """A slot among the sessions this IP holds: 0.0 when taken, else the seconds until the first
        held one stops counting. `capped=False`: a session already held (its record exists) always
        gets its slot back; `stored`: it has a record, and counts as long."""
        cap = self.max_sessions_per_ip if capped else 0
        hold = self.hold_s if stored else self.lease_s
        wait: Any = await self.cluster.call(
            lambda: self._slot(keys=[self._ip_key(ip)], args=[session_id, cap, hold])
        )
        return float(wait)

    async def release_session(self, ip: str, session_id: str, stored: bool = False) -> None:
        """The session's connection has gone: a session with a record stays held until it expires,
        an empty one leaves the IP's count."""
        args = [session_id, self.hold_s if stored else 0]
        await self.cluster.call(lambda: self._hold(keys=[self._ip_key(ip)], args=args))

    async def renew(self, connected: list[tuple[str, str, bool]]) -> None:
        """(ip, session id, has a record) of every session connected here: their slots renewed."""
        if not connected:
            return
        keys = [self._ip_key(ip) for ip, _, _ in connected]
        args: list[Any] = []
        for _, sid, stored in connected:
            args += [sid, self.hold_s if stored else self.lease_s]
        await self.cluster.call(lambda: self._renew(keys=keys, args=args))

    async def login_failures(self, ip: str, limit: int, window_s: float, failed: bool) -> float:
        """Failed console logins of an IP, cluster-wide (`failed` counts one more first): the seconds
        until its window ends when it is at `limit`, else 0.0."""
        args = [limit, int(window_s * 1000), "1" if failed else "0"]
        ms: Any = await self.cluster.call(
            lambda: self._login_failures(keys=[self.cluster.key("consolefail", ip)], args=args)
        )
        return int(ms) / 1000
