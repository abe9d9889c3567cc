"""Plugins that declare `output=JSONSchema(...)` (or a regex): loaded, compiled at start-up, run to a
parsed and valid value; formats that cannot compile are reported naming the plugin or task."""

from __future__ import annotations

import jsonschema
import pytest

from rtserver.config import EngineSettings
from rtserver.engine.core import Engine
from rtserver.tasks import JSONSchema, Task, TaskError
from rtserver.tasks.registry import load_registry
from rtserver.tasks.run import PromptTask

from .test_tasks import settings, write

EXTRACT = """
from rtserver.tasks import JSONSchema, Task
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "mood": {"enum": ["angry", "calm"]},
    },
    "required": ["order_id", "mood"],
    "additionalProperties": False,
}
TASK = Task(name="fields", description="order fields", max_new_tokens=40,
            prompt="Extract the order id and the mood as JSON from: {text}", output=JSONSchema(SCHEMA))
"""
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "mood": {"enum": ["angry", "calm"]},
    },
    "required": ["order_id", "mood"],
    "additionalProperties": False,
}


@pytest.fixture
async def engine(smol):
    eng = Engine(smol, EngineSettings(kv_budget_mb=64))
    eng.start()
    yield eng
    await eng.stop()


def backends(engine):
    return lambda name: ("local", engine)


async def test_a_json_schema_task_answers_with_the_parsed_valid_value(tmp_path, smol, engine):
    write(tmp_path, "fields.py", EXTRACT)
    registry, errors = load_registry(settings(str(tmp_path)), smol.tokenizer)
    assert errors == []
    assert await registry.prepare_outputs(backends(engine)) == []
    described = {d["name"]: d for d in registry.describe()}["fields"]
    assert described["format"] == {"type": "json_schema", "schema": SCHEMA}
    for text in ("Order QW-1234 is late and I am furious!", "No rush, order AB-0001 can wait."):
        out = await registry.run(engine, "fields", {"text": text})
        jsonschema.validate(out.output, SCHEMA)
        assert out.text.startswith("{") and out.usage["generated_tokens"] <= 40


async def test_a_task_cut_by_its_token_limit_says_so(smol, engine):
    task = Task(
        name="short",
        description="x",
        prompt="JSON about: {text}",
        max_new_tokens=3,
        output=JSONSchema(SCHEMA),
    )
    task.validate()
    with pytest.raises(TaskError) as exc:
        await PromptTask(task, smol.tokenizer).run(engine, {"text": "order AB-1234"})
    assert exc.value.code == "output_truncated"
    assert "reached 3 tokens before its json_schema was complete" in exc.value.message


def test_a_format_that_cannot_compile_is_reported_naming_the_plugin(tmp_path, smol):
    bad = write(tmp_path, "bad.py", EXTRACT.replace('"pattern": "^[A-Z]{2}-[0-9]{4}$"', '"format": "nope"'))
    both = write(
        tmp_path,
        "both.py",
        "from rtserver.tasks import Choices, JSONSchema, Task\n"
        "TASK = Task(name='both', description='x', choices=Choices({'a': ' a', 'b': ' b'}),\n"
        "            output=JSONSchema({'type': 'object'}))\n",
    )
    wrong = write(
        tmp_path,
        "wrong.py",
        "from rtserver.tasks import Task\n"
        "TASK = Task(name='wrong', description='x', output={'type': 'object'})\n",
    )
    registry, errors = load_registry(settings(str(tmp_path)), smol.tokenizer)
    assert registry.names() == []
    reasons = {e.source: e.reason for e in errors}
    assert "output: json_schema:" in reasons[str(bad)] and "nope" in reasons[str(bad)]
    assert "a scoring task (with choices) generates no text" in reasons[str(both)]
    assert "expected JSONSchema({...}), Regex('...') or Grammar('...')" in reasons[str(wrong)]


async def test_a_backend_that_cannot_constrain_output_drops_the_task_by_name(tmp_path, smol):
    class Remote:  # what the registry sees of a backend without StructuredOutput
        pass

    write(tmp_path, "fields.py", EXTRACT)
    registry, _ = load_registry(settings(str(tmp_path)), smol.tokenizer)
    errors = await registry.prepare_outputs(lambda name: ("remote", Remote()))
    assert [str(e) for e in errors] == [
        "task fields: output format: its backend cannot constrain output (only the local engine can)"
    ]
    assert registry.names() == []
