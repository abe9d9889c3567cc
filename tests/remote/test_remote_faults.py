"""rtserver with `model.backend = "openai"` against fake upstream inference servers that misbehave.

Each fake is a small Starlette app under uvicorn on 127.0.0.1 that looks like llama-server: /v1/models,
/tokenize (the local tokenizer's ids, or deliberately different ones), /health and a streamed
/v1/completions whose behaviour (a script of SSE chunks, a status code, a stall, an abrupt close) each
test chooses, and which records what it was sent and whether the hub closed its connection.

Each test checks what the client sees and that the hub stays healthy afterwards: the same session
chats again. Every wait is bounded (`STEP`); the backend's own timeouts are small (`TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtserver.engine.backend import FinishReason, SamplingParams
from rtserver.remote.backend import RemoteBackend
from rtserver.tasks.chat import ChatTask
from rtserver.web.app import create_app

from ..fakeclock import FakeClock
from ..serverutil import (
    ScriptedEngine,
    hello,
    is_end,
    make_settings,
    metric,
    recv_json,
    recv_until,
    serve,
    wait_for,
)

pytestmark = pytest.mark.asyncio

STEP = 15.0  # the most any one wait in these tests may take (the machine may be busy)
TIMEOUT_S = 1.5  # backend.timeout_s
SLACK_S = 3.0  # how much later than timeout_s a stalled request may end

ABORT = object()  # in a script: stop mid-response; uvicorn then closes the connection (body incomplete)

Script = Callable[[dict], AsyncIterator[Any]]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def token_chunk(text: str, ids: list[int], finish: str | None = None, usage: dict | None = None) -> bytes:
    """One llama-server streamed completion chunk."""
    chunk: dict[str, Any] = {
        "choices": [
            {
                "text": text,
                "index": 0,
                "logprobs": {"content": [{"id": i, "logprob": -0.1} for i in ids]},
                "finish_reason": finish,
            }
        ],
        "object": "text_completion",
        "model": "fake",
    }
    if usage is not None:
        chunk["usage"] = usage
    return sse(chunk)


DONE = b"data: [DONE]\n\n"


def bound_socket() -> socket.socket:
    """A socket bound to a free port on 127.0.0.1, not listening: connecting to it is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class _ScriptedStream(Response):
    """The body of a streamed completion, sent item by item from a script, while watching for the
    client's disconnect (recorded on the fake)."""

    def __init__(self, fake: FakeUpstream, items: AsyncIterator[Any]):
        self.fake, self.items = fake, items

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        fake = self.fake
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        finished = False

        async def pump() -> None:
            nonlocal finished
            async for item in self.items:
                await asyncio.sleep(0)  # let a disconnect be seen (a send to a closed peer returns at once)
                if item is ABORT or watching.done():
                    return
                fake.sent_bytes += len(item)
                await send({"type": "http.response.body", "body": item, "more_body": True})
            finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pumping = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pumping, watching):
                task.cancel()
            await asyncio.gather(pumping, watching, return_exceptions=True)
        if watching.done() and not watching.cancelled() and not finished:
            fake.closes += 1
            fake.closed.set()


