"""Test helpers: a real uvicorn server on 127.0.0.1 with an ephemeral port, and a scripted engine.

`serve()` is the one way tests run an in-process server: async tests use it directly; synchronous tests
(hypothesis) use `ServerThread`, which runs the same `serve()` in a background thread's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import Any

import httpx
import uvicorn

from rtserver.config import Settings
from rtserver.engine.backend import BackendStats, FinishReason, TokenEvent
from rtserver.engine.core import GenerationStream
from rtserver.engine.kv import KVStats
from rtserver.engine.sequence import Sequence
from rtserver.web.app import create_app, uvicorn_options

TIMEOUT = float(
    __import__("os").environ.get("RT_TEST_TIMEOUT", "120")
)  # generous: the machine is shared; tests never depend on speed


def make_settings(**sections: dict) -> Settings:
    s = Settings()
    s.engine.kv_budget_mb = 64
    s.engine.max_sequence_tokens = 2048
    s.tasks.plugin_dirs = ["plugins"]
    # The test servers score labels whatever fits this machine's dtype has: the same answers everywhere
    # (tests/tasks/test_head.py covers the heads, tests/web/test_readiness.py a start with them on)
    s.tasks.learned_heads = False
    # every test connection comes from 127.0.0.1 and many send fast: the limits are off unless a test
    # is about them (tests/web/test_hub.py)
    s.security.rate_limit_per_s = s.security.ip_rate_limit_per_s = 0.0
    s.security.max_sessions_per_ip = s.security.ip_tokens_in_flight = 0
    s.security.ip_tokens_per_s, s.security.api_kv_share = 0.0, 1.0
    s.security.ip_kv_share = 0.0
    # the small KV holds a few requests at once: the rest of a test's crowd waits its turn at the API
    # door as long as a slow machine needs (the queue's own bounds: tests/web/test_api_queue.py)
    s.security.api_queue_s = 600.0
    s.server.max_connections_per_ip = 0
    s.security.api_enabled = True  # off by default; the tests drive it from 127.0.0.1
    # the plain chat: knowledge (on by default, over docs/) changes every reply; its own tests turn it on
    s.knowledge.enabled = False
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(s, section), key, value)
    return s


@contextlib.asynccontextmanager
async def serve(app, settings: Settings, wait_ready: bool = True):
    """Run `app` under uvicorn in this event loop; yields (base http url, ws url)."""
    opts = uvicorn_options(settings)
    opts.update(host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(uvicorn.Config(app, **opts))
    server.install_signal_handlers = lambda: None  # older uvicorn
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server exited during start-up")
        assert time.monotonic() < deadline, "server did not start"
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    try:
        if wait_ready:
            await wait_until_ready(base)
        yield base, f"ws://127.0.0.1:{port}/ws"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, TIMEOUT)


class ServerThread:
    """`serve(app, settings)` in a background thread's own event loop, for synchronous tests. `start()`
    returns once the server is ready (`base`, `url` set), `stop()` ends it; also a context manager.
    An exception in the server's thread is raised again by `start()` / `stop()`."""

    def __init__(self, app: Any, settings: Settings, *, wait_ready: bool = True, name: str = "test-server"):
        self.app, self.settings, self.wait_ready = app, settings, wait_ready
        self.loop = asyncio.new_event_loop()
        self.base = self.url = ""
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # reported by start() / stop()
            self.error = exc
        finally:
            self._started.set()
            self.loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with serve(self.app, self.settings, wait_ready=self.wait_ready) as (base, url):
            self.base, self.url = base, url
            self._started.set()
            await self._stop.wait()

    def start(self, timeout: float = TIMEOUT) -> ServerThread:
        self._thread.start()
        assert self._started.wait(timeout), "server did not start"
        if self.error is not None:
            raise self.error
        assert self.base, "server thread ended during start-up"
        return self

    def stop(self, timeout: float = TIMEOUT) -> None:
        if self._thread.is_alive():
            assert self._stop is not None
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)
            assert not self._thread.is_alive(), "server did not stop"
        if self.error is not None:
            raise self.error

    @property
    def state(self) -> Any:
        return self.app.state.rt

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


async def wait_until_ready(base: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    async with httpx.AsyncClient() as client:
        while True:
            r = await client.get(base + "/health")
            body = r.json()
            if body["status"] == "ready":
                return
            assert body["status"] != "failed", body
            assert time.monotonic() < deadline, "model did not become ready"
            await asyncio.sleep(0.05)


async def metric(base: str, name: str, labels: str = "") -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(base + "/metrics")).text
    key = name + (("{" + labels + "}") if labels else "")
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise KeyError(f"{key} not in /metrics")


async def wait_for(pred, timeout: float = TIMEOUT, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)


