"""The learned head (rtserver/tasks/head.py, `Task.head`, `PromptTask.prepare`): the classifier, the
examples file, the fallback on backends without hidden states, that a task without examples behaves
exactly as before, and the head end to end on the real model (features cached on disk)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from rtserver.config import EngineSettings, Settings
from rtserver.engine.backend import FeatureScorer
from rtserver.engine.core import Engine
from rtserver.engine.model import effective_dtype, resolve_dtype
from rtserver.tasks import Choices, LearnedHead, Task
from rtserver.tasks.head import LogisticHead, load_examples, load_fitted, save_fitted, store_fitted
from rtserver.tasks.registry import TaskRegistry, load_registry
from rtserver.tasks.run import PromptTask

PROMPT = "Message: {text}\nSentiment:"
WORDS = {"positive": " Positive", "negative": " Negative"}


def sentiment_task(head: LearnedHead | None = None) -> Task:
    return Task(
        name="mood",
        description="test",
        prompt=PROMPT,
        chat_template=False,
        choices=Choices(dict(WORDS), calibration=["N/A"]),
        head=head,
    )


def write_examples(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows), encoding="utf-8")
    return path


POS = ["I love it", "Wonderful service", "Great value, thank you", "Best day ever", "Really happy with it"]
NEG = ["I hate it", "Terrible service", "A waste of money", "Worst day ever", "Really unhappy with it"]
EXAMPLES = [(f"{t} ({i})", y) for i in range(3) for ts, y in ((POS, "pos"), (NEG, "neg")) for t in ts]


# -- the classifier ------------------------------------------------------------------------------------


def test_logistic_head_fits_separable_and_multiclass_data():
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 3, (3, 8))
    y = rng.integers(0, 3, 300)
    x = centers[y] + rng.normal(0, 0.5, (300, 8))
    labels = ["a", "b", "c"]
    head = LogisticHead(labels, l2=1e-3).fit(x, [labels[i] for i in y])
    p = head.predict_proba(x)
    assert p.shape == (300, 3) and np.allclose(p.sum(1), 1.0)
    assert (p.argmax(1) == y).mean() > 0.98
    # Noise only: nothing to learn, probabilities stay near the label frequencies (no overconfidence).
    noise = rng.normal(0, 1, (400, 8))
    coin = LogisticHead(["a", "b"], l2=1.0).fit(noise, ["a" if i % 2 else "b" for i in range(400)])
    assert np.abs(coin.predict_proba(noise)[:, 0] - 0.5).max() < 0.15


def test_examples_file_errors_name_the_line(tmp_path):
    path = tmp_path / "ex.jsonl"
    path.write_text('{"text": "fine", "label": "pos"}\n{"text": "x", "label": "meh"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"ex.jsonl:2: label 'meh'"):
        load_examples(path, {"pos": "positive"}, ["positive", "negative"])
    path.write_text('{"text": "fine"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"ex.jsonl:1: expected"):
        load_examples(path, {}, ["positive"])
    rows = load_examples(
        write_examples(path, [("a", "pos"), ("b", "negative")]), {"pos": "positive"}, list(WORDS)
    )
    assert rows == [("a", "positive"), ("b", "negative")]


def test_a_head_needs_choices():
    with pytest.raises(ValueError, match="head"):
        Task(name="t", description="t", prompt="{text}", head=LearnedHead("x.jsonl")).validate()
    sentiment_task(LearnedHead("x.jsonl")).validate()


# -- without examples: exactly as before; without hidden states: label scoring, said so --------------


class ScoresOnly:
    """A backend like a remote one: label scores, no hidden states. Records what it was asked."""

    def __init__(self):
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    async def score(self, prompt, candidates, *, normalize=True, public_tokens=0):
        self.calls.append((tuple(prompt), normalize))
        await asyncio.sleep(0)
        return [float(len(prompt) % 7), 2.5]


async def test_no_examples_and_no_hidden_states_both_score_labels_as_before(smol, tmp_path):
    tok = smol.tokenizer
    plain = PromptTask(sentiment_task(), tok)
    assert await plain.prepare(ScoresOnly()) is None and plain.heads == {}
    examples = write_examples(tmp_path / "ex.jsonl", EXAMPLES)
    with_head = PromptTask(
        sentiment_task(LearnedHead(examples, labels={"pos": "positive", "neg": "negative"})), tok
    )
    backend = ScoresOnly()
    note = await with_head.prepare(backend, tmp_path / "cache", "openai")
    assert note is not None and "'mood'" in note and "'openai'" in note and "label scoring" in note
    assert with_head.heads == {} and backend.calls == []  # nothing computed for the examples
    for text in ("I love it", "Terrible", "这个很好"):
        a, b = ScoresOnly(), ScoresOnly()
        out_plain = await plain.run(a, text)
        out_head = await with_head.run(b, text)
        assert out_plain.output == out_head.output and a.calls == b.calls  # the same calls, same answer
        assert all(normalize is False for _, normalize in a.calls)


# -- the fitted-heads file a plugin ships -----------------------------------------------------------


class FakeFeatures:
    """A backend with hidden states that are a fixed function of the message's tokens (no model):
    counts what it computes."""

    def __init__(self, model_id: str = "fake|float32"):
        self.feature_model_id = model_id
        self.feature_calls = 0

    async def score(self, prompt, candidates, *, normalize=True, public_tokens=0):
        return [0.25, -0.25]

    async def score_features(self, prompt, candidates, *, features_from, public_tokens=0):
        self.feature_calls += 1
        body = prompt[features_from:]
        rng = np.random.default_rng(sum(body) * 31 + len(body))
        return [float(len(body) % 5), 1.0], rng.normal(size=6).tolist()


async def test_a_shipped_fit_is_loaded_when_its_hash_matches_and_refitted_otherwise(smol, tmp_path, caplog):
    caplog.set_level(logging.INFO, "rtserver.tasks")
    tok = smol.tokenizer
    examples = write_examples(tmp_path / "ex.jsonl", EXAMPLES)
    fitted = tmp_path / "mood.head.npz"
    spec = LearnedHead(examples, labels={"pos": "positive", "neg": "negative"}, fitted=fitted)
    first, backend = PromptTask(sentiment_task(spec), tok), FakeFeatures()
    await first.prepare(backend)  # no file yet: fitted from the examples
    assert backend.feature_calls == len(EXAMPLES) and list(first.heads) == [-1]
    assert "cannot read the fitted heads" in caplog.text and "has no head fitted" in caplog.text
    save_fitted(fitted, first.fitted)
    assert set(load_fitted(fitted)) == set(first.fitted)

    caplog.clear()
    loaded, backend = PromptTask(sentiment_task(spec), tok), FakeFeatures()
    await loaded.prepare(backend)
    assert backend.feature_calls == 0 and "loaded from" in caplog.text and "has no head" not in caplog.text
    for text in ("I love it (0)", "A waste of money (2)", "never seen before"):
        a, b = await first.run(FakeFeatures(), text), await loaded.run(FakeFeatures(), text)
        assert a.output == b.output  # the same weights: the same probabilities, exactly

    # Anything the fit depends on differs: fitted from the examples again, and the log says why.
    edited = write_examples(tmp_path / "edited.jsonl", [*EXAMPLES[:-1], (EXAMPLES[-1][0], "pos")])
    other_prompt = sentiment_task(spec)
    other_prompt.prompt = "Review: {text}\nSentiment:"
    for task, model_id in (
        (sentiment_task(spec), "another|bfloat16"),
        (other_prompt, "fake|float32"),
        (sentiment_task(dataclasses.replace(spec, examples=edited)), "fake|float32"),
        (sentiment_task(dataclasses.replace(spec, l2=0.5)), "fake|float32"),
    ):
        caplog.clear()
        backend = FakeFeatures(model_id)
        await PromptTask(task, tok).prepare(backend)
        assert backend.feature_calls == len(EXAMPLES) and "has no head fitted for this model" in caplog.text


def test_stored_fits_keep_the_other_models_entries(tmp_path):
    """`rtserver fit-heads` adds to the cache's file: a fit for another model or prompt stays usable."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(40, 4)), ["a", "b"] * 20
    heads = {
        name: LogisticHead(["a", "b"], iterations=20).fit(x + i, y)
        for i, name in enumerate(("one", "two", "new"))
    }
    path = tmp_path / "mood.head.npz"
    store_fitted(path, {"k1": ("model-a", heads["one"]), "k2": ("model-b", heads["two"])})
    store_fitted(path, {"k2": ("model-b", heads["new"])})  # refitted: replaces its own entry only
    loaded = load_fitted(path)
    assert sorted(loaded) == ["k1", "k2"]
    for key, want in (("k1", heads["one"]), ("k2", heads["new"])):
        assert np.array_equal(loaded[key].mean, want.mean)  # each fit's own data: its own mean