class FakeUpstream:
    """A llama-server look-alike. `script(body)` yields the SSE bytes of a streamed completion (or
    ABORT); `status` other than 200 answers every completion with that status instead."""

    def __init__(self, tokenizer: Any, *, tokenize_offset: int = 0, owned_by: str = "llamacpp"):
        self.tokenizer = tokenizer
        self.owned_by = owned_by  # what /v1/models says: the hub learns the server's kind from it
        self.tokenize_offset = tokenize_offset  # != 0: /tokenize disagrees with the local tokenizer
        self.script: Script = self.reply("Hello there!")
        self.status = 200
        self.bodies: list[dict] = []  # each streamed /v1/completions request (a generation)
        self.scores: list[dict] = []  # each other one asking for log-probabilities (a label score)
        self.prefetches: list[dict] = []  # each other one (a next-turn prefetch)
        self.cuts: list[dict] = []  # a label score's prompt cut back to its public prefix
        self.connection: dict[bool, list[str | None]] = {True: [], False: []}  # by stream: Connection
        self.health_checks = 0  # GET /health requests answered
        self.health_held = 0  # GET /health requests waiting for `health_gate`
        self.health_gate: asyncio.Event | None = None  # set: /health answers only once it is set
        self.prefetch_answer = "ok"  # or "500", "garbage" (200, not JSON), "stall" (no answer for 60 s)
        self.closed = asyncio.Event()  # the hub closed a completion's connection before its end
        self.closes = 0
        self.sent_bytes = 0
        self.url = ""
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/health", self.health),
                Route("/props", self.props),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )

    # -- endpoints ------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": self.owned_by}]}
        )

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        text, special = (
            (body["prompt"], "add_special_tokens") if "prompt" in body else (body["content"], "add_special")
        )
        ids = self.tokenizer.encode(text, add_special_tokens=bool(body.get(special)))
        if self.tokenize_offset:
            ids = [(i + self.tokenize_offset) % len(self.tokenizer) for i in ids]
        return JSONResponse({"tokens": ids})

    async def health(self, request: Request) -> Response:
        if self.health_gate is not None:
            self.health_held += 1
            await self.health_gate.wait()
        self.health_checks += 1
        return JSONResponse({"status": "ok"})

    async def props(self, request: Request) -> Response:
        return JSONResponse({"total_slots": 32})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.connection[bool(body.get("stream"))].append(request.headers.get("connection"))
        if not body.get("stream") and "logprobs" not in body:
            if any(s["prompt"][: len(body["prompt"])] == body["prompt"] for s in self.scores):
                self.cuts.append(body)
                return JSONResponse({"choices": [{"text": "x", "index": 0, "finish_reason": "length"}]})
            self.prefetches.append(body)
            if self.prefetch_answer == "500":
                return JSONResponse({"error": {"code": 500, "message": "fake failure"}}, status_code=500)
            if self.prefetch_answer == "garbage":
                return Response(b"<html>502 Bad Gateway</html>", media_type="text/html")
            if self.prefetch_answer == "stall":
                await asyncio.sleep(60)
            return JSONResponse({"choices": [{"text": "x", "index": 0, "finish_reason": "length"}]})
        if not body.get("stream"):
            # a label score (the hub calibrates its tasks at start-up): token 0 is the top one, every
            # forced token gets the same log-probability
            self.scores.append(body)
            entry = {"id": 0, "logprob": -1.0, "top_logprobs": [{"id": 0, "logprob": -1.0}]}
            return JSONResponse(
                {"choices": [{"text": "", "logprobs": {"content": [entry] * body["max_tokens"]}}]}
            )
        self.bodies.append(body)
        if self.status != 200:
            error = {"code": self.status, "message": "fake failure", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=self.status)
        return _ScriptedStream(self, self.script(body))

    # -- scripts --------------------------------------------------------------------------------------
    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def reply(self, text: str, cached: int = 0, delay: float = 0.0) -> Script:
        """A normal reply: one chunk per token, a final chunk with the usage, [DONE]."""

        async def script(body: dict) -> AsyncIterator[Any]:
            ids = self.ids(text)
            for i in ids:
                if delay:
                    await asyncio.sleep(delay)
                yield token_chunk(self.tokenizer.decode([i]), [i])
            usage = {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": len(ids),
                "total_tokens": len(body["prompt"]) + len(ids),
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            yield token_chunk("", [], finish="stop", usage=usage)
            yield DONE

        return script

    def then(self, first: str, *rest: Any) -> Script:
        """One token chunk of `first`, then `rest`: bytes, seconds to sleep, or ABORT."""

        async def script(body: dict) -> AsyncIterator[Any]:
            yield token_chunk(first, self.ids(first))
            for item in rest:
                if isinstance(item, (int, float)):
                    await asyncio.sleep(item)
                else:
                    yield item

        return script

    # -- serving --------------------------------------------------------------------------------------
    async def start(self, sock: socket.socket | None = None) -> FakeUpstream:
        sock = sock or bound_socket()
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", http="h11", ws="none", lifespan="off", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]))
        deadline = time.monotonic() + STEP
        while not self.server.started:
            assert not self._task.done(), "fake upstream exited during start-up"
            assert time.monotonic() < deadline, "fake upstream did not start"
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        if self.server is not None and self._task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(self._task, STEP)
            self.server = self._task = None


@contextlib.asynccontextmanager
async def fakes(smol, n: int = 1, **kw: Any) -> AsyncIterator[list[FakeUpstream]]:
    started = [await FakeUpstream(smol.tokenizer, **kw).start() for _ in range(n)]
    try:
        yield started
    finally:
        for fake in started:
            await fake.stop()


def remote_settings(urls: list[str], **backend: Any):
    return make_settings(
        model={"backend": "openai"},
        backend={
            "urls": urls,
            "timeout_s": TIMEOUT_S,
            "health_interval_s": 0.2,
            "retry_after_s": 0.5,
            "failures_to_open": 3,
            **backend,
        },
        tasks={"auto_tasks": []},
    )


@contextlib.asynccontextmanager
async def hub(smol, urls: list[str], wait_ready: bool = True, **backend: Any):
    """rtserver in-process on the remote backend; yields (app, base http url, ws url)."""
    settings = remote_settings(urls, **backend)
    app = create_app(settings, lambda: smol)
    async with serve(app, settings, wait_ready=wait_ready) as (base, url):
        yield app, base, url


async def chat(ws, rid: str, text: str = "Hi there!", **options: Any) -> list[dict]:
    """Send a chat turn; its events up to its end."""
    opts = {"max_new_tokens": 8, "temperature": 0, **options}
    await ws.send(json.dumps({"type": "chat", "id": rid, "text": text, "options": opts}))
    return await recv_until(ws, is_end(rid), timeout=STEP)


async def chats_again(ws, fake: FakeUpstream, rid: str) -> dict:
    """The session is usable: a normal turn streams and ends with done."""
    fake.status, fake.script = 200, fake.reply("All good.")
    events = await chat(ws, rid)
    done = events[-1]
    assert done["type"] == "done", events
    assert done["text"] == "All good." and done["finish_reason"] == "stop"
    assert "".join(e["text"] for e in events if e["type"] == "token") == "All good."
    return done


async def get(base: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=STEP) as client:
        return await client.get(base + path)


def server_health(body: dict, url: str) -> dict:
    (server,) = [s for s in body["backends"]["openai"]["servers"] if s["url"] == url]
    return server


# -- 1. the normal case ------------------------------------------------------------------------------


def requests_so_far(app) -> dict[str, int]:
    """Requests per URL so far (the start-up calibration scores its tasks' content-free inputs)."""
    return {u.url: u.requests for u in app.state.rt.backends["openai"].pool.upstreams}


async def test_streams_tokens_usage_and_sends_the_local_prompt_ids(smol):
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):
        at_start = requests_so_far(app)
        fake.script = fake.reply("Hello there!", cached=5)
        async with websockets.connect(url) as ws:
            await hello(ws)
            events = await chat(ws, "c1", "What is 2+2?")
            done = events[-1]
            assert done["type"] == "done", events
            tokens = [e["text"] for e in events if e["type"] == "token"]
            assert len(tokens) == len(fake.ids("Hello there!")) and "".join(tokens) == "Hello there!"
            assert done["text"] == "Hello there!" and done["finish_reason"] == "stop"
            assert done["output"] == {"reply": "Hello there!"}
            usage = done["usage"]
            assert usage["cached_tokens"] == 5
            assert usage["generated_tokens"] == len(fake.ids("Hello there!"))
            assert done["timing"]["ttft_ms"] is not None

            # the prompt is the local chat template's token ids, system prompt included
            system = app.state.rt.tasks.chat.task.system_prompt
            assert system
            expected = smol.tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": "What is 2+2?"}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
            (body,) = fake.bodies
            assert body["prompt"] == expected and usage["prompt_tokens"] == len(expected)
            assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
            assert body["model"] == "fake" and body["max_tokens"] == 8 and body["temperature"] == 0

            # the next turn continues the same ids (what the server's prefix cache holds)
            fake.script = fake.reply("Four.", cached=len(expected))
            done2 = (await chat(ws, "c2", "Sure?"))[-1]
            assert done2["type"] == "done" and done2["text"] == "Four."
            assert done2["usage"]["cached_tokens"] == len(expected)
            second, reply = fake.bodies[1]["prompt"], fake.ids("Hello there!")
            assert second[: len(expected) + len(reply)] == expected + reply
            assert smol.tokenizer.decode(second).count("Sure?") == 1
        # a llama-server closes the connection after a streamed response (its headers say keep-alive):
        # the hub does not keep those connections, and keeps the others (the label scores)
        assert fake.connection[True] == ["close", "close"]
        assert fake.connection[False] and "close" not in fake.connection[False]
        health = (await get(base, "/health")).json()
        server = server_health(health, fake.url)
        # the two turns, after the start-up calibration's label scores
        assert server["state"] == "up" and server["requests"] == 2 + at_start[fake.url]
        assert server["errors"] == 0


