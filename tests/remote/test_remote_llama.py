"""rtserver with `model.backend = "openai"` in front of a real llama.cpp `llama-server` on the embedded
GGUF, and in front of another rtserver node (slow: real servers, the real model)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets

from rtbench.evaluate import load_split
from rtbench.serverproc import ServerProcess
from rtserver.config import Settings
from rtserver.remote.backend import PREFETCH_DELAY_S
from rtserver.web.app import create_app

from ..llamautil import LlamaServer, built_llama_server
from ..serverutil import TIMEOUT, hello, is_end, make_settings, recv_until, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    server = LlamaServer(built_llama_server(), tmp_path_factory.mktemp("llama") / "llama-server.log").start()
    yield server
    server.stop()


def remote_settings(*urls: str, **sections: dict) -> Settings:
    s = make_settings(**sections)
    s.model.backend = "openai"
    s.backend.urls = list(urls)
    s.backend.timeout_s = 30.0
    s.backend.health_interval_s = 0.5
    s.backend.retry_after_s = 1.0
    s.tasks.auto_tasks = []
    return s


async def chat(ws, rid: str, text: str, **options) -> dict:
    await ws.send(
        json.dumps({"type": "chat", "id": rid, "text": text, "options": {"temperature": 0, **options}})
    )
    events = await recv_until(ws, is_end(rid))
    return events[-1]


async def test_chat_streams_and_the_next_turn_reuses_the_servers_cache(smol, llama):
    settings = remote_settings(llama.url)
    async with serve(create_app(settings, lambda: smol), settings) as (base, ws_url):
        async with websockets.connect(ws_url) as ws:
            await hello(ws)
            await ws.send(
                json.dumps(
                    {
                        "type": "chat",
                        "id": "t1",
                        "text": "What is the capital of France?",
                        "options": {"temperature": 0, "max_new_tokens": 24},
                    }
                )
            )
            events = await recv_until(ws, is_end("t1"))
            tokens = [e for e in events if e["type"] == "token"]
            first = events[-1]
            assert first["type"] == "done", first
            assert len(tokens) >= 2 and "".join(t["text"] for t in tokens) == first["text"]
            second = await chat(ws, "t2", "And of Germany?", max_new_tokens=24)
            assert second["type"] == "done", second
            # the session's first turn (system prompt, question, reply) comes from the server's cache
            assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"], (first, second)
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            health = (await http.get(base + "/health")).json()
            (server,) = health["backends"]["openai"]["servers"]
            assert server["state"] == "up" and server["kind"] == "llama.cpp"
            metrics = (await http.get(base + "/metrics")).text
            assert f'rtserver_backend_up{{url="{llama.url}"}} 1.0' in metrics


async def test_the_next_turn_finds_its_template_prefix_in_the_servers_cache(smol, llama):
    """After a reply the hub sends the next prompt's start (history, end of the reply, next user
    header) to llama-server: the next turn then finds all of it cached and prefills only its message
    and the assistant header. Without the prefetch, the header is prefilled with the message."""
    tail = smol.tokenizer.encode(
        "And of Germany?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    prefilled = {}
    for on in (True, False):
        settings = remote_settings(llama.url, backend={"prefetch_next_turn": on})
        app = create_app(settings, lambda: smol)
        async with serve(app, settings) as (_, ws_url):
            backend = app.state.rt.backends["openai"]
            async with websockets.connect(ws_url) as ws:
                await hello(ws)
                first = await chat(ws, "t1", "What is the capital of France?", max_new_tokens=24)
                assert first["type"] == "done", first
                deadline = time.monotonic() + TIMEOUT
                while backend._prefetches and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                second = await chat(ws, "t2", "And of Germany?", max_new_tokens=24)
                assert second["type"] == "done", second
        usage = second["usage"]
        prefilled[on] = usage["prompt_tokens"] - usage["cached_tokens"]
        assert backend.prefetch_counts["done"] == (1 if on else 0), backend.prefetch_counts
    assert prefilled[True] == len(tail), prefilled
    header = len(smol.tokenizer.encode("<|im_end|>\n<|im_start|>user\n", add_special_tokens=False))
    assert prefilled[False] >= len(tail) + header, prefilled


async def test_turns_sent_while_their_prefetch_is_pending_keep_the_sessions_cache(smol, llama):
    """A client that answers at once (its session's prefetch not sent yet) or just as the prefetch is
    sent (then in flight): the turn is not broken and still lands where the session's tokens are cached
    (not on another slot)."""
    settings = remote_settings(llama.url)
    app = create_app(settings, lambda: smol)
    async with serve(app, settings) as (_, ws_url):
        async with websockets.connect(ws_url) as ws:
            await hello(ws)
            last = await chat(ws, "t1", "Name a fruit.", max_new_tokens=12)
            assert last["type"] == "done", last
            for turn in range(2, 8):
                if turn % 2:
                    await asyncio.sleep(PREFETCH_DELAY_S)  # about when the prefetch is written
                done = await chat(ws, f"t{turn}", "Another one?", max_new_tokens=12)
                assert done["type"] == "done", done
                assert done["usage"]["cached_tokens"] >= last["usage"]["prompt_tokens"], (last, done)
                last = done
        counts = app.state.rt.backends["openai"].prefetch_counts
        assert counts["started"] + counts["cancelled"] >= 6 and counts["failed"] == 0, counts


async def test_openai_endpoint_and_sentiment_through_the_server(smol, llama):
    settings = remote_settings(llama.url)
    async with serve(create_app(settings, lambda: smol), settings) as (base, _):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            r = await http.post(
                base + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 12,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"].strip()
            for text, label in (
                ("I love it, wonderful!", "positive"),
                ("Terrible, it broke at once.", "negative"),
            ):
                r = await http.post(base + "/sentiment", json={"text": text})
                assert r.status_code == 200, r.text
                assert r.json()["label"] == label


def _sse_data(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]


async def test_openai_stream_starts_with_the_first_token_in_one_chunk(smol, llama):
    """The streamed response begins when the first token is there: its first body chunk holds the role
    chunk and the first text together, and the text streamed is the plain reply's."""
    settings = remote_settings(llama.url)
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0}
    async with serve(create_app(settings, lambda: smol), settings) as (base, _):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            plain = await http.post(base + "/v1/chat/completions", json=body)
            assert plain.status_code == 200, plain.text
            raw: list[bytes] = []
            async with http.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for piece in r.aiter_raw():
                    raw.append(piece)
    first = _sse_data(raw[0])
    assert [e["choices"][0]["delta"] for e in first[:1]] == [{"role": "assistant", "content": ""}]
    assert len(first) >= 2 and first[1]["choices"][0]["delta"]["content"]
    events = _sse_data(b"".join(raw))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == plain.json()["choices"][0]["message"]["content"]
    assert b"".join(raw).rstrip().endswith(b"data: [DONE]")


