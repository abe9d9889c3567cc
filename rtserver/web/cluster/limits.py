"""Cluster-wide per-IP limits: the client IP's token bucket and `security.max_sessions_per_ip`, each one
Lua script run atomically in Redis (redis-py `register_script`: EVALSHA, loaded again by itself after a
Redis restart). Time is Redis's own `TIME`, so nodes with skewed clocks share one bucket correctly.
Per-connection buckets stay local (rtserver/web/ratelimit.py): a connection lives on one node. Failed
console logins per IP are a counter per one-minute window (`security.console_login_failures_per_min`).

Sessions per IP: a sorted set per IP of its connected sessions, scored by a lease deadline the holding
node renews with its heartbeat; a session leaves it on disconnect, or when its node dies and the lease
runs out. A detached session does not count: in one process the cap also only refuses when every
session of the IP is connected (detached ones make room).
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

# KEYS[1] the IP's session zset; ARGV session id, cap, lease seconds → 1 admitted, 0 at the cap
SESSION_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cap = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and cap > 0 and redis.call('ZCARD', KEYS[1]) >= cap then
  return 0
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 1)
return 1
"""

# KEYS: one zset per session (its IP's); ARGV lease seconds, then the session ids in KEYS' order (a
# slot another node's ZREM took by mistake — the session moved here meanwhile — comes back with it)
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + lease, ARGV[i + 1])
  redis.call('EXPIRE', key, math.ceil(lease) + 1)
end
return #KEYS
"""

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
    def __init__(self, cluster: Cluster, rate: float, burst: int, max_sessions_per_ip: int):
        self.cluster = cluster
        self.rate, self.burst = rate, burst
        self.max_sessions_per_ip = max_sessions_per_ip
        self.lease_s = cluster.heartbeat_s * 3 + 1
        r = cluster.redis
        self._bucket = r.register_script(TOKEN_BUCKET)
        self._slot = r.register_script(SESSION_SLOT)
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

    async def claim_session(self, ip: str, session_id: str) -> bool:
        """A connected-session slot for this IP (True), or False when the IP is at its cap."""
        ok: Any = await self.cluster.call(
            lambda: self._slot(
                keys=[self._ip_key(ip)], args=[session_id, self.max_sessions_per_ip, self.lease_s]
            )
        )
        return bool(int(ok))

    async def release_session(self, ip: str, session_id: str) -> None:
        await self.cluster.call(lambda: self.cluster.redis.zrem(self._ip_key(ip), session_id))

    async def renew(self, connected: list[tuple[str, str]]) -> None:
        """(ip, session id) of every session connected here: their leases renewed."""
        if not connected:
            return
        keys = [self._ip_key(ip) for ip, _ in connected]
        args: list[Any] = [self.lease_s, *(sid for _, sid in connected)]
        await self.cluster.call(lambda: self._renew(keys=keys, args=args))

    async def login_failures(self, ip: str, limit: int, window_s: float, failed: bool) -> float:
        """Failed console logins of an IP, cluster-wide (`failed` counts one more first): the seconds
        until its window ends when it is at `limit`, else 0.0."""
        args = [limit, int(window_s * 1000), "1" if failed else "0"]
        ms: Any = await self.cluster.call(
            lambda: self._login_failures(keys=[self.cluster.key("consolefail", ip)], args=args)
        )
        return int(ms) / 1000
