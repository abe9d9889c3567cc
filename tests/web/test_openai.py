"""The official `openai` client against rtserver's /v1/chat/completions and /v1/models."""

from __future__ import annotations

import httpx
import openai
import pytest

from rtserver.tasks.registry import load_registry
from rtserver.web.app import create_app

from ..conftest import reference_greedy
from ..serverutil import ScriptedEngine, make_settings, scripted_app, serve

pytestmark = pytest.mark.asyncio


async def test_openai_client_plain_and_streaming(smol):
    """Greedy replies equal transformers' float32 tokens on the prompt the chat task renders; usage
    counts are exact; a seeded sampled reply is the same each time, and honours `stop`."""
    settings = make_settings(tasks={"auto_tasks": []})
    chat = load_registry(settings, smol.tokenizer)[0].chat
    msgs = [{"role": "user", "content": "Say hello."}]
    prompt = chat.encode(msgs).ids  # the task's system prompt first
    expected = reference_greedy(smol, prompt, 5)
    assert smol.tokenizer.eos_token_id not in expected  # so the reply runs to max_tokens
    text = smol.tokenizer.decode(expected)
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        models = await client.models.list()
        model = models.data[0].id
        r = await client.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0)
        assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content == text
        assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == len(prompt)
        stream = await client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"top_k": 1, "repetition_penalty": 1.0, "min_tokens": 1, "ignore_eos": False},
        )
        pieces, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                pieces.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        assert "".join(pieces) == text  # greedy: same text both ways
        assert usage is not None and usage.completion_tokens == 5 and usage.prompt_tokens == len(prompt)
        assert finish == "length"
        # system prompt from the client (in place of the task's), stop string and seed accepted
        own = [{"role": "system", "content": "Be brief."}] + msgs
        assert len(chat.encode(own, system=False).ids) != len(prompt)
        seeded = []
        for _ in range(2):
            r2 = await client.chat.completions.create(
                model=model, messages=own, max_tokens=4, seed=3, stop=["\n"]
            )
            seeded.append((r2.choices[0].message.content, r2.usage.completion_tokens))
            assert r2.usage.prompt_tokens == len(chat.encode(own, system=False).ids)
            assert "\n" not in r2.choices[0].message.content and 0 < r2.usage.completion_tokens <= 4
        assert seeded[0] == seeded[1]  # the same seed, the same reply


async def test_stop_is_honoured_plain_and_streaming(smol):
    """`stop`: the reply ends just before the first occurrence of a stop string, which is not in it, and
    finish_reason is "stop" (greedy, so the reply without `stop` is the reference; the stop string is taken
    from its middle, where the reply without it goes on to max_tokens)."""
    settings = make_settings(tasks={"auto_tasks": []})
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        msgs = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
        common = {"model": "m", "messages": msgs, "max_tokens": 24, "temperature": 0}
        full = await client.chat.completions.create(**common)
        reference = full.choices[0].message.content
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24, reference
        stop = reference[len(reference) // 2 :][:3]
        expected = reference[: reference.index(stop)]
        assert stop.strip() and len(expected) >= 3, (reference, stop)
        r = await client.chat.completions.create(**common, stop=["never in the reply", stop])
        text = r.choices[0].message.content
        assert text == expected and stop not in text, (text, stop, reference)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 24
        stream = await client.chat.completions.create(**common, stop=stop, stream=True)
        pieces, finish = [], None
        async for chunk in stream:
            for ch in chunk.choices:
                pieces.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        assert "".join(pieces) == expected and finish == "stop", (pieces, stop, reference)


async def test_unsupported_fields_are_refused_with_400(smol):
    settings = make_settings(tasks={"auto_tasks": []})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        for kwargs, param in [
            ({"n": 2}, "n"),
            ({"extra_body": {"functions": [{"name": "f", "parameters": {}}]}}, "functions"),
            ({"logprobs": True}, "logprobs"),
            ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"extra_body": {"best_of": 3}}, "best_of"),
            ({"temperature": 9}, None),
            ({"max_tokens": 100000}, None),
        ]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=msgs, **kwargs)
            err = info.value.body
            assert err["code"] in ("unsupported", "bad_decoding"), err
            if param:
                assert err["param"] == param, err
        async with httpx.AsyncClient(base_url=base) as c:
            r = await c.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "function", "content": "x"}]},
            )
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
            r = await c.post("/v1/chat/completions", json={"model": "m"})
            assert r.status_code == 400


async def test_ignore_eos_gives_exactly_max_tokens(smol):
    """`ignore_eos` (what the bench sends every server): a reply that ends at EOS well before max_tokens
    without it goes on to exactly max_tokens with it, plain and streamed, finish_reason "length"."""
    settings = make_settings(tasks={"auto_tasks": []})
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
        common = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "temperature": 0}
        short = await client.chat.completions.create(**common, max_tokens=40)
        assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40, short
        full = await client.chat.completions.create(**common, max_tokens=40, extra_body={"ignore_eos": True})
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 40
        assert full.choices[0].message.content.startswith(short.choices[0].message.content)
        stream = await client.chat.completions.create(
            **common,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish = None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
        assert usage is not None and usage.completion_tokens == 40 and finish == "length"


REPLY_SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["happy", "neutral", "upset"]},
        "summary": {"type": "string", "minLength": 1, "maxLength": 60},
        "urgency": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["mood", "summary", "urgency"],
    "additionalProperties": False,
}


async def test_response_format_json_schema_gives_100_valid_replies(smol):
    """Through the `openai` SDK, 100 concurrent replies under `response_format` json_schema (greedy and
    sampled) all parse and validate; json_object gives an object; a schema llguidance cannot compile is
    a 400 `bad_output_format` naming the field."""
    import json

    import jsonschema

    settings = make_settings(tasks={"auto_tasks": []}, security={"api_max_tokens": 96})
    texts = [
        "My parcel is two weeks late, this is the third time!",
        "Thanks, the new headphones work great.",
        "How do I change my delivery address?",
        "The app crashes every time I open my cart.",
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "triage", "schema": REPLY_SCHEMA, "strict": True}}
    async with serve(create_app(settings, lambda: smol), settings) as (base, url):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", timeout=300, max_retries=0)

        async def ask(i: int):
            msgs = [{"role": "user", "content": f"Triage this message as JSON: {texts[i % len(texts)]}"}]
            return await client.chat.completions.create(
                model="m",
                messages=msgs,
                max_tokens=96,
                temperature=0 if i % 2 == 0 else 0.7,
                seed=i,
                response_format=fmt,
            )

        import asyncio

        replies = await asyncio.gather(*(ask(i) for i in range(100)))
        finished = [r for r in replies if r.choices[0].finish_reason == "stop"]
        assert len(finished) == 100, [r.choices[0].message.content for r in replies if r not in finished]
        for r in finished:
            jsonschema.validate(json.loads(r.choices[0].message.content), REPLY_SCHEMA)
        r = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Any JSON object, please."}],
            max_tokens=64,
            response_format={"type": "json_object"},
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            bad = {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "nope"}},
            }
            res = await http.post("/v1/chat/completions", json={**body, "response_format": bad})
            err = res.json()["error"]
            assert res.status_code == 400 and err["code"] == "bad_output_format", err
            assert err["param"] == "response_format" and "nope" in err["message"]
            res = await http.post("/v1/chat/completions", json={**body, "response_format": {"type": "xml"}})
            assert res.status_code == 400 and res.json()["error"]["code"] == "invalid_field"
            res = await http.post(
                "/v1/chat/completions",
                json={**body, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            )
            assert res.status_code == 400 and "'schema' object" in res.json()["error"]["message"]