# -- 2. garbage -------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before_first_token", "mid_reply"])
async def test_garbage_sse_is_a_typed_error_and_the_session_recovers(smol, caplog, when):
    caplog.set_level(logging.WARNING, logger="rtserver")
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):
        garbage = b"data: <html>502 Bad Gateway</html>\n\n"
        if when == "mid_reply":
            fake.script = fake.then("Hel", garbage, DONE)
        else:

            async def only_garbage(body: dict) -> AsyncIterator[Any]:
                yield garbage

            fake.script = only_garbage
        async with websockets.connect(url) as ws:
            await hello(ws)
            events = await chat(ws, "g1")
            err = events[-1]
            assert err["type"] == "error" and err["code"] == "backend_unavailable", events
            assert "not JSON" in err["message"] and fake.url not in err["message"], err
            tokens = "".join(e["text"] for e in events if e["type"] == "token")
            assert tokens == ("Hel" if when == "mid_reply" else "")
            assert any("not JSON" in r.getMessage() for r in caplog.records if r.name == "rtserver.remote")
            await chats_again(ws, fake, "g2")
        assert server_health((await get(base, "/health")).json(), fake.url)["errors"] == 1


@pytest.mark.parametrize("bad_id", [-1, 10**9, "5", 1.5])
async def test_a_token_id_outside_the_vocabulary_never_reaches_the_session(smol, bad_id):
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):
        fake.script = fake.then("Hel", token_chunk("lo", [bad_id]), DONE)
        async with websockets.connect(url) as ws:
            await hello(ws)
            events = await chat(ws, "v1")
            err = events[-1]
            assert err["type"] == "error" and err["code"] == "backend_unavailable", events
            assert "outside the vocabulary" in err["message"], err
            await chats_again(ws, fake, "v2")  # the failed turn left nothing in the history


async def test_an_open_breaker_waits_retry_after_s_even_when_health_answers(smol):
    """Completions fail while /health still answers 200: the breaker opens and stays open for
    retry_after_s (the health check does not probe before then), then a health probe closes it.
    The breaker's clock is the test's: only `advance` moves it."""
    async with (
        fakes(smol) as [fake],
        hub(smol, [fake.url], failures_to_open=1, retry_after_s=1.0, health_interval_s=0.02) as (
            app,
            base,
            url,
        ),
    ):
        clock = FakeClock()
        app.state.rt.backends["openai"].pool.clock = clock
        fake.status = 500
        async with websockets.connect(url) as ws:
            await hello(ws)
            err = (await chat(ws, "b1"))[-1]
            assert err["type"] == "error" and err["code"] == "backend_unavailable", err
            fake.status = 200
            checks = fake.health_checks
            clock.advance(0.75)
            await asyncio.sleep(0.2)  # ten health intervals: none may probe yet
            assert fake.health_checks == checks
            health = (await get(base, "/health")).json()
            assert server_health(health, fake.url)["state"] == "down", health
            clock.advance(0.25)

            async def closed() -> bool:
                return server_health((await get(base, "/health")).json(), fake.url)["state"] == "up"

            await wait_for(closed, STEP)
            assert fake.health_checks > checks  # closed by a health probe
            await chats_again(ws, fake, "b2")


async def test_a_health_probe_in_flight_when_a_request_fails_leaves_the_breaker_open(smol):
    """The probe began before the failure: its 200 is older news and closes nothing."""
    async with (
        fakes(smol) as [fake],
        hub(smol, [fake.url], failures_to_open=1, retry_after_s=60.0, health_interval_s=0.02) as (
            app,
            base,
            url,
        ),
    ):
        fake.health_gate = asyncio.Event()

        async def held() -> bool:
            return fake.health_held > 0

        await wait_for(held, STEP)
        fake.status = 500
        async with websockets.connect(url) as ws:
            await hello(ws)
            err = (await chat(ws, "h1"))[-1]
            assert err["type"] == "error" and err["code"] == "backend_unavailable", err
            fake.status = 200
            fake.health_gate.set()
            await asyncio.sleep(0.2)
            assert fake.health_checks >= 1  # the held probe answered
            health = (await get(base, "/health")).json()
            assert server_health(health, fake.url)["state"] == "down", health


