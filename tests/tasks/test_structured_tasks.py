"""Plugins that declare `output=JSONSchema(...)` (or a regex): loaded, compiled at start-up, run to a
parsed and valid value; formats that cannot compile are reported naming the plugin or task."""

from __future__ import annotations

import jsonschema
import pytest

from rtserver.tasks import JSONSchema, Task, TaskError
from rtserver.tasks.registry import load_registry
from rtserver.tasks.run import PromptTask

from .test_tasks import settings, write

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "mood": {"enum": ["angry", "calm"]},
    },
    "required": ["order_id", "mood"],
    "additionalProperties": False,
}
EXTRACT = f"""
from rtserver.tasks import JSONSchema, Task
SCHEMA = {SCHEMA!r}
TASK = Task(name="fields", description="order fields", max_new_tokens=40,
            prompt="Extract the order id and the mood as JSON from: {{text}}", output=JSONSchema(SCHEMA))
"""


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
    bad = write(tmp_path, "bad.py", EXTRACT.replace("'pattern': '^[A-Z]{2}-[0-9]{4}$'", "'format': 'nope'"))
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


TRANSCRIPT = (
    "Customer: Hi, my order AB-1234 still hasn't arrived and it has been two weeks.\n"
    "Bot: I'm sorry to hear that. Could you give me your e-mail address?\n"
    "Customer: It's jane.doe@example.com. I ordered a blue kettle.\n"
    "Agent: Thanks Jane, I'm checking with the courier now.\n"
    "Customer: This is the second time this happens, I'm really upset."
)


async def test_the_assist_tasks_answer_valid_json_at_assist_priority(smol, engine):
    """summarize and extract (the built-in plugins) answer values that validate under their own
    schemas; suggest_reply answers drafts drawn side by side; translate answers text."""
    from .test_tasks import BUILTIN

    registry, errors = load_registry(
        settings(BUILTIN, task={"extract": {"fields": {"order": "/^[A-Z]{2}-[0-9]{4}$/", "email": "email"}}}),
        smol.tokenizer,
    )
    assert errors == []
    assert await registry.prepare_outputs(backends(engine)) == []
    for name in ("summarize", "extract"):
        task = registry.get(name).task
        assert task.sampling(None).priority.name == "ASSIST"
        out = await registry.run(engine, name, {"text": TRANSCRIPT})
        jsonschema.validate(out.output, task.output.schema)
    assert set(out.output) == {"order", "email"}
    # three drafts drawn side by side with their own seeds; the same seed gives the same drafts
    first = await registry.run(engine, "suggest_reply", {"text": TRANSCRIPT}, {"seed": 7})
    again = await registry.run(engine, "suggest_reply", {"text": TRANSCRIPT}, {"seed": 7})
    drafts = [d["text"] for d in first.output["samples"]]
    assert 1 <= len(drafts) <= 3 and all("\n" not in d for d in drafts)
    assert first.output == again.output and first.usage["generated_tokens"] <= 3 * 64
    translated = await registry.run(engine, "translate", {"text": "Bonjour, où est ma commande ?"})
    assert translated.text and "\n\n" not in translated.text


def test_assist_task_options_are_checked(smol):
    from .test_tasks import BUILTIN

    registry, errors = load_registry(
        settings(
            BUILTIN,
            task={
                "extract": {"fields": {"order": "/[unclosed/"}},
                "suggest_reply": {"drafts": 9},
                "translate": {"to": "Eng<lish>"},
            },
        ),
        smol.tokenizer,
    )
    reasons = " | ".join(str(e) for e in errors)
    assert "fields.order: '/[unclosed/' is not a regular expression" in reasons
    assert "drafts = 9: an integer 1..5" in reasons
    assert "to = 'Eng<lish>': a language name" in reasons
    assert not {"extract", "suggest_reply", "translate"} & set(registry.names())


