"""Readiness (rtserver/web/readiness.py) and start-ups that never fit a learned head: a task without a fit
for the loaded model scores labels and /health says why; `rtserver fit-heads` stores a fit the next start
loads; a server set to fit in the background switches the task to its head when done."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from rtserver.tasks import fit_heads, prepare
from rtserver.tasks.fitting import BACKGROUND_NICE
from rtserver.tasks.head import LogisticHead
from rtserver.web.readiness import RETRY, assess

from ..serverutil import ScriptedEngine, make_settings, scripted_app, serve, wait_for

# -- one readiness value ------------------------------------------------------------------------------


class Backend:
    def __init__(self, available: bool):
        self.available = available

    def health(self) -> dict[str, Any]:
        return {"servers": [{"url": "http://10.0.0.7:8080", "state": "open", "last_error": "refused"}]}


def test_readiness_says_why_and_the_public_reason_names_no_server():
    loading = assess("loading", None, {}, None, False)
    assert (loading.ready, loading.serving, loading.reason) == (False, False, "the model is loading")
    assert loading.public_reason == f"the model is loading; {RETRY}"
    failed = assess("failed", "cannot load the model: /models/x.gguf is missing", {}, None, False)
    assert failed.reason.startswith("cannot load") and "/models" not in failed.public_reason
    down = assess("ready", None, {"openai": Backend(False)}, None, False)
    assert not down.serving and "10.0.0.7" in down.reason and "10.0.0.7" not in down.public_reason
    redis = "Redis at redis.internal:6379 is unreachable"
    store = assess("ready", None, {"local": Backend(True)}, redis, True)
    assert store.serving and not store.ready and store.draining and "redis.internal" in store.reason
    assert store.public_reason == f"the session store is unavailable; {RETRY}"
    up = assess("ready", None, {"local": Backend(True)}, None, False)
    assert up.ready and up.serving and up.reason == up.public_reason == ""


# -- a start never fits a head ------------------------------------------------------------------------

POS = ["I love it", "Wonderful service", "Great value, thank you", "Best day ever", "Really happy with it"]
NEG = ["I hate it", "Terrible service", "A waste of money", "Worst day ever", "Really unhappy with it"]
EXAMPLES = [(f"{t} ({i})", y) for i in range(3) for ts, y in ((POS, "pos"), (NEG, "neg")) for t in ts]

PLUGIN = """
from rtserver.tasks import Choices, LearnedHead, Task

TASK = Task(
    name="mood",
    description="test",
    prompt="Message: {{text}}\\nSentiment:",
    chat_template=False,
    choices=Choices({{"positive": " Positive", "negative": " Negative"}}, calibration=["N/A"]),
    head=LearnedHead({examples!r}, labels={{"pos": "positive", "neg": "negative"}}),
)
"""


class FeatureEngine(ScriptedEngine):
    """A scripted engine with hidden states (a fixed function of the message's tokens); `features_gate`
    holds every feature request until set."""

    feature_model_id = "fake|float32"

    def __init__(self, loaded: Any):
        super().__init__(loaded)
        self.feature_calls = 0
        self.features_gate: asyncio.Event | None = None

    async def score_features(self, prompt, candidates, *, features_from, public_tokens=0):
        if self.features_gate is not None:
            await self.features_gate.wait()
        self.feature_calls += 1
        body = prompt[features_from:]
        rng = np.random.default_rng(sum(body) * 31 + len(body))
        return [float(len(body) % 5), 1.0], rng.normal(size=6).tolist()


def mood_settings(tmp_path: Path, **tasks: Any):
    examples = tmp_path / "mood.examples.jsonl"
    examples.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in EXAMPLES))
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "mood.py").write_text(PLUGIN.format(examples=str(examples)), encoding="utf-8")
    return make_settings(
        tasks={"plugin_dirs": [str(plugins)], "auto_tasks": [], "learned_heads": True, **tasks},
        model={"cache_dir": str(tmp_path / "cache")},
    )


@pytest.fixture
def no_fitting(monkeypatch):
    """Any fit (features of the examples, the classifier) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a learned head was fitted")

    monkeypatch.setattr(prepare, "example_features", refuse)
    monkeypatch.setattr(LogisticHead, "fit", refuse)


async def health_and_mood(base: str) -> tuple[dict[str, Any], dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base) as c:
        health = (await c.get("/health")).json()
        r = await c.post("/v1/tasks/mood", json={"input": {"text": "I love it (0)"}})
        assert r.status_code == 200, r.text
        return health, r.json()


async def test_a_start_without_a_fit_is_ready_at_once_and_scores_labels(smol, tmp_path, no_fitting, caplog):
    caplog.set_level(logging.INFO)
    settings = mood_settings(tmp_path)
    engine = FeatureEngine(smol)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, _):
        health, out = await health_and_mood(base)
    assert "plugin_errors" not in health, health
    note = "no fit for model fake|float32; run rtserver fit-heads"
    assert health["tasks"] == {"mood": {"mode": "labels", "head": note}}
    assert engine.feature_calls == 0 and "probs" in out["output"]
    assert caplog.text.count(note) == 1  # logged once
    assert "fitting" not in caplog.text.lower()