# -- 3. HTTP 500 ------------------------------------------------------------------------------------


async def test_500_on_the_only_url_is_backend_unavailable_on_ws_and_503_on_http(smol):
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):
        fake.status = 500
        async with websockets.connect(url) as ws:
            await hello(ws)
            err = (await chat(ws, "e1"))[-1]
            assert err["type"] == "error" and err["code"] == "backend_unavailable", err
            assert "answered 500" in err["message"]
            async with httpx.AsyncClient(base_url=base, timeout=STEP) as client:
                r = await client.post("/chat", json={"history": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "backend_unavailable"
            assert len(fake.bodies) == 2  # no retry: there is no other URL
            # two failures in a row: the breaker (3) is still closed, and a good answer resets it
            await chats_again(ws, fake, "e2")


async def test_500_before_the_first_token_is_retried_on_the_other_url(smol):
    async with fakes(smol, 2) as pair, hub(smol, [f.url for f in pair]) as (app, base, url):
        async with websockets.connect(url) as ws:
            ready = await hello(ws)
            pool = app.state.rt.backends["openai"].pool
            home_url = pool.choose(ready["session_id"]).url
            home, other = sorted(pair, key=lambda f: f.url != home_url)
            home.status = 500
            other.script = other.reply("From the other one.")
            done = (await chat(ws, "r1"))[-1]
            assert done["type"] == "done" and done["text"] == "From the other one.", done
            assert len(home.bodies) == 1 and len(other.bodies) == 1
            assert home.bodies[0]["prompt"] == other.bodies[0]["prompt"]
            health = (await get(base, "/health")).json()
            assert server_health(health, home.url)["errors"] == 1
            assert server_health(health, other.url)["errors"] == 0
            # the session's home is still its home: back there once it answers again
            await chats_again(ws, home, "r2")
            assert len(home.bodies) == 2 and len(other.bodies) == 1


# -- 4. a stall ---------------------------------------------------------------------------------------


async def test_a_stall_past_timeout_ends_with_backend_unavailable_and_closes_upstream(smol):
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):
        fake.script = fake.then("Hel", 60.0, DONE)  # one token, then silence
        async with websockets.connect(url) as ws:
            await hello(ws)
            t0 = time.monotonic()
            events = await chat(ws, "s1")
            took = time.monotonic() - t0
            err = events[-1]
            assert err["type"] == "error" and err["code"] == "backend_unavailable", events
            assert "timed out" in err["message"]
            assert [e["text"] for e in events if e["type"] == "token"] == ["Hel"]
            assert TIMEOUT_S * 0.9 <= took <= TIMEOUT_S + SLACK_S, took
            await asyncio.wait_for(fake.closed.wait(), STEP)  # the hub hung up on the stalled stream
            await chats_again(ws, fake, "s2")


# -- 5. oversized ---------------------------------------------------------------------------------


async def test_an_oversized_sse_line_is_a_typed_error_and_reading_stops(smol):
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):

        async def endless_line(body: dict) -> AsyncIterator[Any]:
            yield token_chunk("Hel", fake.ids("Hel"))
            yield b'data: {"choices": [{"index": 0, "text": "'
            block = b"x" * 65536
            for _ in range(96 * 16):  # 96 MiB at most: past the stream limit (64 MiB) too
                yield block

        fake.script = endless_line
        async with websockets.connect(url) as ws:
            await hello(ws)
            err = (await chat(ws, "o1"))[-1]
            assert err["type"] == "error" and err["code"] == "backend_unavailable", err
            assert "line over 1048576 bytes" in err["message"]
            await asyncio.wait_for(fake.closed.wait(), STEP)
            # the hub stopped reading at about 1 MiB (socket buffers hold a few MiB more), far from the
            # 64 MiB it would have read had only the stream limit applied
            assert fake.sent_bytes < 32 << 20, fake.sent_bytes
            await chats_again(ws, fake, "o2")


# -- 6. down at start ---------------------------------------------------------------------------------


async def test_a_url_down_at_start_is_not_ready_then_ready_by_itself(smol):
    sock = bound_socket()  # the port is ours, nothing listens yet
    down_url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    fake = FakeUpstream(smol.tokenizer)
    try:
        async with hub(smol, [down_url]) as (app, base, url):
            r = await get(base, "/ready")
            assert r.status_code == 503
            body = r.json()
            assert body["ready"] is False and down_url in body["reason"] and "down" in body["reason"]
            health = (await get(base, "/health")).json()
            assert health["status"] == "ready"  # started; only the server is missing
            server = server_health(health, down_url)
            assert server["state"] in ("down", "probing") and server["last_error"]
            async with websockets.connect(url) as ws:  # the hub refuses while not ready
                refused = await recv_json(ws, STEP)
                assert refused["type"] == "error" and refused["code"] == "not_ready"

            await fake.start(sock)  # now something listens on that port

            async def ready() -> bool:
                return (await get(base, "/ready")).status_code == 200

            await wait_for(ready, STEP)
            health = (await get(base, "/health")).json()
            assert server_health(health, down_url)["state"] == "up"
            assert server_health(health, down_url)["kind"] == "llama.cpp"
            async with websockets.connect(url) as ws:
                await hello(ws)
                await chats_again(ws, fake, "d1")
    finally:
        await fake.stop()
        sock.close()


