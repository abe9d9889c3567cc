"""`ServerCheck`: what each server serves and whether it tokenizes as we do, at start and by the
health check, which brings a URL that failed back into the pool.

The kind of server is learned from `/v1/models` (`owned_by`); it decides how labels are scored
(scoring.py) and what the server's prefix cache may share (reuse.py).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from ..engine.backend import Tokenizer
from .client import Upstreams
from .pool import Upstream
from .reuse import reuse_for
from .wire import BackendMismatch, Json, UpstreamError, describe

log = logging.getLogger("rtserver.remote")

PROBE_TEXT = "Hello, world! How are you today? 你好，世界。 1234 🙂"
SERVER_KINDS = {"rtserver": "rtserver", "llamacpp": "llama.cpp", "vllm": "vllm"}  # /v1/models owned_by


class ServerCheck:
    """Probes the servers of `ups` at start and then every `health_interval_s`."""

    def __init__(self, ups: Upstreams, tokenizer: Tokenizer):
        self.ups = ups
        self.tokenizer = tokenizer

    async def check(self) -> None:
        """At start: every reachable URL is asked what it serves and whether it tokenizes as we do;
        a different tokenizer raises BackendMismatch naming both. An unreachable URL is marked down
        (the health check brings it back), not fatal."""
        pool = self.ups.pool
        for up in pool.upstreams:
            try:
                await self.probe(up)
                pool.succeeded(up)
            except BackendMismatch:
                raise
            except Exception as exc:
                pool.mark_down(up, describe(exc))  # down at start: the health check brings it back
                log.warning("inference server %s is not available: %s", up.url, describe(exc))

    async def probe(self, up: Upstream) -> None:
        """Learn the server's kind and model; BackendMismatch when its tokenizer differs from ours."""
        ups = self.ups
        async with ups.http.get(up.url + "/v1/models", timeout=ups.timeout(ups.settings.timeout_s)) as r:
            r.raise_for_status()
            listing = await r.json(content_type=None)
        models = (listing.get("data") if isinstance(listing, dict) else None) or []
        owned = str(models[0].get("owned_by", "")) if models else ""
        served = [str(m.get("id")) for m in models]
        kind = SERVER_KINDS.get(owned, "openai")
        want = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        got = await self._remote_tokens(up, kind)
        if got is not None and got != want:
            raise BackendMismatch(
                f"{up.url} serves {', '.join(served) or 'an unnamed model'} whose tokenizer differs from the "
                f"local one (model.model): {PROBE_TEXT!r} is {got[:12]}... there and {want[:12]}... here"
            )
        ups.kinds[up.url] = kind
        ups.reuse[up.url] = reuse_for(kind, await self._total_slots(up) if kind == "llama.cpp" else None)
        up.checked = True  # the health check probes a URL until it is checked
        if not ups.model:
            ups.model = served[0] if served else ""
        log.info(
            "inference server %s: %s (%s), tokenizer %s",
            up.url,
            ", ".join(served),
            kind,
            "matches" if got is not None else "not checked (no /tokenize)",
        )

    async def _total_slots(self, up: Upstream) -> int | None:
        """llama-server's slot count (`-np`), from /props."""
        ups = self.ups
        try:
            async with ups.http.get(up.url + "/props", timeout=ups.timeout(ups.settings.timeout_s)) as r:
                props = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        slots = props.get("total_slots") if isinstance(props, dict) else None
        return slots if isinstance(slots, int) and 0 < slots <= 4096 else None

    async def _remote_tokens(self, up: Upstream, kind: str) -> list[int] | None:
        ups = self.ups
        if kind == "vllm":
            body: Json = {"prompt": PROBE_TEXT, "add_special_tokens": False}
            if ups.model:
                body["model"] = ups.model
        else:
            body = {"content": PROBE_TEXT, "add_special": False}
        async with ups.http.post(
            up.url + "/tokenize", json=body, timeout=ups.timeout(ups.settings.timeout_s)
        ) as r:
            if r.status == 404:
                return None
            r.raise_for_status()
            answer = await r.json(content_type=None)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ups.settings.health_interval_s)
            for up in self.ups.pool.upstreams:
                if self.ups.pool.waited(up):  # else its breaker opened less than retry_after_s ago
                    await self._health(up)

    async def _health(self, up: Upstream) -> None:
        ups, pool = self.ups, self.ups.pool
        opened_at = up.opened_at
        try:
            async with ups.http.get(
                up.url + "/health", timeout=ups.timeout(min(5.0, ups.settings.timeout_s))
            ) as r:
                if r.status >= 400:
                    raise UpstreamError(f"/health answered {r.status}", True)
            if not up.checked:
                await self.probe(up)
            pool.probe_answered(up, opened_at)
        except BackendMismatch as exc:
            pool.failed(up, str(exc))
            log.error("%s", exc)
        except Exception as exc:
            if pool.state(up) == "up":
                log.warning("inference server %s failed its health check: %s", up.url, describe(exc))
            pool.failed(up, describe(exc))