async def test_a_broken_fitted_file_is_a_warning_and_a_fit(smol, tmp_path, caplog):
    examples = write_examples(tmp_path / "ex.jsonl", EXAMPLES)
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"not a zip")
    spec = LearnedHead(examples, labels={"pos": "positive", "neg": "negative"}, fitted=broken)
    task, backend = PromptTask(sentiment_task(spec), smol.tokenizer), FakeFeatures()
    await task.prepare(backend)
    assert list(task.heads) == [-1] and backend.feature_calls == len(EXAMPLES)
    assert "cannot read the fitted heads" in caplog.text
    with pytest.raises(ValueError, match="head.fitted"):
        sentiment_task(LearnedHead(examples, fitted=3)).validate()  # type: ignore[arg-type]


class NoFeatures:
    """A local-like backend that must not be asked for any feature (every head comes from its file)."""

    def __init__(self, model_id: str):
        self.feature_model_id = model_id

    async def score(self, prompt, candidates, *, normalize=True, public_tokens=0):
        return [0.0] * len(candidates)

    async def score_features(self, prompt, candidates, *, features_from, public_tokens=0):
        raise AssertionError("a shipped head was not used: features computed")


async def test_the_built_in_tasks_load_their_shipped_heads(smol, tmp_path, caplog):
    """Editing a built-in task's prompt, verbalizers or examples without `rtserver fit-heads` fails here
    (the default start would compute features for minutes instead of loading the heads)."""
    # The features' model id of a server with the default dtype (the session's model is float32); the
    # engine is not started: only its id is read.
    model = Settings().model
    dtype, storage = resolve_dtype(effective_dtype(model.dtype, model.model))  # auto on the embedded: gguf
    default = dataclasses.replace(smol, dtype=dtype, weight_storage=storage)
    model_id = Engine(default, EngineSettings(kv_budget_mb=64)).feature_model_id
    root = Path(__file__).resolve().parents[2]
    settings = Settings()
    settings.tasks.plugin_dirs = [str(root / "plugins")]
    registry, errors = load_registry(settings, smol.tokenizer)
    assert errors == []
    for name, variants in (("sentiment", 2), ("intent", 2)):
        task = registry.get(name)
        assert isinstance(task, PromptTask) and task.task.head is not None
        fitted = Path(task.task.head.fitted or "")
        with np.load(fitted) as z:
            models = {str(z[k]) for k in z.files if k.endswith("/model")}
        if model_id not in models:
            pytest.skip(f"{fitted.name} holds heads for {models}, this machine runs {model_id}")
        caplog.clear()
        assert await task.prepare(NoFeatures(model_id), tmp_path, "local") is None
        assert sorted(task.heads) == list(range(-1, variants - 1)) and "has no head" not in caplog.text