async def test_drafts_on_a_live_conversation_continue_its_own_prompt_and_kv(smol, engine):
    """suggest_reply on a conversation whose session this engine holds: the prompt is the chat's
    own next-turn prompt, its KV comes from the session, and the session's next turn keeps it."""
    from rtserver.tasks.chat import Conversation

    from .test_tasks import BUILTIN

    registry, errors = load_registry(settings(BUILTIN), smol.tokenizer)
    assert errors == []
    chat = registry.chat
    turn = chat.prepare_turn([], "Hi, my order AB-1234 is two weeks late. Where is it?")
    params = chat.task.sampling(None)
    params.max_new_tokens = 12
    reply = await engine.generate(
        turn.prompt_ids, params, session_key="c1", public_tokens=turn.public_tokens
    ).result()
    history = [*turn.history, {"role": "assistant", "content": reply.text}]
    last = chat.finished_turn(turn.rendered, turn.prompt_ids, reply.text, reply.token_ids)
    assert last is not None
    live = Conversation(history, last, "c1")
    out = await registry.run(engine, "suggest_reply", {"text": TRANSCRIPT}, {"seed": 3}, conversation=live)
    again = await registry.run(engine, "suggest_reply", {"text": TRANSCRIPT}, {"seed": 3}, conversation=live)
    drafts = [d["text"] for d in out.output["samples"]]
    assert 1 <= len(drafts) <= 3 and all("\n" not in d for d in drafts) and out.output == again.output
    prompt = chat.continued(live, "")
    assert prompt is not None and prompt.ids == chat.encode(history, last).ids
    assert prompt.ids[: len(last.ids)] == last.ids
    assert out.usage["prompt_tokens"] == len(prompt.ids)
    assert out.usage["cached_tokens"] >= len(last.ids) - 1  # all the session computed of it
    # the transcript form computes its prompt instead (only the task's fixed prefix is cached)
    plain = await registry.run(engine, "suggest_reply", {"text": TRANSCRIPT}, {"seed": 3})
    assert plain.usage["prompt_tokens"] - plain.usage["cached_tokens"] > 40
    # an instruction goes after the conversation as a system message
    told = chat.continued(live, "Answer in French.")
    assert told is not None and told.ids[: len(prompt.ids) - 3] == prompt.ids[:-3]
    assert "<|im_start|>system\nAnswer in French.<|im_end|>" in smol.tokenizer.decode(told.ids)
    nxt = chat.prepare_turn(history, "Thanks, any news?", last)
    r2 = await engine.generate(nxt.prompt_ids, params, session_key="c1").result()
    assert r2.usage.cached_tokens >= len(last.ids) - 1
    # `continue_session = false`: the transcript prompt, live conversation or not
    registry, errors = load_registry(
        settings(BUILTIN, task={"suggest_reply": {"continue_session": False}}), smol.tokenizer
    )
    assert errors == []
    apart = await registry.run(engine, "suggest_reply", {"text": TRANSCRIPT}, {"seed": 3}, conversation=live)
    assert apart.usage["prompt_tokens"] == plain.usage["prompt_tokens"]
    registry, errors = load_registry(
        settings(BUILTIN, task={"suggest_reply": {"continue_session": 1}}), smol.tokenizer
    )
    assert "continue_session = 1: true or false" in str(errors[0])


def test_a_template_that_cannot_continue_a_conversation_falls_back_and_other_errors_surface(smol):
    """A chat template that refuses the conversation (roles must alternate) gives no conversation
    prompt, so the call reads the transcript; any other error is a bug and is not swallowed."""
    from jinja2.exceptions import TemplateError

    from rtserver.tasks.chat import ChatTask, Conversation

    from .test_tasks import BUILTIN

    registry, _ = load_registry(settings(BUILTIN), smol.tokenizer)
    live = Conversation([{"role": "user", "content": "Hi"}], None, "c1")

    class Refusing:
        def __init__(self, error: Exception):
            self.error = error

        def apply_chat_template(self, *args, **kwargs):
            raise self.error

    assert (
        ChatTask(registry.chat.task, Refusing(TemplateError("roles must alternate"))).continued(live, "")
        is None
    )
    with pytest.raises(RuntimeError):
        ChatTask(registry.chat.task, Refusing(RuntimeError("bug"))).continued(live, "")
