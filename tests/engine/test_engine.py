"""Engine end to end on real models: batched greedy output equals plain `model.generate`, KV reuse,
eviction/rebuild, window cuts, cancellation, label scoring and fault isolation."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import torch

from rtserver.config import EngineSettings
from rtserver.engine.backend import FinishReason, Overloaded, SamplingParams
from rtserver.engine.core import Engine

from ..conftest import chat_prompt, reference_greedy

pytestmark = pytest.mark.asyncio

TEXTS = [
    "Tell me a short fact about the number 7.",
    "Hi!",
    "Write a haiku about autumn leaves falling on a quiet lake at dusk, please.",
    "What is the capital of France? Answer in one sentence.",
    "Count from one to five.",
]


def greedy(n: int) -> SamplingParams:
    # min_new_tokens suppresses EOS exactly as the reference generate(min_new_tokens=n) does.
    return SamplingParams(max_new_tokens=n, min_new_tokens=n)


async def collect(stream) -> list[int]:
    return [ev.token_id async for ev in stream]


@pytest.fixture(params=["smol", "tiny_qwen2"])
def loaded(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
async def engine(loaded):
    eng = Engine(loaded, EngineSettings(prefill_chunk_tokens=32, kv_budget_mb=64))
    eng.start()
    yield eng
    await eng.stop()


async def test_batched_joins_and_cancels_equal_generate(engine, loaded):
    tok = loaded.tokenizer
    prompts = [chat_prompt(tok, t) for t in TEXTS]
    n = 12
    header = public_header(tok)  # the template's header: shared by every prompt
    first = [engine.generate(p, greedy(n), public_tokens=header) for p in prompts[:2]]
    # Join later, while the first two decode, and cancel one of them midway.
    joined_at = 0
    async for _ in first[0]:
        joined_at += 1
        if joined_at == 3:
            break
    late = [engine.generate(p, greedy(n), public_tokens=header) for p in prompts[2:]]
    doomed = engine.generate(prompts[3], greedy(n))
    got_doomed = []
    async for ev in doomed:
        got_doomed.append(ev.token_id)
        if len(got_doomed) == 2:
            doomed.cancel()
    outputs = [(await s.result()).token_ids for s in first + late]
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(loaded, prompt, n)
    cancelled = await doomed.result()
    assert cancelled.finish_reason is FinishReason.CANCELLED
    assert cancelled.token_ids == reference_greedy(loaded, prompts[3], n)[: len(cancelled.token_ids)]
    # Everything is freed but the prompt blocks the prefix cache keeps for later prompts.
    assert engine.kv.prefix_hits > 0
    assert engine.kv.used_blocks == len(engine.kv.prefix_blocks)
    engine.kv.clear_prefix_cache()
    assert engine.kv.used_blocks == 0


async def test_second_turn_prefills_only_new_tokens(engine, loaded):
    tok = loaded.tokenizer
    history = [{"role": "user", "content": "Name a color."}]
    p1 = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    r1 = await engine.generate(p1, greedy(8), session_key="s1").result()
    assert r1.usage.cached_tokens == 0 and r1.usage.prefilled_tokens == len(p1)
    # The next prompt continues exactly: prompt + answer tokens + the new user turn.
    p2 = (
        p1
        + r1.token_ids
        + tok.encode(
            "<|im_end|>\n<|im_start|>user\nAnd another one?<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
    )
    r2 = await engine.generate(p2, greedy(8), session_key="s1").result()
    kept = len(p1) + len(r1.token_ids) - 1  # the last sampled token was never fed back
    assert r2.usage.cached_tokens == kept
    assert r2.usage.prefilled_tokens == len(p2) - kept
    assert r2.token_ids == reference_greedy(loaded, p2, 8)


async def test_window_cut_rebuilds_from_first_changed_token(engine, loaded):
    tok = loaded.tokenizer
    turns = [
        {"role": "user", "content": "First question here."},
        {"role": "assistant", "content": "A."},
        {"role": "user", "content": "Second question."},
    ]
    full = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
    await engine.generate(full, greedy(4), session_key="w").result()
    cut = tok.apply_chat_template(turns[2:], add_generation_prompt=True, tokenize=True, return_dict=False)
    r = await engine.generate(cut, greedy(6), session_key="w").result()
    system_len = (
        len(tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=True, return_dict=False)) - 5
    )
    assert 0 < r.usage.cached_tokens < len(cut) and r.usage.cached_tokens >= system_len
    assert r.token_ids == reference_greedy(loaded, cut, 6)


def engine_with_kv_tokens(loaded, tokens: int, **options) -> Engine:
    """An engine whose KV pool holds exactly `tokens` tokens (the MB setting is too coarse for tests)."""
    eng = Engine(loaded, EngineSettings(**options))
    cfg = loaded.model.config
    eng.kv = type(eng.kv)(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        eng.runner.head_dim,
        loaded.dtype,
        eng.kv.bytes_per_token * tokens,
        16,
    )
    eng.runner.kv = eng.scheduler.kv = eng.kv
    return eng


async def test_evicted_session_is_rebuilt_with_same_answer(loaded):
    # A budget that holds about two sequences forces LRU eviction of idle sessions.
    eng = engine_with_kv_tokens(loaded, 16 * 12, prefill_chunk_tokens=64)
    tok = loaded.tokenizer
    eng.start()
    try:
        p1 = chat_prompt(tok, "Remember the word banana.")
        r1 = await eng.generate(p1, greedy(6), session_key="a").result()
        for i in range(3):
            await eng.generate(
                chat_prompt(tok, f"Filler request number {i}."), greedy(40), session_key=f"f{i}"
            ).result()
        assert eng.kv.evictions >= 1
        p2 = p1 + r1.token_ids + tok.encode("\nWhat word?", add_special_tokens=False)
        r2 = await eng.generate(p2, greedy(6), session_key="a").result()
        # The session's own KV is gone; at most the shared system-prompt blocks come from the prefix cache.
        assert eng.kv.rebuilds == 1 and r2.usage.cached_tokens < len(p1) - 8
        assert r2.token_ids == reference_greedy(loaded, p2, 6)
    finally:
        await eng.stop()


async def test_budget_respected_under_random_workload(loaded):
    eng = engine_with_kv_tokens(loaded, 16 * 16, max_running=6, prefill_chunk_tokens=48)
    eng.start()
    rng = random.Random(1)
    tok = loaded.tokenizer
    peak = 0

    async def one(i: int) -> None:
        nonlocal peak
        stream = eng.generate(
            chat_prompt(tok, TEXTS[i % len(TEXTS)] * rng.randint(1, 3)),
            greedy(rng.randint(1, 20)),
            session_key=f"r{i % 4}" if i % 2 else None,
        )
        cancel_after = rng.choice([None, 1, 3])
        k = 0
        async for _ in stream:
            k += 1
            peak = max(peak, eng.kv.used_blocks)
            assert eng.kv.used_blocks <= eng.kv.total_blocks
            if cancel_after is not None and k == cancel_after:
                stream.cancel()
        await stream.result()

    try:
        await asyncio.gather(*(one(i) for i in range(24)))
        assert peak > 0
        for i in range(4):
            eng.drop_session(f"r{i}")
        eng.kv.clear_prefix_cache()
        assert eng.kv.used_blocks == 0 and eng.kv.free_blocks == eng.kv.total_blocks
    finally:
        await eng.stop()


async def test_label_scoring_equals_plain_forward(engine, loaded):
    tok = loaded.tokenizer
    prompt = tok.encode("Message: I loved this film!\nSentiment:", add_special_tokens=False)
    candidates = [
        tok.encode(w, add_special_tokens=False) for w in (" positive", " negative", " very mixed feelings")
    ]
    scores = await engine.score(prompt, candidates)
    for cand, got in zip(candidates, scores):
        ids = torch.tensor([prompt + cand])
        with torch.no_grad():
            lp = torch.log_softmax(loaded.model(ids).logits[0].float(), -1)
        want = sum(float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(cand))
        assert got == pytest.approx(want, abs=1e-3)


async def test_shared_prefix_is_reused(engine, loaded):
    tok = loaded.tokenizer
    prefix = tok.encode(
        "Classify the sentiment of the message as positive or negative. Answer with one "
        "word, the label, and nothing else.\n",
        add_special_tokens=False,
    )
    outs = []
    for text in ("Great!", "Awful service.", "Great!"):
        prompt = prefix + tok.encode(f"Message: {text}\nSentiment:", add_special_tokens=False)
        candidates = [tok.encode(" positive", add_special_tokens=False)]
        outs.append(await engine.score(prompt, candidates, public_tokens=len(prefix)))
    shared = len(prefix) // engine.kv.block_tokens * engine.kv.block_tokens
    assert shared > 0 and engine.kv.prefix_hits >= 2 * shared
    assert outs[0] == pytest.approx(outs[2], abs=1e-4)


async def test_overloaded_at_once(loaded):
    eng = Engine(loaded, EngineSettings(max_running=1, max_waiting=2))
    eng.start()
    try:
        tok = loaded.tokenizer
        streams = []
        with pytest.raises(Overloaded):
            for _ in range(4):  # one running (once admitted) + two waiting fit; the fourth cannot
                streams.append(eng.generate(chat_prompt(tok, "Hello"), greedy(30)))
        assert 2 <= len(streams) <= 3
        for s in streams:
            s.cancel()
        for s in streams:
            assert (await s.result()).finish_reason is FinishReason.CANCELLED
    finally:
        await eng.stop()


async def test_failing_step_fails_only_its_sequences(engine, loaded):
    tok = loaded.tokenizer
    calm_prompt, victim_prompt = chat_prompt(tok, TEXTS[0]), chat_prompt(tok, TEXTS[1])
    calm = engine.generate(calm_prompt, greedy(10))
    await calm.__anext__()

    def explode(items):
        if any(it.seq.prompt_ids == victim_prompt for it in items):
            raise RuntimeError("injected")

    engine.scheduler.fault_hook = explode
    try:
        bad = await engine.generate(victim_prompt, greedy(5)).result()
        good = await calm.result()
    finally:
        engine.scheduler.fault_hook = None
    assert bad.finish_reason is FinishReason.ERROR and "internal" in bad.error
    # the neighbour shared the failing steps; retried alone, it completes exactly
    assert good.token_ids == reference_greedy(loaded, calm_prompt, 10)
    after = await engine.generate(chat_prompt(tok, TEXTS[2]), greedy(5)).result()
    assert after.token_ids == reference_greedy(loaded, chat_prompt(tok, TEXTS[2]), 5)


async def test_score_features_match_transformers_hidden_states_whatever_is_cached(smol):
    """The learned head's features: the final (normed) hidden state at the prompt's last token, every
    second layer's mean over the positions after the fixed prefix and an early layer's last token — equal to
    transformers' own hidden states, also when the prefix cache holds the same text (it may not serve
    the pooled positions) and when the prompt is prefilled in several chunks."""
    from rtserver.engine.backend import FeatureScorer

    tok = smol.tokenizer
    prefix = tok.encode("Message: I love it.\nSentiment: positive\n\nMessage: ", add_special_tokens=False)
    body = tok.encode("The plot was thin but the actors made it worth the ticket.", add_special_tokens=False)
    prompt = prefix + body + tok.encode("\nSentiment:", add_special_tokens=False)
    cands = [
        tok.encode(" Positive", add_special_tokens=False),
        tok.encode(" Negative", add_special_tokens=False),
    ]
    with torch.inference_mode():
        hs = smol.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    n = smol.model.config.num_hidden_layers
    # hidden_states[i + 1] is layer i's output: the final normed state, the means of layers 0, 2, .. below
    # the last, layer n/6's last token
    means = [hs[i + 1][0, len(prefix) :].mean(0) for i in range(0, n - 1, 2)]
    want = torch.cat([hs[-1][0, -1], *means, hs[n // 6 + 1][0, -1]])
    eng = Engine(smol, EngineSettings(prefill_chunk_tokens=8, kv_budget_mb=64))
    assert isinstance(eng, FeatureScorer)
    eng.start()
    try:
        plain = await eng.score(prompt, cands, normalize=False)
        for _ in range(2):  # the second time the whole prompt is in the prefix cache
            scores, feats = await eng.score_features(prompt, cands, features_from=len(prefix))
            assert scores == pytest.approx(plain, abs=1e-3)
            assert len(feats) == (2 + len(means)) * smol.model.config.hidden_size
            torch.testing.assert_close(torch.tensor(feats), want, atol=2e-3, rtol=1e-3)
        with pytest.raises(ValueError):
            await eng.score_features(prompt, cands, features_from=len(prompt))
    finally:
        await eng.stop()


# -- a sequence's own failure after the forward ends only it ------------------------------------------


class Unchecked(SamplingParams):
    """Decoding that skips validation: a value no door lets through reaches the sampler."""

    def validate(self, vocab_size=None) -> None:
        pass


async def test_a_sequence_whose_sampling_raises_ends_alone_and_its_neighbours_are_unchanged(smol):
    tok = smol.tokenizer
    prompts = [chat_prompt(tok, t) for t in TEXTS[:3]]
    sampled = SamplingParams(temperature=0.7, seed=7, max_new_tokens=8, ignore_eos=True)

    def run(with_victim: bool):
        # not started: this test runs the scheduler's steps itself, so all three share the first step
        eng = Engine(smol, EngineSettings(kv_budget_mb=64))
        calm = [eng.generate(prompts[0], greedy(8)).seq, eng.generate(prompts[1], sampled).seq]
        victim = None
        if with_victim:  # torch.Generator.manual_seed raises on a seed of 2**64
            victim = eng.generate(prompts[2], Unchecked(temperature=0.7, seed=2**64, max_new_tokens=8)).seq
        while eng.scheduler.has_work:
            eng.scheduler.step()
        return [s.result() for s in calm], victim

    alone, _ = run(False)
    beside, victim = run(True)
    for want, got in zip(alone, beside):
        assert got.finish_reason is FinishReason.LENGTH and got.error is None
        assert got.token_ids == want.token_ids and len(got.token_ids) == 8
    assert beside[0].token_ids == reference_greedy(smol, prompts[0], 8)
    bad = victim.result()
    assert bad.finish_reason is FinishReason.ERROR and "sampling" in bad.error and not bad.token_ids


async def test_sampling_params_are_bounded_at_submit(smol):
    from rtserver.engine.backend import SamplingError

    eng = Engine(smol, EngineSettings(kv_budget_mb=64))
    prompt = chat_prompt(smol.tokenizer, "Hi")
    vocab = len(smol.tokenizer)
    for field, bad in [
        ("seed", 2**64),
        ("seed", -1),
        ("seed", True),
        ("temperature", float("nan")),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_k", 1.5),
        ("max_new_tokens", 0),
        ("min_new_tokens", 10**9),
        ("stop_token_ids", [vocab]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", list(range(65))),
        ("stop", ["x" * 257]),
        ("ignore_eos", 1),
        ("speculate", "yes"),
    ]:
        with pytest.raises(SamplingError) as exc:
            eng.generate(prompt, SamplingParams(**{field: bad}))
        assert str(exc.value).startswith(f"{field} = ")
    assert not eng.scheduler.waiting  # nothing was queued
    eng.generate(prompt, SamplingParams(seed=2**63 - 1, stop_token_ids=[vocab - 1]))  # the edges pass


async def test_token_ids_outside_the_vocabulary_are_refused_at_submit(smol):
    """A prompt or candidate that is not a list of the model's token ids is refused by name before
    anything is queued, not failed inside the step (a str prompt once got there)."""
    eng = Engine(smol, EngineSettings(kv_budget_mb=64))
    vocab = eng.runner.vocab_size
    message = f"must be a non-empty list of token ids in 0..{vocab - 1}"
    for bad in ("<|im_start|>user", [], [vocab], [-1], [1, 2.0], [True], None):
        with pytest.raises(ValueError, match="prompt_ids " + re.escape(message)):
            eng.generate(bad, SamplingParams())
        with pytest.raises(ValueError, match="prompt_ids " + re.escape(message)):
            await eng.score(bad, [[1]])
    for bad in ([[vocab]], [[1], "x"], [[]]):
        with pytest.raises(ValueError, match="candidates " + re.escape(message)):
            await eng.score([1, 2], bad)
    assert not eng.scheduler.waiting


# -- the prefix cache shares only what the server wrote -----------------------------------------------


async def test_no_session_reads_another_ones_text_through_the_prefix_cache(smol):
    import httpx

    from rtserver.web.app import create_app

    from ..serverutil import make_settings, serve

    settings = make_settings(tasks={"auto_tasks": []})
    engine = Engine(smol, settings.engine)
    app = create_app(settings, lambda: smol, engine_factory=lambda loaded_, s: engine)

    def ask(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 1}

    async with serve(app, settings) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            r = await c.post("/v1/chat/completions", json=ask("My card number is 4929 1234"))
            assert r.status_code == 200
            cached = {}
            for guess in ("My card number is 4", "My card number is 49", "My card number is 48"):
                r = await c.post("/v1/chat/completions", json=ask(guess))
                cached[guess] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    # right and wrong digits look the same: only the template's header (system prompt) is shared
    assert len(set(cached.values())) == 1, cached
    assert cached["My card number is 49"] == public_header(smol.tokenizer) > 0, cached


def public_header(tok) -> int:
    """The chat prompt's ids before the user's text: what every session may share."""
    from rtserver.tasks.chat import encode_chat

    return encode_chat(tok, [{"role": "user", "content": "x"}]).public_tokens


async def test_a_shared_system_prompt_is_still_shared_and_a_session_keeps_its_own_kv(smol):
    eng = Engine(smol, EngineSettings(kv_budget_mb=64))
    eng.start()
    try:
        from rtserver.tasks.chat import encode_chat

        tok = smol.tokenizer
        system = {"role": "system", "content": "You answer questions about the shop's opening hours. " * 3}
        a = encode_chat(tok, [system, {"role": "user", "content": "When do you open?"}], public_messages=1)
        b = encode_chat(
            tok, [system, {"role": "user", "content": "Are you open on Sunday?"}], public_messages=1
        )
        assert a.public_tokens == b.public_tokens > 2 * eng.kv.block_tokens
        ra = await eng.generate(a.ids, greedy(4), session_key="A", public_tokens=a.public_tokens).result()
        rb = await eng.generate(b.ids, greedy(4), session_key="B", public_tokens=b.public_tokens).result()
        assert ra.usage.cached_tokens == 0 and rb.usage.cached_tokens == b.public_tokens
        # A's second turn reuses all of its own KV, its private text included
        second = a.ids + ra.token_ids + tok.encode("<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n")
        r2 = await eng.generate(second, greedy(4), session_key="A", public_tokens=a.public_tokens).result()
        assert r2.usage.cached_tokens == len(a.ids) + len(ra.token_ids) - 1
        assert r2.token_ids == reference_greedy(smol, second, 4)
        # a forgotten public_tokens shares nothing
        rc = await eng.generate(b.ids, greedy(4)).result()
        assert rc.usage.cached_tokens == 0
    finally:
        await eng.stop()


async def test_a_hub_tells_its_rtserver_node_what_is_public(smol):
    """The node API shares what `rtserver_public_tokens` says (default: the whole prompt, it being a
    trusted hub's), and the remote backend sends it: a hub's customers are kept apart on the node too."""
    import httpx

    from rtserver.remote.backend import RemoteBackend
    from rtserver.web.app import create_app

    from ..serverutil import make_settings, serve

    tok = smol.tokenizer
    settings = make_settings(tasks={"auto_tasks": []})
    engine = Engine(smol, settings.engine)
    app = create_app(settings, lambda: smol, engine_factory=lambda loaded_, s: engine)
    secret, header = chat_prompt(tok, "My card number is 4929 1234"), public_header(tok)
    right, wrong = chat_prompt(tok, "My card number is 49"), chat_prompt(tok, "My card number is 48")
    async with serve(app, settings) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            r = await c.post("/v1/completions", json={"prompt": right, "rtserver_public_tokens": 10**6})
            assert r.status_code == 400 and "rtserver_public_tokens" in r.json()["error"]["message"]
        hub = make_settings(model={"backend": "openai"}, backend={"urls": [base]}).backend
        backend = RemoteBackend(tok, hub)
        backend.start()
        try:
            await backend.check()
            assert backend.kinds[base] == "rtserver"
            params = SamplingParams(max_new_tokens=1)
            await backend.generate(secret, params, session_key="A", public_tokens=header).result()
            cached = [
                (await backend.generate(p, params, public_tokens=header).result()).usage.cached_tokens
                for p in (right, wrong)
            ]
            assert cached == [header, header]
        finally:
            await backend.stop()
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:  # the node's own default: all
            body = {"prompt": secret, "max_tokens": 1, "stream": False}
            await c.post("/v1/completions", json=body)
            r = await c.post("/v1/completions", json={**body, "prompt": secret[:-1] + [secret[-1]]})
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(secret) - 1


async def test_an_assist_prompt_starts_from_its_conversations_kv_idle_or_running(engine, loaded):
    """A prompt about a conversation (`fork_session`) shares that session's computed KV, idle or
    running; its answer is exact, and the session keeps its KV and its own answers."""
    tok = loaded.tokenizer

    def then(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    history = [{"role": "user", "content": "My order #4411 has not arrived after two weeks. Where is it?"}]
    p1 = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    r1 = await engine.generate(p1, greedy(8), session_key="s").result()
    kept = len(p1) + len(r1.token_ids) - 1
    # idle: a draft after the bot's reply starts from the session's KV
    draft = p1 + r1.token_ids + then("<|im_end|>\n<|im_start|>assistant\n")
    d1 = await engine.generate(draft, greedy(6), fork_session="s").result()
    assert d1.usage.cached_tokens == kept
    assert d1.token_ids == reference_greedy(loaded, draft, 6)
    # the session's next turn still finds all of its KV, unchanged by what the draft wrote
    p2 = (
        p1 + r1.token_ids + then("<|im_end|>\n<|im_start|>user\nAny news?<|im_end|>\n<|im_start|>assistant\n")
    )
    r2 = await engine.generate(p2, greedy(8), session_key="s").result()
    assert r2.usage.cached_tokens == kept
    assert r2.token_ids == reference_greedy(loaded, p2, 8)
    # running: a draft for the message the bot is answering shares its whole prompt
    p3 = (
        p2
        + r2.token_ids
        + then("<|im_end|>\n<|im_start|>user\nPlease hurry.<|im_end|>\n<|im_start|>assistant\n")
    )
    turn = engine.generate(p3, greedy(24), session_key="s")
    seen = 0
    async for _ in turn:
        seen += 1
        if seen == 3:
            break
    d2 = await engine.generate(p3, greedy(6), fork_session="s").result()
    assert d2.usage.cached_tokens == len(p3) - 1
    assert d2.token_ids == reference_greedy(loaded, p3, 6)
    r3 = await turn.result()
    assert r3.token_ids == reference_greedy(loaded, p3, 24)
    # the conversation's text is offered to nobody else, and an unknown session gives nothing
    assert (await engine.generate(draft, greedy(1)).result()).usage.cached_tokens == 0
    assert (await engine.generate(draft, greedy(1), fork_session="x").result()).usage.cached_tokens == 0
    assert engine.kv.stats().fork_hits == kept + len(p3) - 1
