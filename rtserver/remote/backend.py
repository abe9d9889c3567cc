"""`RemoteBackend`: the `InferenceBackend` seam over OpenAI-compatible inference servers (llama.cpp's
llama-server, vLLM, other rtserver nodes), spread over `[backend] urls` by `UpstreamPool`.

The hub renders prompts exactly as with the local engine and sends them as token ids to
`/v1/completions`; a session sticks to one URL. This module puts the parts together, each with one
job: the servers and the path of a request (client.py, on the wire: wire.py), the start-up and
health checks (servers.py), the streamed generation (generation.py), label scoring with one class
per kind of server (scoring.py), the next-turn prefetch (prefetch.py). What each server's prefix
cache may share across sessions is reuse.py's: every request carries the fields of its lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from typing import TypedDict

import aiohttp

from ..config import BackendSettings
from ..engine.backend import (
    BackendHealth,
    BackendStats,
    Inserted,
    OutputFormatError,
    SamplingError,
    SamplingParams,
    ServerHealth,
    Tokenizer,
    UpstreamStats,
)
from .client import Upstreams
from .generation import RemoteGeneration
from .pool import BackendUnavailable
from .prefetch import PREFETCH_DELAY_S, Prefetcher, Prefix, _Prefetch
from .reuse import NodeReuse
from .scoring import LabelScoring
from .servers import ServerCheck
from .wire import BackendMismatch, UpstreamError

log = logging.getLogger("rtserver.remote")

DROP_BATCH_S = 0.5  # sessions that end together are told to a node in one request
DROPS_PER_REQUEST = 256  # as many keys as a node's /v1/sessions/drop takes

__all__ = [
    "PREFETCH_DELAY_S",
    "BackendMismatch",
    "RemoteBackend",
    "RemoteGeneration",
    "RemoteStats",
    "UpstreamError",
]


class SendGroups(TypedDict):
    """The send gate's requests and the groups they left in."""

    requests: int
    groups: int


class RemoteStats(BackendStats):
    """A remote backend's counters: the common ones, each server's, the send gate's and the
    next-turn prefetches' by outcome (with those in flight)."""

    upstreams: list[UpstreamStats]
    send_groups: SendGroups
    prefetch: dict[str, int]