async def recv_json(ws, timeout: float = TIMEOUT) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def recv_until(ws, pred, timeout: float = TIMEOUT) -> list[dict]:
    """Events up to and including the first one that satisfies pred."""
    events = []
    while True:
        ev = await recv_json(ws, timeout)
        events.append(ev)
        if pred(ev):
            return events


def is_end(rid: str):
    """Predicate for recv_until: the event that ends request `rid` (its `done`, `result`, `error`, or
    `forwarded` when an agent holds the session); auto-task events for the same id do not count."""
    return lambda e: (
        e.get("id") == rid and e["type"] in ("done", "error", "result", "forwarded") and not e.get("auto")
    )


async def hello(ws, **fields) -> dict:
    await ws.send(json.dumps({"type": "hello", **fields}))
    return await recv_json(ws)


# -- a scripted engine: the engine's own output side, no model -------------------------------------


class ScriptedEngine:
    """Emits a fixed token script (through a real Sequence and the engine's GenerationStream, so deltas
    are UTF-8 safe and stop strings end the output exactly as in the engine), or `chunks` of raw text
    as fast as possible. `gate` (an asyncio.Event) holds generation
    until set. Records cancels and dropped sessions."""

    def __init__(
        self,
        loaded: Any,
        script: list[int] | None = None,
        chunks: list[str] | None = None,
        delay: float = 0.0,
    ):
        self.tokenizer = loaded.tokenizer
        self.script = script or [self.tokenizer.encode("Hello", add_special_tokens=False)[0]]
        self.chunks = chunks
        self.delay = delay
        self.gate: asyncio.Event | None = None
        self.scheduler = self
        self.cancelled: list[Sequence] = []
        self.dropped: list[Any] = []
        self.prompts: list[list[int]] = []
        self.generated = 0
        self.scored = 0
        self.tasks: set = set()

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self.cancelled.append(seq)

    async def prepare_output(self, fmt, *, pin: bool = False) -> None:
        """Checks the format as the engine would; the script is what it generates all the same."""
        fmt.check()

    def generate(
        self,
        prompt_ids,
        params,
        *,
        session_key=None,
        public_tokens=0,
        prefix_scope=None,
        fork_session=None,
        inserted=None,
    ) -> GenerationStream:
        params.validate()
        self.prompts.append(list(prompt_ids))
        seq = Sequence(prompt_ids, params, eos_token_ids=set(), session_key=session_key)
        stream = GenerationStream(self, seq)
        task = asyncio.get_running_loop().create_task(self._run(seq, stream))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return stream

    async def _run(self, seq: Sequence, stream: GenerationStream) -> None:
        if self.gate is not None:
            await self.gate.wait()
        seq.admitted_at = time.perf_counter()
        if self.chunks is not None:
            for i, text in enumerate(self.chunks):
                if seq.cancelled:
                    break
                stream.detokenizer.text += text
                seq.output_ids.append(0)
                seq.usage.generated_tokens += 1
                seq.first_token_at = seq.first_token_at or time.perf_counter()
                stream._queue.put_nowait(TokenEvent(0, text))
                self.generated += 1
                if i % 16 == 0:
                    await asyncio.sleep(self.delay)
            seq.finish_reason = FinishReason.CANCELLED if seq.cancelled else FinishReason.LENGTH
        else:
            for i, tok in enumerate(self.script):
                await asyncio.sleep(self.delay)
                if seq.cancelled:
                    seq.finish_reason = FinishReason.CANCELLED
                    break
                seq.append_token(tok)
                last = seq.finish_reason is not None or i == len(self.script) - 1
                self.generated += 1
                stream.token(tok, last)
                if seq.finish_reason is not None:
                    break
            else:
                seq.finish_reason = FinishReason.LENGTH
        seq.finished_at = time.perf_counter()
        stream.end(seq.result())

    async def score(self, prompt_ids, candidates, *, normalize: bool = True, public_tokens=0) -> list[float]:
        await asyncio.sleep(0)
        self.scored += 1
        return [-float(i) for i in range(len(candidates))]

    def drop_session(self, key) -> None:
        self.dropped.append(key)

    def health(self) -> dict:
        return {"kind": "scripted", "state": "up"}

    available = True

    def stats(self) -> BackendStats:
        kv = KVStats(
            budget_bytes=1,
            used_bytes=0,
            block_bytes=0,
            free_blocks=0,
            total_blocks=0,
            cached_sessions=0,
            cached_prefix_blocks=0,
            evictions=0,
            rebuilds=0,
            prefix_hits=0,
            session_hits=0,
            fork_hits=0,
        )
        return {
            "running": 0,
            "waiting": 0,
            "steps": 0,
            "tokens_generated": self.generated,
            "tokens_prefilled": 0,
            "kv": kv,
        }


def scripted_app(loaded: Any, settings: Settings, engine: ScriptedEngine):
    return create_app(settings, lambda: loaded, engine_factory=lambda loaded_, s: engine)
