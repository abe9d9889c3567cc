"""`rtserver bench --workloads structured`: JSON Schema output on the engine. How many of 1,000
generations across the test schemas parse and validate (greedy and temperature 0.7), and what the
grammar's mask costs per token beside a batch-1 decode step.

`SCHEMAS` and `TEXTS` are also the tests' set (tests/engine/test_structured.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rtserver.engine.backend import FinishReason, OutputFormat, SamplingParams, SequenceResult
from rtserver.engine.core import Engine
from rtserver.engine.grammar import apply_masks

from .stats import known, mean, percentile

ChatIds = Callable[[str], list[int]]
MAX_NEW_TOKENS = 384  # room for the longest text the schemas allow (a number's digits are unbounded)

# Each kind of constraint the issue names: nested objects, enums, arrays, bounded numbers, patterns.
SCHEMAS: dict[str, dict[str, Any]] = {
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
            "email": {"type": "string", "format": "email", "maxLength": 40},
            "product": {"type": "string", "maxLength": 30},
        },
        "required": ["order_id", "email", "product"],
        "additionalProperties": False,
    },
    "ticket": {
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 24},
                    "contact": {
                        "type": "object",
                        "properties": {"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}},
                        "required": ["phone"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "contact"],
                "additionalProperties": False,
            },
            "priority": {"enum": ["low", "normal", "high"]},
        },
        "required": ["customer", "priority"],
        "additionalProperties": False,
    },
    "mood": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    },
    "items": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string", "maxLength": 20},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                    },
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "rating": {
        "type": "object",
        "properties": {
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "recommend": {"type": "boolean"},
            "topics": {
                "type": "array",
                "maxItems": 4,
                "items": {"enum": ["price", "quality", "delivery", "support"]},
            },
        },
        "required": ["stars", "recommend", "topics"],
        "additionalProperties": False,
    },
    "drafts": {
        "type": "object",
        "properties": {
            "drafts": {
                "type": "array",
                "minItems": 2,
                "maxItems": 3,
                "items": {"type": "string", "minLength": 1, "maxLength": 100},
            }
        },
        "required": ["drafts"],
        "additionalProperties": False,
    },
}

TEXTS = [
    "Hi, my order AB-1234 hasn't arrived. I'm Jane, jane.doe@example.com, +4915112345678.",
    "The kettle I bought is broken after two days. Terrible quality! Order KX-9921.",
    "Can I change my delivery address? Order number QT-0042, email sam@mail.org.",
    "Great service, the support team solved my problem in minutes. Five stars.",
    "I want to return 2 mugs and 1 teapot from order MN-5510. Call me at 0612345678.",
    "Why was I charged twice for my subscription? This is unacceptable.",
    "Thanks, the replacement headphones work perfectly.",
    "Do you ship to Canada? I'd like to order three lamps.",
    "My name is Li Wei, the blender from order ZZ-1000 is missing its lid. li.wei@example.cn",
    "Price is fine but the delivery took three weeks. Would not recommend.",
    "Please cancel order PP-7788 before it ships, my email is omar@host.net.",
    "The app keeps logging me out, I have tried reinstalling twice.",
    "I received a blue sofa instead of a grey one, order RT-3141.",
    "Hello, what are your opening hours on Sunday?",
    "Four bottles of olive oil arrived leaking. Please refund. Order OL-2024.",
    "Your chatbot is useless, I want to talk to a human now!",
    "Bought 5 notebooks and 2 pens, all good, quick delivery.",
    "Can you send me an invoice for order IN-0007 to billing@acme.io?",
    "The size chart was wrong, the shoes are too small.",
    "Love the new coffee beans, the quality is amazing.",
    "My parcel says delivered but nothing is at my door. Tom, +441632960123.",
]


def instruction(schema_name: str, text: str) -> str:
    """The user message of one generation: the task, the schema and the customer's text."""
    schema = json.dumps(SCHEMAS[schema_name])
    return f"Read the customer message and answer with JSON matching this schema: {schema}\n\nMessage: {text}"


def modes(count: int) -> list[tuple[str, str, float, int | None]]:
    """`count` generations as (schema, text, temperature, seed): every schema with every text,
    greedy first, then at temperature 0.7 with a new seed each round."""
    out: list[tuple[str, str, float, int | None]] = []
    rnd = 0
    while len(out) < count:
        for name in SCHEMAS:
            for text in TEXTS:
                out.append((name, text, 0.0, None) if rnd == 0 else (name, text, 0.7, rnd))
        rnd += 1
    return out[:count]


@dataclass
class Checked:
    """One generation's outcome: finished (its grammar complete) and, if so, whether it validates."""

    schema: str
    temperature: float
    finished: bool
    valid: bool
    token_ids: list[int]
    text: str