# -- on the real model -------------------------------------------------------------------------------


class Counting:
    """The engine, counting feature computations (a cached start computes none)."""

    def __init__(self, engine: Engine):
        self.engine, self.feature_calls = engine, 0
        self.feature_model_id = engine.feature_model_id

    async def score(self, prompt, candidates, *, normalize=True, public_tokens=0):
        return await self.engine.score(prompt, candidates, normalize=normalize)

    async def score_features(self, prompt, candidates, *, features_from, public_tokens=0):
        self.feature_calls += 1
        return await self.engine.score_features(prompt, candidates, features_from=features_from)


@pytest.mark.slow
async def test_head_end_to_end_on_the_engine_with_cached_features(smol, tmp_path):
    examples = write_examples(tmp_path / "ex.jsonl", EXAMPLES)
    spec = LearnedHead(examples, labels={"pos": "positive", "neg": "negative"}, l2=1e-2)
    engine = Engine(smol, EngineSettings(kv_budget_mb=64))
    engine.start()
    try:
        counting = Counting(engine)
        assert isinstance(counting, FeatureScorer)
        task = PromptTask(sentiment_task(spec), smol.tokenizer)
        assert await task.prepare(counting, tmp_path / "cache", "local") is None
        assert list(task.heads) == [-1] and counting.feature_calls == len(EXAMPLES)
        assert len(list((tmp_path / "cache").glob("*.npy"))) == 1
        again = PromptTask(sentiment_task(spec), smol.tokenizer)
        await again.prepare(counting, tmp_path / "cache", "local")
        assert counting.feature_calls == len(EXAMPLES)  # read from the cache: nothing computed
        for text, want in (("I love it (0)", "positive"), ("A waste of money (2)", "negative")):
            out = await again.run(counting, text)
            assert out.output["label"] == want  # training examples: the head separates them
            assert math.isclose(sum(out.output["probs"].values()), 1.0, rel_tol=1e-9)
        assert counting.feature_calls == len(EXAMPLES) + 2  # a call: one forward, with its features
        # Another prompt (or model, or data) is another cache entry.
        other = PromptTask(sentiment_task(spec), smol.tokenizer)
        other.task.prompt = "Review: {text}\nSentiment:"
        await other.prepare(counting, tmp_path / "cache", "local")
        assert len(list((tmp_path / "cache").glob("*.npy"))) == 2
    finally:
        await engine.stop()


async def test_registry_drops_a_task_whose_examples_are_broken(smol, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n", encoding="utf-8")
    good = PromptTask(sentiment_task(), smol.tokenizer)
    broken = PromptTask(sentiment_task(LearnedHead(bad)), smol.tokenizer)
    registry = TaskRegistry({"mood": good, "broken": broken}, ["broken"])

    class Local:
        feature_model_id = "x"

        async def score(self, *a, **k):
            raise AssertionError("not reached")

        async def score_features(self, *a, **k):
            raise AssertionError("not reached")

    errors = await registry.prepare(lambda name: ("local", Local()), tmp_path)
    assert len(errors) == 1 and errors[0].source == "task broken"
    assert errors[0].reason.startswith(f"learned head: {bad}:1: expected")
    assert registry.names() == ["mood"] and registry.auto_tasks == []