# -- 7. wrong tokenizer -------------------------------------------------------------------------------


async def test_a_different_tokenizer_refuses_to_start(smol):
    async with (
        fakes(smol, tokenize_offset=7) as [fake],
        hub(smol, [fake.url], wait_ready=False) as (app, base, url),
    ):

        async def failed() -> bool:
            return (await get(base, "/health")).json()["status"] == "failed"

        await wait_for(failed, STEP)
        r = await get(base, "/health")
        assert r.status_code == 503
        error = r.json()["error"]
        assert fake.url in error and "fake" in error and "tokenizer" in error, error
        ready = await get(base, "/ready")
        assert ready.status_code == 503 and "tokenizer" in ready.json()["reason"]
        assert fake.bodies == []  # nothing was generated


# -- 8. mid-reply death -------------------------------------------------------------------------------


async def test_mid_reply_death_is_backend_unavailable_and_the_next_turn_goes_elsewhere(smol):
    async with fakes(smol, 2) as pair, hub(smol, [f.url for f in pair]) as (app, base, url):
        async with websockets.connect(url) as ws:
            ready = await hello(ws)
            home_url = app.state.rt.backends["openai"].pool.choose(ready["session_id"]).url
            home, other = sorted(pair, key=lambda f: f.url != home_url)
            home.script = home.then("Hel", 0.05, ABORT)  # a token, then the connection drops
            events = await chat(ws, "m1")
            err = events[-1]
            assert err["type"] == "error" and err["code"] == "backend_unavailable", events
            assert [e["text"] for e in events if e["type"] == "token"] == ["Hel"]
            assert other.bodies == []  # no retry once a token reached the client
            await home.stop()  # the server is gone for good
            other.script = other.reply("Still here.")
            done = (await chat(ws, "m2"))[-1]
            assert done["type"] == "done" and done["text"] == "Still here.", done
            # the failed turn left nothing in the history: the prompt holds one user message
            assert smol.tokenizer.decode(other.bodies[0]["prompt"]).count("Hi there!") == 1

            async def home_is_down() -> bool:
                health = (await get(base, "/health")).json()
                return server_health(health, home.url)["state"] != "up"

            await wait_for(home_is_down, STEP)
            assert (await get(base, "/ready")).status_code == 200  # one server is enough
            await chats_again(ws, other, "m3")


# -- 9. cancel ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
async def test_cancel_or_disconnect_closes_the_upstream_stream(smol, how):
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):
        fake.script = fake.reply("word " * 200, delay=0.05)
        ws = await websockets.connect(url)
        try:
            ready = await hello(ws)
            await ws.send(
                json.dumps({"type": "chat", "id": "x1", "text": "Talk", "options": {"max_new_tokens": 400}})
            )
            first = await recv_json(ws, STEP)
            assert first["type"] == "token" and first["id"] == "x1", first
            if how == "cancel":
                await ws.send(json.dumps({"type": "cancel", "id": "x1"}))
                done = (await recv_until(ws, is_end("x1"), timeout=STEP))[-1]
                assert done["type"] == "done" and done["finish_reason"] == FinishReason.CANCELLED.value
                assert done["text"].startswith("word")
            else:
                await ws.close()
            await asyncio.wait_for(fake.closed.wait(), STEP)
            if how == "disconnect":
                ws = await websockets.connect(url)
                again = await hello(ws, session_id=ready["session_id"], resume_token=ready["resume_token"])
                assert again["type"] == "ready" and again["resumed"], again
            await chats_again(ws, fake, "x2")
        finally:
            await ws.close()

        async def nothing_in_flight() -> bool:
            return server_health((await get(base, "/health")).json(), fake.url)["in_flight"] == 0

        await wait_for(nothing_in_flight, STEP)
        server = server_health((await get(base, "/health")).json(), fake.url)
        assert server["errors"] == 0 and server["state"] == "up"  # a cancel is not the server's failure


async def test_cancel_right_after_chat_leaves_the_session_usable(smol):
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):
        async with websockets.connect(url) as ws:
            await hello(ws)
            # the cancel reaches the hub before the chat's task first runs (the hub's own bookkeeping)
            await ws.send(json.dumps({"type": "chat", "id": "q1", "text": "Hi"}))
            await ws.send(json.dumps({"type": "cancel", "id": "q1"}))
            end = (await recv_until(ws, is_end("q1"), timeout=3.0))[-1]
            assert end["type"] in ("done", "error"), end
            await chats_again(ws, fake, "q2")
            # a task cancelled the same way still answers `cancelled` and leaves no request behind
            await ws.send(
                json.dumps({"type": "task", "id": "t1", "task": "sentiment", "input": {"text": "ok"}})
            )
            await ws.send(json.dumps({"type": "cancel", "id": "t1"}))
            end = (await recv_until(ws, is_end("t1"), timeout=3.0))[-1]
            assert end["type"] in ("result", "error"), end
            await chats_again(ws, fake, "q3")


# -- 10. /health and /metrics per URL -----------------------------------------------------------------


