"""Structured output on the engine: every finished generation under the test schemas parses and
validates (greedy and sampled, the embedded model and a random one); the mask the sampler applies is
llguidance's own at every step of a recorded run; formats that cannot compile are refused by name."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from rtbench.structured_bench import SCHEMAS, TEXTS, generate_checked, instruction
from rtserver.engine import sampler as sampler_module
from rtserver.engine.backend import (
    FinishReason,
    OutputFormat,
    OutputFormatError,
    SamplingError,
    SamplingParams,
)
from rtserver.engine.core import Engine
from rtserver.engine.grammar import Constraint, GrammarConstraint, apply_masks
from rtserver.engine.output_format import JSON_OPTIONS, MAX_SOURCE_CHARS

from ..conftest import chat_prompt


@pytest.fixture
async def smol_engine(smol):
    eng = Engine(smol)
    eng.start()
    yield eng
    await eng.stop()


def picks(tokenizer, texts: list[str], seeds: list[int | None]) -> list:
    """Every schema with every text, once greedy (seed None) and once per seed at temperature 0.7."""
    return [
        (name, chat_prompt(tokenizer, instruction(name, text)), 0.0 if seed is None else 0.7, seed)
        for name in SCHEMAS
        for text in texts
        for seed in seeds
    ]


def assert_all_valid(checked, at_least_finished: float) -> None:
    invalid = [(c.schema, c.text) for c in checked if c.finished and not c.valid]
    assert not invalid, invalid
    for name in SCHEMAS:
        mine = [c for c in checked if c.schema == name]
        assert sum(c.finished for c in mine) >= at_least_finished * len(mine), (name, [c.text for c in mine])


async def test_the_embedded_model_writes_valid_json_for_every_schema(smol_engine, smol):
    """72 generations (6 schemas x 4 texts, greedy and two seeds at 0.7): each finished one parses and
    validates (jsonschema, formats checked); nearly all finish within 160 tokens."""
    checked = await generate_checked(smol_engine, picks(smol.tokenizer, TEXTS[:4], [None, 1, 2]), 160)
    assert len(checked) == 72
    assert_all_valid(checked, at_least_finished=0.5)


async def test_a_random_model_is_held_to_every_schema_and_ends_within_its_limit(tiny_qwen2):
    """Random weights pick tokens the model would never pick: the grammar alone keeps the text valid,
    and steering to closing tokens near the limit ends every text complete
    (6 schemas x 3 texts x 6 draws = 108 generations)."""
    eng = Engine(tiny_qwen2)
    eng.start()
    try:
        checked = await generate_checked(
            eng, picks(tiny_qwen2.tokenizer, TEXTS[:3], [None, 1, 2, 3, 4, 5]), 120
        )
    finally:
        await eng.stop()
    assert_all_valid(checked, at_least_finished=1.0)


UNBOUNDED = {
    "type": "object",
    "properties": {
        "note": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "meta": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
    "required": ["note", "tags", "score"],
    "additionalProperties": False,
}


async def test_unbounded_strings_numbers_and_arrays_still_end_valid_at_a_short_limit(tiny_qwen2):
    """Nothing in this schema bounds its length; at 64 tokens and temperature 1.0 every random-model
    text still ends by its end-of-sequence token, complete and valid."""
    import jsonschema

    eng = Engine(tiny_qwen2)
    eng.start()
    fmt = OutputFormat.json_schema(UNBOUNDED)
    prompt = chat_prompt(tiny_qwen2.tokenizer, "Describe the ticket as JSON.")
    try:
        streams = [
            eng.generate(prompt, SamplingParams(max_new_tokens=64, temperature=1.0, seed=s, output=fmt))
            for s in range(24)
        ]
        results = [await s.result() for s in streams]
    finally:
        await eng.stop()
    for r in results:
        assert r.finish_reason is FinishReason.EOS, (r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), UNBOUNDED)


async def test_the_sampler_applies_llguidances_own_mask_at_every_step(smol_engine, smol, monkeypatch):
    """Two sampled generations in one batch: at every step, the tokens left finite in each row are
    exactly those of llguidance's own mask (its own tokenizer and matcher, replayed along the tokens
    the engine sampled), end-of-sequence included where the text is complete."""
    tok = smol.tokenizer
    seen: dict[int, list[np.ndarray]] = {}
    real = sampler_module.apply_masks

    def recording(constraints: list[Constraint], logits: torch.Tensor):
        errors = real(constraints, logits)
        for i, c in enumerate(constraints):
            if isinstance(c, GrammarConstraint):
                seen.setdefault(id(c), []).append(torch.isfinite(logits[i]).numpy().copy())
        return errors

    monkeypatch.setattr(sampler_module, "apply_masks", recording)
    schema = SCHEMAS["ticket"]
    fmt = OutputFormat.json_schema(schema)
    # A limit far above the text's length: the mask is never steered to closing tokens here.
    params = [SamplingParams(max_new_tokens=400, temperature=0.7, seed=s, output=fmt) for s in (3, 4)]
    prompt = chat_prompt(tok, instruction("ticket", TEXTS[0]))
    streams = [smol_engine.generate(prompt, p) for p in params]
    results = [await s.result() for s in streams]
    runs = [seen[id(s.seq.constraint)] for s in streams]

    vocab = smol_engine.runner.vocab_size
    own_tokenizer = llguidance.hf.from_tokenizer(
        tok, n_vocab=vocab, eos_token=sorted(smol_engine.eos_token_ids)
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    steps = 0
    for result, masks in zip(results, runs):
        assert len(masks) == len(result.token_ids) > 5
        matcher = llguidance.LLMatcher(own_tokenizer, grammar)
        for token, mask in zip(result.token_ids, masks):
            words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            own = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            assert np.array_equal(mask, own), f"step {steps}: {np.flatnonzero(mask != own)[:10]}"
            assert own[token]
            assert matcher.consume_token(token), matcher.get_error()
            steps += 1
        assert result.finish_reason is FinishReason.EOS and json.loads(result.text)
    assert steps > 20


async def test_regex_and_lark_formats_are_matched_whole(smol_engine, smol):
    tok = smol.tokenizer
    prompt = chat_prompt(tok, "Give me a phone number.")
    regex = OutputFormat.regex(r"\+[0-9]{2} [0-9]{3} [0-9]{4}")
    lark = OutputFormat.lark('start: "yes" | "no" | "maybe, " NUMBER\nNUMBER: /[0-9]{1,3}/')
    for temperature in (0.0, 1.0):
        r = await smol_engine.generate(
            prompt, SamplingParams(temperature=temperature, seed=1, output=regex)
        ).result()
        assert re.fullmatch(r"\+[0-9]{2} [0-9]{3} [0-9]{4}", r.text), r.text
        r = await smol_engine.generate(
            prompt, SamplingParams(temperature=temperature, seed=1, output=lark)
        ).result()
        assert re.fullmatch(r"yes|no|maybe, [0-9]{1,3}", r.text), r.text
        assert r.finish_reason is FinishReason.EOS


async def test_formats_that_cannot_compile_are_refused_at_submit_with_the_reason(smol_engine, smol):
    prompt = chat_prompt(smol.tokenizer, "Hi")

    def submit(fmt: OutputFormat):
        return smol_engine.generate(prompt, SamplingParams(output=fmt))

    with pytest.raises(SamplingError, match="output: the JSON Schema is not JSON"):
        submit(OutputFormat.json_schema("{not json"))
    with pytest.raises(SamplingError, match=f"at most {MAX_SOURCE_CHARS} characters"):
        submit(OutputFormat.json_schema({"enum": ["x" * MAX_SOURCE_CHARS]}))
    with pytest.raises(SamplingError, match="kind 'yaml'"):
        submit(OutputFormat("yaml", "a: 1"))
    with pytest.raises(OutputFormatError, match="json_schema: .*no-such-format"):
        submit(OutputFormat.json_schema({"type": "string", "format": "no-such-format"}))
    with pytest.raises(OutputFormatError, match="regex"):
        submit(OutputFormat.regex("(unclosed"))
    with pytest.raises(OutputFormatError, match="lark"):
        await smol_engine.prepare_output(OutputFormat.lark("start: undefined_rule"))
    assert len(smol_engine.scheduler.waiting) == 0  # nothing was queued
    # the engine serves on: a valid format right after
    r = await submit(OutputFormat.json_schema(SCHEMAS["mood"])).result()
    assert r.finish_reason is FinishReason.LENGTH or json.loads(r.text)["label"] in (
        "positive",
        "negative",
        "neutral",
    )


def test_a_row_whose_grammar_fails_is_the_only_one_that_fails():
    """A matcher in its error state fails its own row; the free and healthy rows are untouched."""

    class Broken(Constraint):
        active = True

        def fill(self, words):
            raise RuntimeError("grammar broke")

    logits = torch.randn(3, 64)
    before = logits.clone()
    errors = apply_masks([Constraint(), Broken(), Constraint()], logits)
    assert errors[0] is None and errors[2] is None and "grammar broke" in str(errors[1])
    assert torch.equal(logits, before)