def validates(schema: dict[str, Any], text: str) -> bool:
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return not list(checker.iter_errors(value))


async def generate_checked(
    engine: Engine,
    prompts: list[tuple[str, list[int], float, int | None]],
    max_new_tokens: int,
    concurrency: int = 32,
) -> list[Checked]:
    """Each (schema name, prompt ids, temperature, seed) generated under its schema and checked,
    `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(name: str, ids: list[int], temperature: float, seed: int | None) -> Checked:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            output=OutputFormat.json_schema(SCHEMAS[name]),
        )
        async with gate:
            result = await engine.generate(ids, params).result()
        finished = result.finish_reason is FinishReason.EOS
        valid = finished and validates(SCHEMAS[name], result.text)
        return Checked(name, temperature, finished, valid, result.token_ids, result.text)

    return list(await asyncio.gather(*(one(*p) for p in prompts)))


def mask_cost_us(engine: Engine, runs: list[Checked]) -> list[float]:
    """Per token, the microseconds of masking at batch 1 as the sampler does it (fill the grammar's
    bitmask, mask a logits row) plus following the token, replayed along finished generations."""
    row = torch.zeros(1, engine.runner.vocab_size)
    costs: list[float] = []
    for run in runs:
        constraint = engine.grammars.constraint(
            OutputFormat.json_schema(SCHEMAS[run.schema]), engine.eos_token_ids, MAX_NEW_TOKENS
        )
        for token in run.token_ids:
            started = time.perf_counter()
            apply_masks([constraint], row)
            constraint.advance(token)
            costs.append((time.perf_counter() - started) * 1e6)
            row.zero_()
    return costs


def decode_step_ms(result: SequenceResult) -> float:
    """A generation's mean time per token after its first."""
    step_ms: float = (result.total_ms - (result.ttft_ms or 0.0)) / max(result.usage.generated_tokens - 1, 1)
    return step_ms


async def batch1_steps(engine: Engine, chat_ids: ChatIds) -> dict[str, float]:
    """Decode step time at batch 1, paired: each schema's reply alone, then free text of as many tokens
    on the same prompt; each side weighted by its tokens."""
    spent = {"free": 0.0, "constrained": 0.0}
    tokens = 0
    for name in SCHEMAS:
        ids = chat_ids(instruction(name, TEXTS[0]))
        fmt = OutputFormat.json_schema(SCHEMAS[name])
        r = await engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, output=fmt)).result()
        n = r.usage.generated_tokens
        f = await engine.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True)).result()
        spent["constrained"] += decode_step_ms(r) * (n - 1)
        spent["free"] += decode_step_ms(f) * (n - 1)
        tokens += n - 1
    return {k: v / max(tokens, 1) for k, v in spent.items()}


async def engine_structured(engine: Engine, chat_ids: ChatIds, count: int = 1000) -> dict[str, Any]:
    """`count` schema-constrained generations checked (32 at a time), then the batch-1 decode step
    with and without a schema, and the mask's own cost replayed along finished generations.
    `chat_ids` makes a prompt of one user message."""
    for name in SCHEMAS:
        await engine.prepare_output(OutputFormat.json_schema(SCHEMAS[name]))
    picks = modes(count)
    prompts = [(name, chat_ids(instruction(name, text)), t, seed) for name, text, t, seed in picks]
    started = time.perf_counter()
    checked = await generate_checked(engine, prompts, MAX_NEW_TOKENS)
    wall = time.perf_counter() - started
    finished = [c for c in checked if c.finished]
    steps = await batch1_steps(engine, chat_ids)
    await engine.stop()  # the replay below must not share the CPU with the scheduler's threads
    costs = mask_cost_us(engine, finished[:120])
    return {
        "generations": len(checked),
        "greedy": sum(c.temperature == 0 for c in checked),
        "sampled_t0.7": sum(c.temperature > 0 for c in checked),
        "finished": len(finished),
        "invalid_of_finished": sum(not c.valid for c in finished),
        "cut_by_token_limit": len(checked) - len(finished),
        "per_schema": {
            n: {
                "finished": sum(c.schema == n and c.finished for c in checked),
                "invalid": sum(c.schema == n and c.finished and not c.valid for c in checked),
            }
            for n in SCHEMAS
        },
        "wall_s": wall,
        "generated_tokens_per_s": sum(len(c.token_ids) for c in checked) / wall,
        "batch1_step_free_ms": steps["free"],
        "batch1_step_constrained_ms": steps["constrained"],
        "mask_us_per_token_mean": mean(costs),
        "mask_us_per_token_p95": percentile(costs, 0.95),
        "mask_share_of_batch1_step": known(mean(costs)) / 1000 / steps["free"],
        "examples": {c.schema: c.text for c in reversed(finished)},
    }