async def test_health_and_metrics_show_each_url(smol):
    async with fakes(smol, 2) as pair, hub(smol, [f.url for f in pair]) as (app, base, url):
        a, b = pair
        at_start = requests_so_far(app)
        async with websockets.connect(url) as ws:
            ready = await hello(ws)
            home_url = app.state.rt.backends["openai"].pool.choose(ready["session_id"]).url
            await chats_again(ws, a if a.url == home_url else b, "h1")
        health = (await get(base, "/health")).json()
        remote = health["backends"]["openai"]
        assert remote["kind"] == "openai" and remote["model"] == "fake"
        assert {s["url"] for s in remote["servers"]} == {a.url, b.url}
        for s in remote["servers"]:
            assert s["state"] == "up" and s["kind"] == "llama.cpp" and s["in_flight"] == 0
            assert s["requests"] == (1 if s["url"] == home_url else 0) + at_start[s["url"]]
        label = 'url="%s"'
        assert await metric(base, "rtserver_backend_up", label % a.url) == 1.0
        requests = await metric(base, "rtserver_backend_requests_total", label % home_url)
        assert requests == 1 + at_start[home_url]
        assert await metric(base, "rtserver_backend_in_flight", label % home_url) == 0.0
        assert await metric(base, "rtserver_backend_errors_total", label % home_url) == 0.0
        assert await metric(base, "rtserver_backend_ttfb_p50_seconds", label % home_url) > 0
        gated = await metric(base, "rtserver_backend_gated_requests_total")
        assert gated == app.state.rt.backends["openai"].gate.requests >= 1
        assert 1 <= await metric(base, "rtserver_backend_send_groups_total") <= gated
        assert await metric(base, "rtserver_backend_prefetches_total", 'outcome="failed"') == 0

        await b.stop()

        async def b_down() -> bool:
            return await metric(base, "rtserver_backend_up", label % b.url) == 0.0

        await wait_for(b_down, STEP)
        assert await metric(base, "rtserver_backend_up", label % a.url) == 1.0
        assert await metric(base, "rtserver_backend_errors_total", label % b.url) >= 1.0
        health = (await get(base, "/health")).json()
        assert server_health(health, b.url)["state"] in ("down", "probing")
        assert server_health(health, b.url)["last_error"]


# -- the backend directly -----------------------------------------------------------------------------


async def test_a_generation_cancelled_before_it_ran_still_ends(smol):
    """`cancel()` right after `generate()` (before its task first ran): result() and the iteration end
    as cancelled instead of waiting forever."""
    async with fakes(smol) as [fake]:
        backend = RemoteBackend(smol.tokenizer, remote_settings([fake.url]).backend)
        backend.start()
        try:
            await backend.check()
            gen = backend.generate(fake.ids("Hello"), SamplingParams(max_new_tokens=4), session_key="k")
            gen.cancel()
            result = await asyncio.wait_for(gen.result(), STEP)
            assert result.finish_reason is FinishReason.CANCELLED and result.text == ""
            assert [e async for e in gen] == []
            assert backend.pool.upstreams[0].in_flight == 0
        finally:
            await backend.stop()


async def test_a_url_that_comes_back_with_a_different_tokenizer_stays_out(smol):
    """Down at start, then a server with another tokenizer listens there: the health check finds the
    mismatch and keeps the URL out (it is never used), however often it answers /health."""
    sock = bound_socket()
    down_url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    wrong = FakeUpstream(smol.tokenizer, tokenize_offset=7)
    try:
        async with fakes(smol) as [good], hub(smol, [down_url, good.url]) as (app, base, url):
            await wrong.start(sock)

            async def probed_twice() -> bool:  # found, refused, and after retry_after_s found again
                return wrong.health_checks >= 2

            await wait_for(probed_twice, STEP)
            health = (await get(base, "/health")).json()
            server = server_health(health, down_url)
            assert server["state"] != "up" and "tokenizer" in (server["last_error"] or ""), server
            for i in range(6):  # new sessions: about half would have the wrong server as their home
                async with websockets.connect(url) as ws:
                    await hello(ws)
                    await chats_again(ws, good, f"t{i}")
            assert wrong.bodies == [] and len(good.bodies) == 6
    finally:
        await wrong.stop()
        sock.close()


# -- per-task placement --------------------------------------------------------------------------------


async def test_a_task_placed_local_runs_on_the_local_engine_while_chat_goes_to_the_server(smol):
    """[task.sentiment] backend = "local" with model.backend = "openai": the auto-task's scores come from
    the hub's own engine, the reply from the server."""
    async with fakes(smol) as [fake]:
        settings = remote_settings([fake.url])
        settings.tasks.auto_tasks = ["sentiment"]
        settings.task = {"sentiment": {"backend": "local", "cache_size": 0}}
        local = ScriptedEngine(smol)
        app = create_app(settings, lambda: smol, engine_factory=lambda loaded_, s: local)
        async with serve(app, settings) as (base, url):
            assert set(app.state.rt.backends) == {"local", "openai"}
            async with websockets.connect(url) as ws:
                await hello(ws)
                fake.script = fake.reply("Fine, thanks.")
                events = await chat(ws, "p1", "How are you?")
                assert events[-1]["type"] == "done" and events[-1]["text"] == "Fine, thanks."
                if not any(e["type"] == "result" and e.get("auto") for e in events):  # it may come first
                    events += await recv_until(
                        ws, lambda e: e["type"] == "result" and e.get("auto"), timeout=STEP
                    )
                (auto,) = [e for e in events if e["type"] == "result" and e.get("auto")]
                assert auto["task"] == "sentiment" and auto["output"]["label"]
            assert len(fake.bodies) == 1  # only the chat reply went upstream
            assert local.scored >= 1 and local.prompts == []  # the scores were the local engine's