async def test_a_client_leaving_before_the_first_token_stops_the_upstream_generation(smol, llama):
    """A streaming client that disconnects while the server still computes its (long) prompt: the hub
    closes the upstream stream, so the server generates (almost) nothing of the max_tokens asked."""
    settings = remote_settings(llama.url)
    words = " ".join(f"item{i}" for i in range(300))  # ~1,000 tokens (a slot holds 2,048): a long prefill
    body = {
        "messages": [{"role": "user", "content": f"Repeat these: {words}"}],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    def predicted() -> float:
        text = httpx.get(llama.url + "/metrics", timeout=10).text
        return next(
            float(ln.split()[-1])
            for ln in text.splitlines()
            if ln.startswith("llamacpp:tokens_predicted_total")
        )

    async with serve(create_app(settings, lambda: smol), settings) as (base, _):
        before = predicted()
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            request = asyncio.create_task(http.post(base + "/v1/chat/completions", json=body))
            deadline = time.monotonic() + 30
            while not (busy := llama.processing()) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert busy == 1 and not request.done()
            request.cancel()  # the client goes away (its connection closes)
            with pytest.raises(asyncio.CancelledError):
                await request
        deadline = time.monotonic() + 30
        while llama.processing() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert llama.processing() == 0
        assert predicted() - before < 50, "the server kept generating after the client left"


async def test_a_disconnect_mid_reply_frees_the_servers_slot(smol, llama):
    settings = remote_settings(llama.url)
    async with serve(create_app(settings, lambda: smol), settings) as (_, ws_url):
        ws = await websockets.connect(ws_url)
        await hello(ws)
        await ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": "long",
                    "text": "Count from 1 to 500, separated by commas.",
                    "options": {"temperature": 0, "max_new_tokens": 512},
                }
            )
        )
        await recv_until(ws, lambda e: e["type"] == "token")
        assert llama.processing() == 1
        await ws.close()
        deadline = time.monotonic() + 5
        while llama.processing() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert llama.processing() == 0, "the upstream slot still generates after the client left"


async def test_sentiment_labels_equal_the_local_engines_on_a_third_of_the_test_split(smol, llama):
    """Same weights (the embedded Q4_1 file) through llama-server's log-probabilities and through the
    local float32 engine: the labels agree on at least 93% of every third text of the test split (a
    fixed third keeps CI within its time). llama-server scores with 8-bit activations, so labels near
    a tie flip, and how many moves with the CPU's kernels and the batches' order."""
    local = make_settings(tasks={"auto_tasks": []})
    remote = remote_settings(llama.url)
    texts = [ex["text"] for lang in ("en", "zh") for ex in load_split(lang, "test")][::3]

    async def labels(settings: Settings) -> list[str]:
        async with serve(create_app(settings, lambda: smol), settings) as (base, _):
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                sem = asyncio.Semaphore(8)

                async def one(text: str) -> str:
                    async with sem:
                        r = await http.post(base + "/sentiment", json={"text": text})
                        assert r.status_code == 200, r.text
                        return r.json()["label"]

                # no warm-up call: the server computed the calibration scores at start-up, alone
                return await asyncio.gather(*(one(t) for t in texts))

    here, there = await labels(local), await labels(remote)
    agree = sum(a == b for a, b in zip(here, there)) / len(texts)
    print(f"\nsentiment labels local vs llama-server: {agree:.3f} equal over {len(texts)} texts")
    assert agree >= 0.93