async def test_fit_heads_stores_a_fit_the_next_start_uses(smol, tmp_path, monkeypatch):
    settings = mood_settings(tmp_path)
    engine = FeatureEngine(smol)
    monkeypatch.setattr(fit_heads, "Engine", lambda loaded, engine_settings: engine)
    written = await fit_heads.fit_heads(SimpleNamespace(tokenizer=smol.tokenizer), settings)
    assert written == [tmp_path / "cache" / "heads" / "mood.head.npz"] and written[0].is_file()
    assert engine.feature_calls == len(EXAMPLES)

    def refuse(*args, **kwargs):
        raise AssertionError("a learned head was fitted")

    monkeypatch.setattr(prepare, "example_features", refuse)
    monkeypatch.setattr(LogisticHead, "fit", refuse)
    engine = FeatureEngine(smol)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, _):
        health, out = await health_and_mood(base)
    assert health["tasks"] == {"mood": {"mode": "head", "head": "fitted for model fake|float32"}}
    assert engine.feature_calls == 1 and out["output"]["label"] == "positive"  # the head's forward


async def test_a_background_fit_switches_the_task_to_its_head_after_ready(smol, tmp_path, monkeypatch):
    settings = mood_settings(tmp_path, fit_heads_in_background=True)
    engine = FeatureEngine(smol)
    engine.features_gate = asyncio.Event()
    fitted_on: list[tuple[str, int]] = []
    fit = LogisticHead.fit

    def recording_fit(self, x, y):
        fitted_on.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, 0)))
        return fit(self, x, y)

    monkeypatch.setattr(LogisticHead, "fit", recording_fit)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, _):
        health, _ = await health_and_mood(base)  # ready while the examples wait for the gate
        assert health["tasks"]["mood"]["mode"] == "labels", health
        assert "fitting in the background" in health["tasks"]["mood"]["head"]
        assert engine.feature_calls == 0
        engine.features_gate.set()

        async def switched() -> bool:
            async with httpx.AsyncClient(base_url=base) as c:
                return (await c.get("/health")).json()["tasks"]["mood"]["mode"] == "head"

        await wait_for(switched)
        calls = engine.feature_calls
        health, out = await health_and_mood(base)
        assert engine.feature_calls == calls + 1 and out["output"]["label"] == "positive"
    assert (tmp_path / "cache" / "heads" / "mood.head.npz").is_file()  # the next start loads it
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    assert fitted_on == [(fitted_on[0][0], min(own_nice + BACKGROUND_NICE, 19))]  # a low-priority thread
    assert fitted_on[0][0].startswith("head-fit")