async def test_a_kept_alive_connection_the_server_dropped_is_sent_again(smol):
    """A server that closes a kept-alive connection when the next request arrives on it (as servers do
    with idle ones, racing the client, and cpp-httplib after a connection's 100th request): the request
    goes again on a new connection and succeeds, also when the client's pool holds several such
    connections; the server is not counted as failing."""
    served: list[int] = []  # per answered request: the connection's number
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        conn, answered = connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                if answered:  # a second request on this connection: drop it unanswered
                    writer.close()
                    return
                answered += 1
                served.append(conn)
                events = sse({"choices": [{"index": 0, "text": "Hi", "finish_reason": "stop"}]})
                events += b"data: [DONE]\n\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(events), events)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
    backend = RemoteBackend(smol.tokenizer, remote_settings([url]).backend)
    backend.pool.upstreams[0].checked = True  # as check() would have it (this server has no /v1/models)
    backend.start()
    try:
        for _ in range(3):
            gen = backend.generate([1, 2, 3], SamplingParams(max_new_tokens=4), session_key="k")
            result = await asyncio.wait_for(gen.result(), STEP)
            assert result.finish_reason is FinishReason.EOS and result.text == "Hi", result
        assert served == [1, 2, 3]  # each request after the first met a dropped connection, then a new one
        # four at once: four connections kept alive, each of which the server drops at its next request
        gens = [backend.generate([1, 2], SamplingParams(max_new_tokens=4), session_key=i) for i in range(4)]
        for result in await asyncio.wait_for(asyncio.gather(*(g.result() for g in gens)), STEP):
            assert result.text == "Hi", result
        for _ in range(4):  # each meets a dropped connection; the second try is not another one
            gen = backend.generate([1, 2, 3], SamplingParams(max_new_tokens=4), session_key="k")
            result = await asyncio.wait_for(gen.result(), STEP)
            assert result.finish_reason is FinishReason.EOS and result.text == "Hi", result
        assert len(served) == 11
        up = backend.pool.upstreams[0]
        assert up.errors == 0 and backend.pool.state(up) == "up"
    finally:
        await backend.stop()
        server.close()
        await server.wait_closed()


async def test_a_held_request_has_its_connection_open_and_writes_nothing_until_let_go(smol):
    """While the send gate holds a request its connection to the server is already open (the connect
    overlaps the hold) and not one byte of the request has been sent; once let go, the whole request
    arrives and is answered."""
    accepted = asyncio.Event()
    received: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            received.append(head + await reader.readexactly(length))
            events = sse({"choices": [{"index": 0, "text": "Hi", "finish_reason": "stop"}]}) + DONE
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                % (len(events), events)
            )
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
    backend = RemoteBackend(smol.tokenizer, remote_settings([url], send_window_ms=1000).backend)
    backend.pool.upstreams[0].checked = True  # as check() would have it (this server has no /v1/models)
    backend.start()
    try:
        gen = backend.generate([1, 2, 3], SamplingParams(max_new_tokens=4), session_key="k")
        await asyncio.wait_for(accepted.wait(), STEP)  # well within the 1 s hold of a lone request
        await asyncio.sleep(0.1)
        assert received == [] and backend.gate.groups == 0
        result = await asyncio.wait_for(gen.result(), STEP)
        assert result.text == "Hi" and backend.gate.groups == 1
        assert len(received) == 1 and received[0].startswith(b"POST /v1/completions ")
        assert json.loads(received[0].split(b"\r\n\r\n", 1)[1])["prompt"] == [1, 2, 3]
    finally:
        await backend.stop()
        server.close()
        await server.wait_closed()


async def test_requests_created_together_leave_for_the_server_as_one_group(smol):
    """A burst (8 generations and a label score made in one loop turn) reaches the server's queue
    together: it passes the send gate as one group (remote/gate.py), and every request is answered;
    with the gate off each one is sent on its own."""
    async with fakes(smol) as [fake]:
        for window_ms, groups in ((1.0, 1), (0.0, 9)):
            backend = RemoteBackend(
                smol.tokenizer, remote_settings([fake.url], send_window_ms=window_ms).backend
            )
            backend.start()
            try:
                await backend.check()
                gens = [
                    backend.generate(fake.ids(f"Hello {i}"), SamplingParams(max_new_tokens=8), session_key=i)
                    for i in range(8)
                ]
                score = asyncio.ensure_future(backend.score(fake.ids("Hi"), [[0]]))
                results = await asyncio.wait_for(asyncio.gather(*(g.result() for g in gens)), STEP)
                assert [r.text for r in results] == ["Hello there!"] * 8
                assert await asyncio.wait_for(score, STEP) == [-1.0]
                assert backend.gate.requests == 9 and backend.gate.groups == groups
            finally:
                await backend.stop()


# -- next-turn prefetch ------------------------------------------------------------------------------


async def test_a_reply_sends_the_next_turns_prefix_ahead_and_its_failures_are_harmless(smol, caplog):
    """When a reply ends its session's next prompt, up to where the next message goes, is sent to the
    session's server as a one-token completion; a prefetch answered with a 500, with garbage, or not at
    all is logged, and neither the turns nor the URL's health notice (the stalled one is given up by
    the next turn after a bounded wait)."""
    caplog.set_level(logging.WARNING, logger="rtserver")
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, base, url):
        backend = app.state.rt.backends["openai"]
        header = fake.ids("<|im_end|>\n<|im_start|>user\n")
        async with websockets.connect(url) as ws:
            await hello(ws)
            answers = ["ok", "500", "garbage", "500", "stall", "ok"]
            for i, answer in enumerate(answers):
                fake.prefetch_answer = answer
                assert (await chat(ws, f"c{i}", f"Question {i}?"))[-1]["type"] == "done"
                await wait_for(lambda i=i: _true(len(fake.prefetches) == i + 1), STEP)
                prefetch, turn = fake.prefetches[-1], fake.bodies[-1]
                # the prompt just answered, the reply and the next user header: nothing else
                assert prefetch["prompt"] == turn["prompt"] + fake.ids("Hello there!") + header
                assert prefetch["max_tokens"] == 1 and prefetch["stream"] is False
                if answer != "stall":
                    await wait_for(lambda: _true(not backend._prefetches), STEP)
            # each turn's prompt starts with the prefix prefetched after the turn before it
            for prefetch, turn in zip(fake.prefetches, fake.bodies[1:]):
                assert turn["prompt"][: len(prefetch["prompt"])] == prefetch["prompt"]
                assert len(turn["prompt"]) == len(prefetch["prompt"]) + len(
                    fake.ids("Question 0?<|im_end|>\n<|im_start|>assistant\n")
                )
        counts = backend.prefetch_counts
        assert counts["started"] == 6 and counts["done"] == 2 and counts["failed"] == 3
        assert counts["waited"] == 1 and counts["overtaken"] == 1  # the stalled one
        logged = [r.getMessage() for r in caplog.records if "prefetch" in r.getMessage()]
        assert len(logged) == 3 and all("no harm done" in m for m in logged)
        server = server_health((await get(base, "/health")).json(), fake.url)
        assert server["state"] == "up" and server["errors"] == 0 and server["in_flight"] == 0


