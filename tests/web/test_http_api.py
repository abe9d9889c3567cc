"""HTTP API over a real uvicorn server: tasks, compat endpoints, health during loading, ready, metrics."""

from __future__ import annotations

import asyncio
import gc
import threading

import httpx
import pytest

from rtserver.web.admission import Surface
from rtserver.web.app import create_app

from ..serverutil import ScriptedEngine, make_settings, scripted_app, serve

pytestmark = pytest.mark.asyncio


async def test_health_reports_loading_until_ready(smol):
    """Loading, then ready; what start-up built is frozen out of the garbage collector's passes by then."""
    gc.unfreeze()
    release = threading.Event()
    settings = make_settings()

    def loader():
        release.wait(120)
        return smol

    app = create_app(settings, loader, engine_factory=lambda loaded_, s: ScriptedEngine(smol))
    async with serve(app, settings, wait_ready=False) as (base, url):
        async with httpx.AsyncClient(base_url=base) as c:
            h = (await c.get("/health")).json()
            assert h["status"] == "loading" and 0 <= h["progress"] < 1 and h["stage"] == "loading model"
            assert (await c.get("/ready")).status_code == 503
            assert gc.get_freeze_count() == 0
            r = await c.post("/sentiment", json={"text": "hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            release.set()
            for _ in range(2400):
                if (await c.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            h = (await c.get("/health")).json()
            assert h["status"] == "ready" and h["progress"] == 1
            assert gc.get_freeze_count() > 0


async def test_failed_load_is_reported(smol):
    settings = make_settings()

    def loader():
        raise RuntimeError("no weights here")

    async with serve(create_app(settings, loader), settings, wait_ready=False) as (base, url):
        async with httpx.AsyncClient(base_url=base) as c:
            for _ in range(400):
                r = await c.get("/health")
                if r.json()["status"] != "loading":
                    break
                await asyncio.sleep(0.05)
            assert (
                r.status_code == 503 and r.json()["status"] == "failed" and "no weights" in r.json()["error"]
            )


async def test_tasks_and_compat_endpoints(smol):
    settings = make_settings(tasks={"auto_tasks": []})
    engine = ScriptedEngine(smol, script=smol.tokenizer.encode(" Fine, thanks.", add_special_tokens=False))
    async with serve(scripted_app(smol, settings, engine), settings) as (base, url):
        async with httpx.AsyncClient(base_url=base) as c:
            tasks = (await c.get("/v1/tasks")).json()
            names = {t["name"] for t in tasks["tasks"]}
            assert {"chat", "sentiment"} <= names
            assert all("limits" in t and "input" in t for t in tasks["tasks"])
            r = await c.post("/v1/tasks/sentiment", json={"input": {"text": "I love it"}})
            body = r.json()
            assert r.status_code == 200 and body["task"] == "sentiment" and "label" in body["output"]
            assert set(body) == {"task", "output", "text", "usage", "timing", "cached"}
            r = await c.post("/sentiment", json={"text": "I love it"})
            assert r.status_code == 200 and r.json()["label"] in ("positive", "negative")
            r = await c.post("/chat", json={"history": [{"role": "user", "content": "How are you?"}]})
            assert r.status_code == 200 and r.json()["reply"] == " Fine, thanks."
            r = await c.post(
                "/v1/tasks/chat", json={"input": {"history": [{"role": "user", "content": "Hi"}]}}
            )
            assert r.status_code == 200 and r.json()["output"] == {"reply": " Fine, thanks."}
            # errors: stable code, clear message, right status
            for path, payload, status, code in [
                ("/v1/tasks/nope", {"input": {"text": "x"}}, 404, "unknown_task"),
                ("/v1/tasks/sentiment", {"text": "x"}, 400, "missing_field"),
                ("/v1/tasks/sentiment", {"input": {"text": ""}}, 400, "empty_text"),
                ("/sentiment", {}, 400, "missing_field"),
                ("/chat", {"history": []}, 400, "invalid_input"),
                ("/chat", {"history": [{"role": "assistant", "content": "x"}]}, 400, "invalid_input"),
                (
                    "/chat",
                    {"history": [{"role": "user", "content": "x"}], "options": {"temperature": 50}},
                    400,
                    "bad_decoding",
                ),
            ]:
                r = await c.post(path, json=payload)
                assert r.status_code == status and r.json()["error"]["code"] == code, (path, r.text)
            r = await c.post("/sentiment", content=b"{bad", headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json"
            r = await c.post("/sentiment", content=b'{"text": "ok"}')  # not declared as JSON
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


async def test_metrics_exposition(smol):
    settings = make_settings(tasks={"auto_tasks": []})
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            r = await c.post(
                "/chat",
                json={"history": [{"role": "user", "content": "Hi"}], "options": {"max_new_tokens": 3}},
            )
            assert r.status_code == 200
            await c.post("/v1/tasks/nope", json={"input": "x"})
            text = (await c.get("/metrics")).text
    for name in [
        "rtserver_connections",
        "rtserver_sessions",
        "rtserver_running_sequences",
        "rtserver_waiting_sequences",
        "rtserver_tokens_generated_total",
        "rtserver_draft_tokens_total",
        "rtserver_draft_tokens_accepted_total",
        "rtserver_draft_acceptance_rate",
        "rtserver_kv_used_bytes",
        "rtserver_kv_budget_bytes",
        "rtserver_kv_evictions_total",
        "rtserver_kv_cache_hits_total",
        "rtserver_time_to_first_token_seconds_bucket",
        "rtserver_token_latency_seconds_bucket",
        'rtserver_errors_total{code="unknown_task"}',
    ]:
        assert name in text, name


async def test_bearer_token_on_http(smol):
    settings = make_settings(security={"api_token": "tok"})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        async with httpx.AsyncClient(base_url=base) as c:
            assert (await c.get("/v1/tasks")).status_code == 401
            assert (await c.get("/v1/tasks", headers={"Authorization": "Bearer tok"})).status_code == 200
            assert (await c.get("/health")).status_code == 200


async def test_completions_over_token_ids_serve_other_hubs(smol):
    """/v1/completions as a hub's inference node: token-id prompts give exactly the greedy tokens of
    `model.generate`, streamed with their ids; a session key keeps the prompt's KV for the next turn;
    `score_candidates` are log-probabilities; /tokenize tokenizes as the hub does; bad ids are refused."""
    import json

    import torch

    from ..conftest import chat_prompt, reference_greedy

    settings = make_settings(tasks={"auto_tasks": []})
    app = create_app(settings, lambda: smol)
    tok = smol.tokenizer
    prompt = chat_prompt(tok, "Name a colour.")
    want = reference_greedy(smol, prompt, 8)
    async with serve(app, settings) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            r = await c.post(
                "/v1/completions",
                json={
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == want and choice["finish_reason"] == "length"
            assert r.json()["usage"]["prompt_tokens"] == len(prompt)

            async def stream(ids: list[int]) -> tuple[list[int], dict]:
                body = {
                    "prompt": ids,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                    "stream_options": {"include_usage": True},
                    "rtserver_session": "hub-session-1",
                }
                got: list[int] = []
                usage: dict = {}
                async with c.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            event = json.loads(line[6:])
                            usage = event.get("usage") or usage
                            for ch in event["choices"]:
                                got += ch.get("token_ids") or []
                return got, usage

            got, usage = await stream(prompt)
            assert got == want
            follow = (
                prompt
                + want
                + tok.encode("<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n", add_special_tokens=False)
            )
            _, usage = await stream(follow)
            assert usage["prompt_tokens_details"]["cached_tokens"] >= len(prompt)  # the session's KV

            cands = [[want[0]], [want[0], want[1]], [want[1]]]
            r = await c.post("/v1/completions", json={"prompt": prompt, "score_candidates": cands})
            scores = r.json()["choices"][0]["candidate_logprobs"]
            with torch.no_grad():
                lp = torch.log_softmax(smol.model(torch.tensor([prompt + want[:1]])).logits[0].float(), -1)
            expected = [lp[-2, want[0]], lp[-2, want[0]] + lp[-1, want[1]], lp[-2, want[1]]]
            assert scores == pytest.approx([float(e) for e in expected], abs=1e-3)

            r = await c.post("/tokenize", json={"content": "Hello, world!"})
            assert r.json()["tokens"] == tok.encode("Hello, world!", add_special_tokens=False)
            r = await c.post("/v1/completions", json={"prompt": [len(tok) + 5]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_field"
            r = await c.post("/v1/completions", json={"prompt": prompt, "logit_bias": {"5": 1}})
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"


async def test_out_of_range_seed_is_refused_at_the_door_while_chats_stream(smol):
    """Issue 24: `seed` 2**64 on /v1/completions (no auth) reached torch's `manual_seed` inside the
    engine's batch step on 21d7172 and ended every sequence of that step, three /ws chats streaming
    beside it included. Now it is a 400 naming `seed`, and the values at the edges of each accepted
    range run in the real engine beside the chats, which all end with `done`."""
    import json

    import websockets

    from ..serverutil import hello, is_end, recv_json, recv_until

    settings = make_settings(tasks={"auto_tasks": []})
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        chats = [await websockets.connect(url) for _ in range(3)]
        try:
            for i, ws in enumerate(chats):
                assert (await hello(ws))["type"] == "ready"
                text = "Write a very long story about a dragon, a knight and a castle."
                options = {"max_new_tokens": 256, "seed": i}
                await ws.send(json.dumps({"type": "chat", "id": f"c{i}", "text": text, "options": options}))
            for i, ws in enumerate(chats):  # each has its first token: it is in the engine's batch
                first = await recv_json(ws)
                assert first["type"] == "token" and first["id"] == f"c{i}", first
            # read on while the requests below run (an unread stream would hold back its pongs)
            ends = [asyncio.ensure_future(recv_until(ws, is_end(f"c{i}"))) for i, ws in enumerate(chats)]
            async with httpx.AsyncClient(base_url=base, timeout=120) as c:
                attack = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.7, "seed": 2**64}
                r = await c.post("/v1/completions", json=attack)
                err = r.json()["error"]
                assert r.status_code == 400 and (err["code"], err["param"]) == ("bad_decoding", "seed"), (
                    r.text
                )
                assert "0..9223372036854775807" in err["message"], err
                edges = [
                    {"seed": 2**63 - 1, "temperature": 2},
                    {"seed": 0, "temperature": 0.001, "top_p": 1e-6},
                    {"top_k": 1000, "temperature": 1.5, "repetition_penalty": 10},
                    {"top_k": -1, "repetition_penalty": 0.05, "min_p": 1},
                    {"temperature": -0.0, "min_tokens": 3, "stop": ["x" * 256] * 16},
                ]
                # below what the engine's float32 sampling can take (top_p 1e-300 kept no token: an
                # IndexError in the batch step on 21d7172)
                for field, value in [("top_p", 1e-300), ("temperature", 1e-300), ("top_p", 1e-7)]:
                    r = await c.post("/v1/completions", json={"prompt": [1], field: value, "seed": 1})
                    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
                for edge in edges:
                    body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True, **edge}
                    r = await c.post("/v1/completions", json=body)
                    assert r.status_code == 200, (edge, r.text)
                    assert r.json()["usage"]["completion_tokens"] == 3, (edge, r.text)
                messages = [{"role": "user", "content": "Hi"}]
                body = {"model": "m", "messages": messages, "max_tokens": 2, "seed": 2**31 - 1, "top_k": 200}
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            for i, ws in enumerate(chats):  # the chats need not run their 256 tokens out
                await ws.send(json.dumps({"type": "cancel", "id": f"c{i}"}))
            for end in await asyncio.gather(*ends):
                assert end[-1]["type"] == "done", end[-1]
        finally:
            for ws in chats:
                await ws.close()


async def test_task_calls_hold_their_tokens_against_the_api_budget(smol):
    """/sentiment and /v1/tasks/<name> hold a call's most tokens like a generation: one over the
    client's API budget alone is a 413 naming the cost, and a finished call gives its tokens back."""
    settings = make_settings(tasks={"auto_tasks": []})
    app = create_app(settings, lambda: smol)
    async with serve(app, settings) as (base, _):
        cost = app.state.rt.tasks.cost("sentiment")
        budget = app.state.admission.budgets[Surface.API]
        budget.per_client = cost - 1
        async with httpx.AsyncClient(timeout=60) as http:
            for path, body in (
                ("/sentiment", {"text": "I love it"}),
                ("/v1/tasks/sentiment", {"input": "I love it"}),
            ):
                r = await http.post(base + path, json=body)
                assert r.status_code == 413, (path, r.text)
                assert r.json()["error"]["code"] == "request_too_large" and f"needs {cost} tokens" in r.text
            budget.per_client = cost
            r = await http.post(base + "/sentiment", json={"text": "I love it"})
            assert r.status_code == 200 and r.json()["label"], r.text
            assert budget.held == 0 and budget.held_by_client == {}