class RemoteBackend:
    """The inference seam over one or more OpenAI-compatible servers (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, settings: BackendSettings):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.settings = settings
        self.upstreams = Upstreams(settings)
        ups = self.upstreams
        self.pool, self.gate, self.kinds, self.reuse = ups.pool, ups.gate, ups.kinds, ups.reuse
        self.servers = ServerCheck(ups, tokenizer)
        self.scoring = LabelScoring(ups)
        self.prefetcher = Prefetcher(ups)
        self._health: asyncio.Task[None] | None = None
        self._drops: asyncio.Task[None] | None = None  # telling rtserver nodes which sessions ended
        self.tokens_generated = 0

    @property
    def model(self) -> str:
        return self.upstreams.model  # empty until the check: what the first server lists

    @property
    def prefetch_counts(self) -> dict[str, int]:
        return self.prefetcher.counts

    @property
    def _prefetches(self) -> dict[Hashable, _Prefetch]:
        return self.prefetcher.entries

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self.upstreams.http  # noqa: B018 (the client is made now, in the running loop)
        if self._health is None:
            self._health = asyncio.get_running_loop().create_task(self.servers.health_loop())

    async def stop(self) -> None:
        self.prefetcher.stop()
        self.scoring.stop()
        if self._drops is not None:
            self._drops.cancel()
            await asyncio.gather(self._drops, return_exceptions=True)
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
            self._health = None
        await self.upstreams.close()

    async def check(self) -> None:
        """At start: what each server serves, and that it tokenizes as we do (servers.py)."""
        await self.servers.check()

    # -- the seam ----------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_key: Hashable | None = None,
        public_tokens: int = 0,
        prefix_scope: int | None = None,  # the servers' own caches decide what they share
        fork_session: Hashable | None = None,  # likewise
        inserted: Inserted | None = None,  # likewise
    ) -> RemoteGeneration:
        params.validate(len(self.tokenizer))
        if not params.output.free:
            raise OutputFormatError(
                "structured output (an output format) needs the local engine; this server's model runs "
                "on remote servers"
            )
        if not prompt_ids:
            raise SamplingError("empty prompt")
        _check_public(public_tokens, prompt_ids)
        if not any(self.pool.usable(u) for u in self.pool.upstreams):
            raise BackendUnavailable(
                "no inference server is available: "
                + ", ".join(f"{s['url']} {s['state']}" for s in self.pool.snapshot())
            )
        self.gate.arrived()
        return RemoteGeneration(
            self.upstreams,
            self.tokenizer,
            list(prompt_ids),
            params,
            session_key,
            public_tokens,
            settle=self.prefetcher.settle,
            counted=self._counted,
        )

    def _counted(self, tokens: int) -> None:
        self.tokens_generated += tokens

    async def score(
        self,
        prompt_ids: list[int],
        candidates: list[list[int]],
        *,
        normalize: bool = True,
        public_tokens: int = 0,
    ) -> list[float]:
        if not candidates or any(not c for c in candidates):
            raise ValueError("candidates must be non-empty token lists")
        _check_public(public_tokens, prompt_ids)
        self.gate.arrived()
        # scores are log-probabilities: normalized whatever `normalize` says
        return await self.scoring.score(prompt_ids, candidates, public_tokens)

    def prefetch(self, prefix: Prefix, *, session_key: Hashable) -> None:
        # whether to prefetch at all (`backend.prefetch_next_turn`) is the hub's call
        self.prefetcher.prefetch(prefix, session_key)

    def cancel_prefetch(self, session_key: Hashable) -> None:
        self.prefetcher.cancel(session_key)

    def drop_session(self, session_key: Hashable) -> None:
        """Cancel the session's prefetch; its slots may go to new sessions first; rtserver nodes are
        told to free the KV they keep for it (in the background, batched). vLLM's and other caches
        evict by themselves; affinity is a pure function of the key."""
        self.cancel_prefetch(session_key)
        for reuse in self.reuse.values():
            reuse.forget(session_key)
        if any(isinstance(r, NodeReuse) and r.forgotten for r in self.reuse.values()):
            if self._drops is None or self._drops.done():
                try:
                    self._drops = asyncio.get_running_loop().create_task(self._send_drops())
                except RuntimeError:  # no loop (stopping): the node's LRU frees them
                    pass

    async def _send_drops(self) -> None:
        """Each rtserver node's ended sessions, in requests of at most DROPS_PER_REQUEST keys; best
        effort: a node that does not answer frees them by its own LRU."""
        await asyncio.sleep(DROP_BATCH_S)
        for url, reuse in list(self.reuse.items()):
            if not isinstance(reuse, NodeReuse):
                continue
            while keys := reuse.take_forgotten(DROPS_PER_REQUEST):
                try:
                    async with self.upstreams.http.post(
                        url + "/v1/sessions/drop",
                        json={"rtserver_sessions": keys},
                        timeout=self.upstreams.timeout(self.settings.timeout_s),
                    ) as resp:
                        if resp.status != 200:
                            log.debug("%s did not free %d sessions: HTTP %d", url, len(keys), resp.status)
                            break
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.debug("%s did not free %d sessions: %s", url, len(keys), exc)
                    break

    def stats(self) -> RemoteStats:
        snapshot = self.pool.snapshot()
        return {
            "running": sum(s["in_flight"] for s in snapshot),
            "waiting": 0,
            "steps": 0,
            "tokens_generated": self.tokens_generated,
            "tokens_prefilled": 0,
            "kv": None,
            "upstreams": snapshot,
            "send_groups": {"requests": self.gate.requests, "groups": self.gate.groups},
            "prefetch": {**self.prefetch_counts, "in_flight": len(self._prefetches)},
        }

    def health(self) -> BackendHealth:
        servers: list[ServerHealth] = [{**s, "kind": self.kinds.get(s["url"])} for s in self.pool.snapshot()]
        return {"kind": "openai", "model": self.model, "servers": servers}

    @property
    def available(self) -> bool:
        return any(self.pool.state(u) == "up" for u in self.pool.upstreams)


def _check_public(public_tokens: int, prompt_ids: list[int]) -> None:
    if isinstance(public_tokens, bool) or not isinstance(public_tokens, int):
        raise ValueError(f"public_tokens = {public_tokens!r}: an integer")
    if not 0 <= public_tokens <= len(prompt_ids):
        raise ValueError(f"public_tokens = {public_tokens}: the prompt has {len(prompt_ids)} tokens")