async def generated(base: str) -> float:
    """An rtserver node's tokens generated so far, from its /metrics."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        text = (await http.get(base + "/metrics")).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("rtserver_tokens_generated_total")
    )


async def test_two_backends_spread_sessions_and_survive_one_dying(smol, llama, tmp_path):
    node = ServerProcess(
        {
            "RTSERVER_MODEL_DTYPE": "float32",
            "RTSERVER_TASKS_LEARNED_HEADS": "false",
            "RTSERVER_TASKS_AUTO_TASKS": "",
            "RTSERVER_SECURITY_IP_RATE_LIMIT_PER_S": "0",
            "RTSERVER_SECURITY_MAX_SESSIONS_PER_IP": "0",
        },
        tmp_path / "node.log",
    )
    node.start()
    try:
        settings = remote_settings(llama.url, node.base)
        # the chat with min_new_tokens settable: a reply must not end, wherever the model would stop,
        # before the node is killed under it
        settings.chat.overridable = {**settings.chat.overridable, "min_new_tokens": [0, 512]}
        plugins = tmp_path / "plugins"  # the chat alone, as before: no stateless task
        plugins.mkdir()
        settings.tasks.plugin_dirs = [str(plugins)]
        async with serve(create_app(settings, lambda: smol), settings) as (base, ws_url):
            sockets = [await websockets.connect(ws_url) for _ in range(8)]
            for ws in sockets:
                await hello(ws)
            for i, ws in enumerate(sockets):
                assert (await chat(ws, f"a{i}", "Hi!", max_new_tokens=8))["type"] == "done"
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                servers = (await http.get(base + "/health")).json()["backends"]["openai"]["servers"]
            assert all(s["requests"] > 0 for s in servers), servers  # sessions spread over both
            kinds = {s["url"]: s["kind"] for s in servers}
            assert kinds == {llama.url: "llama.cpp", node.base: "rtserver"}
            # every session replies again after the rtserver node dies mid-reply: the ones it served end
            # with backend_unavailable (never a hang), then move to llama-server
            before = await generated(node.base)
            long = [
                asyncio.create_task(
                    chat(ws, f"b{i}", "Count from 1 to 500.", max_new_tokens=500, min_new_tokens=500)
                )
                for i, ws in enumerate(sockets)
            ]
            # past the node's first tokens (a failure before them retries elsewhere), long before 500
            deadline = time.monotonic() + 60
            while await generated(node.base) < before + 64:
                assert time.monotonic() < deadline, "the node generated no replies"
                await asyncio.sleep(0.05)
            node.proc.kill()
            ends = await asyncio.wait_for(asyncio.gather(*long), 120)
            codes = [e.get("code") for e in ends if e["type"] == "error"]
            assert codes and set(codes) == {"backend_unavailable"}, ends  # the node's sessions, typed
            for i, ws in enumerate(sockets):
                end = await chat(ws, f"c{i}", "Hi again!", max_new_tokens=8)
                assert end["type"] == "done", end
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                health = (await http.get(base + "/health")).json()["backends"]["openai"]["servers"]
                ready = await http.get(base + "/ready")
            state = {s["url"]: s["state"] for s in health}
            assert state[llama.url] == "up" and state[node.base] != "up", health
            assert ready.status_code == 200  # one server up is enough
            for ws in sockets:
                await ws.close()
    finally:
        if node.proc is not None and node.proc.poll() is None:
            node.stop()


async def test_no_session_reads_another_ones_text_from_llama_servers_cache(smol, llama):
    """The card-number probe of docs/security.md through a hub: on its own, llama-server gives a new
    request the slot whose prompt is most like it (or one restored from its host cache) and reports
    how many tokens matched. Through the hub a probe reuses nothing, on a fresh slot or on one another
    session used, and the victim's own next turn still reuses its slot."""
    settings = remote_settings(llama.url, backend={"prefetch_next_turn": False})
    async with serve(create_app(settings, lambda: smol), settings) as (_, ws_url):

        async def probe(guess: str) -> int:
            async with websockets.connect(ws_url) as prober:
                await hello(prober)
                done = await chat(prober, "p", f"My card number is {guess}", max_new_tokens=1)
                assert done["type"] == "done", done
                return done["usage"]["cached_tokens"]

        async with websockets.connect(ws_url) as victim:
            await hello(victim)
            first = await chat(victim, "v1", "My card number is 4929 1234 5678 9012", max_new_tokens=8)
            assert first["type"] == "done", first
            fresh = {g: await probe(g) for g in ("4929 1", "4929 2", "4929 1234 5678 9012")}  # slots 1-3
            second = await chat(victim, "v2", "Thanks.", max_new_tokens=4)
            assert second["type"] == "done", second
            assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"], (first, second)
            used = {g: await probe(g) for g in ("4", "5")}  # on the slots of the first probes
        assert set(fresh.values()) == set(used.values()) == {0}, (fresh, used)