async def test_no_prefetch_when_switched_off_or_the_url_has_no_room_beside_it(smol):
    async with fakes(smol) as [fake]:
        for settings, sent in (({"prefetch_next_turn": False}, 0), ({"max_in_flight_per_url": 1}, 0)):
            async with hub(smol, [fake.url], **settings) as (app, _, url):
                backend = app.state.rt.backends["openai"]
                async with websockets.connect(url) as ws:
                    await hello(ws)
                    for i in range(2):
                        assert (await chat(ws, f"c{i}"))[-1]["type"] == "done"
                        await wait_for(lambda b=backend: _true(not b._prefetches), STEP)  # its delay passed
                assert len(fake.prefetches) == sent and backend.prefetch_counts["done"] == 0
        assert backend.prefetch_counts["skipped"] == 2  # max_in_flight_per_url = 1: no spare room


async def test_a_turn_sent_at_once_never_waits_for_its_prefix_to_be_computed(smol, monkeypatch):
    """The next-turn prefix (the history rendered again) is computed only when the prefetch is about to
    be sent: turns sent right after their `done` cancel it before, so it is never computed for them;
    a turn after a pause finds it computed and sent."""
    calls: list[int] = []
    original = ChatTask.next_turn_prefix

    def counted(self, history, last):
        calls.append(len(history))
        return original(self, history, last)

    monkeypatch.setattr(ChatTask, "next_turn_prefix", counted)
    async with fakes(smol) as [fake], hub(smol, [fake.url]) as (app, _, url):
        backend = app.state.rt.backends["openai"]
        async with websockets.connect(url) as ws:
            await hello(ws)
            for i in range(3):  # each next message at once
                assert (await chat(ws, f"c{i}", f"Question {i}?"))[-1]["type"] == "done"
            assert calls == [] and fake.prefetches == []
            await wait_for(lambda: _true(not backend._prefetches), STEP)  # the last one's delay passed
            assert calls == [6] and len(fake.prefetches) == 1  # 3 turns: 6 messages in the history
        assert backend.prefetch_counts["cancelled"] == 2 and backend.prefetch_counts["done"] == 1


async def _true(value: bool) -> bool:
    return value


# -- what a server's prefix cache may share across sessions (remote/reuse.py) ---------------------------


async def two_sessions_two_turns(url: str) -> None:
    for session in ("a", "b"):
        async with websockets.connect(url) as ws:
            await hello(ws)
            for turn in (1, 2):
                assert (await chat(ws, f"{session}{turn}", f"My card number is 4929 {turn}"))[-1][
                    "type"
                ] == "done"


async def test_llama_server_sessions_reuse_only_their_own_slot(smol):
    """Each session on a slot of its own (`id_slot`); `cache_prompt` only on a turn that follows the
    session's own on that slot. llama-server would otherwise pick the most similar slot, another
    customer's, and say how many of its tokens matched."""
    async with fakes(smol) as [fake], hub(smol, [fake.url], prefetch_next_turn=False) as (_, _, url):
        await two_sessions_two_turns(url)
    a1, a2, b1, b2 = ({k: b.get(k) for k in ("id_slot", "cache_prompt")} for b in fake.bodies)
    assert a1 == {"id_slot": a1["id_slot"], "cache_prompt": False}
    assert a2 == {"id_slot": a1["id_slot"], "cache_prompt": True}
    assert b1 == {"id_slot": b1["id_slot"], "cache_prompt": False} and b1["id_slot"] != a1["id_slot"]
    assert b2 == {"id_slot": b1["id_slot"], "cache_prompt": True}


async def test_vllm_sessions_get_a_cache_salt_each(smol):
    async with fakes(smol, owned_by="vllm") as [fake], hub(smol, [fake.url]) as (_, _, url):
        await two_sessions_two_turns(url)
    salts = [b.get("cache_salt") for b in fake.bodies]
    assert all(isinstance(s, str) and len(s) == 32 for s in salts), salts
    assert salts[0] == salts[1] != salts[2] == salts[3]


async def test_another_openai_server_shows_no_more_than_the_public_prefix_cached(smol):
    async with fakes(smol, owned_by="someone") as [fake], hub(smol, [fake.url]) as (app, _, url):
        fake.script = fake.reply("Hello there!", cached=40)
        async with websockets.connect(url) as ws:
            await hello(ws)
            done = (await chat(ws, "c1", "My card number is 4929"))[-1]
    system = app.state.rt.tasks.chat.task.system_prompt
    public = smol.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "\x00"}],
        tokenize=False,
    ).split("\x00")[0]
    limit = len(smol.tokenizer.encode(public, add_special_tokens=False))
    assert done["usage"]["cached_tokens"] <= limit < 40, (done["usage"], limit)
