"""Action declarations, rules, the call guard and `call` (rtserver/tasks/actions.py), the registry's
action plugins, and the console's `action` event; no model."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from rtserver.config import Settings
from rtserver.tasks import Action, Rule
from rtserver.tasks.actions import FAILED_REPLY, TIMEOUT_REPLY, ActionError, call, looks_like_call
from rtserver.tasks.registry import load_registry
from rtserver.web.console import events as ce
from rtserver.web.console.assist import transcript
from rtserver.web.console.conversation import MAX_CALL_PART_BYTES, action_call
from rtserver.web.schema import console_schema

SCHEMA = {
    "type": "object",
    "properties": {"order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}},
    "required": ["order_id"],
    "additionalProperties": False,
}
RULE = Rule(fields={"order_id": r"\b([A-Za-z]{2}-\d{3,8})\b"}, intents=("shipping",), upper=("order_id",))


def action(handler=None, **extra) -> tuple[Action, list[dict]]:
    """An order action whose handler records its arguments."""
    seen: list[dict] = []

    async def record(arguments: dict) -> dict:
        seen.append(arguments)
        return {"status": "shipped"}

    fields = {"name": "order", "description": "An order's status.", "parameters": SCHEMA, "rule": RULE}
    return Action(handler=handler or record, **{**fields, **extra}), seen


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"name": "Order-Status"}, "lowercase"),
        ({"description": ""}, "description"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"timeout_s": 600}, "timeout_s"),
        ({"parameters": {"type": "string"}}, "type object"),
        ({"parameters": {"type": "object", "properties": {"a": {"type": 5}}}}, "type must be"),
        ({"parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "order.parameters"),
        ({"parameters": {"type": "object", "description": "x" * 20000}}, "the limit is"),
        ({"rule": Rule(fields={"nope": "x"})}, "not one of the parameters"),
        ({"rule": Rule(fields={})}, "required order_id"),
        ({"rule": Rule(fields={"order_id": "("})}, "not a regular expression"),
        ({"reply": "{order_id.__class__}"}, "only plain names"),
        ({"reply": 5}, "template string or a function"),
    ],
)
def test_a_declaration_that_cannot_be_used_is_refused_naming_what(change, says):
    with pytest.raises(ActionError, match=says):
        action(**change)


def test_a_rule_reads_its_fields_and_fires_on_words():
    rule = Rule(fields=RULE.fields, words=r"\bwhere\b", upper=("order_id",))
    assert rule.extract("where is #ab-1234?") == {"order_id": "AB-1234"}
    assert rule.extract("where is it?") == {}
    assert rule.words_match("WHERE is it") and not rule.words_match("refund please")


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "order", "arguments": {"order_id": "AB-1234"}}',
        '<tool_call>{"name": "x"}</tool_call>',
        "< / tool_call >",
        '{"function": {"arguments": "{}"}}',
        "<|python_tag|>order.call(order_id='AB-1234')",
        "[TOOL_CALLS] order",
        "please run order(order_id='AB-1234')",  # names an action
        '"tool_calls": []',
    ],
)
def test_text_that_looks_like_a_call_is_recognised(text):
    assert looks_like_call(text, ("order",))


@pytest.mark.parametrize("text", ["Where is my order AB-1234?", "My name is Bob", "I called yesterday"])
def test_ordinary_messages_are_not_calls(text):
    assert not looks_like_call(text, ("order_status",))


async def test_valid_arguments_reach_the_handler_and_make_the_reply():
    act, seen = action(reply="Order {order_id}: {status}.")
    out = await call(act, {"order_id": "AB-1234"})
    assert out.ok and out.reply == "Order AB-1234: shipped." and seen == [{"order_id": "AB-1234"}]
    assert out.to_json()["result"] == {"status": "shipped"} and out.ms >= 0


@pytest.mark.parametrize(
    "arguments",
    [{"order_id": "AB-123456"}, {"order_id": 1234}, {}, {"order_id": "AB-1234", "extra": 1}, ["AB-1234"]],
)
async def test_arguments_the_schema_refuses_never_reach_the_handler(arguments):
    act, seen = action()
    out = await call(act, arguments)
    assert out.status == "invalid_arguments" and out.reply == act.invalid_reply and out.error
    assert seen == []


async def test_a_slow_or_failing_handler_gives_a_sentence_and_never_raises():
    async def slow(arguments: dict) -> dict:
        await asyncio.sleep(30)
        return {}

    async def boom(arguments: dict) -> dict:
        raise ConnectionError("shop down at 10.0.0.5")

    async def not_json(arguments: dict) -> object:
        return {"when": object()}

    async def huge(arguments: dict) -> dict:
        return {"text": "x" * 10_000}

    args = {"order_id": "AB-1234"}
    out = await call(action(slow, timeout_s=0.1)[0], args)
    assert out.status == "timeout" and out.reply == TIMEOUT_REPLY and 90 <= out.ms < 5000
    out = await call(action(boom)[0], args)
    assert out.status == "failed" and out.reply == FAILED_REPLY and "ConnectionError" in out.error
    assert "10.0.0.5" not in out.reply  # the cause is for agents, not the customer
    for handler in (not_json, huge):
        out = await call(action(handler)[0], args)
        assert out.status == "invalid_result" and out.reply == FAILED_REPLY
    out = await call(action(reply="{missing}")[0], args)
    assert out.status == "invalid_result" and out.reply == FAILED_REPLY


def test_the_example_plugin_loads_with_its_table_and_a_bad_table_is_reported(smol):
    settings = Settings()
    settings.tasks.plugin_dirs, settings.tasks.auto_tasks = ["examples/plugins"], []
    settings.tasks.learned_heads = False
    settings.task = {"order_status": {"shop_url": "http://127.0.0.1:9", "timeout_s": 2.0}}
    registry, errors = load_registry(settings, smol.tokenizer)
    assert errors == [] and registry.actions["order_status"].timeout_s == 2.0
    settings.task = {"order_status": {"shop_url": "ftp://x", "colour": "red"}}
    registry, errors = load_registry(settings, smol.tokenizer)
    assert "order_status" not in registry.actions
    assert any("invalid action" in str(e) and "colour" in str(e) for e in errors), errors


def test_the_console_action_event_is_bounded_and_matches_its_schema():
    shown = action_call(
        {"action": "order", "status": "ok", "arguments": {"order_id": "AB-1234"}, "result": {"t": "x" * 5000}}
    )
    assert shown["arguments"] == {"order_id": "AB-1234"} and isinstance(shown["result"], str)
    assert len(shown["result"].encode()) <= MAX_CALL_PART_BYTES
    schema = json.loads(json.dumps(console_schema()))
    events = jsonschema.Draft202012Validator({"$defs": schema["$defs"], "$ref": "#/$defs/ConsoleServerEvent"})
    event = ce.action("s", {"seq": 2, "role": "action", "text": "order ok", "call": shown}, 1.5)
    assert events.is_valid(json.loads(json.dumps(event)))


def test_the_assist_transcript_leaves_action_calls_out():
    messages = [
        {"role": "user", "text": "Where is AB-1234?"},
        {"role": "action", "text": "order ok", "call": {}},
        {"role": "bot", "text": "Shipped."},
    ]
    assert transcript(messages) == "Customer: Where is AB-1234?\nBot: Shipped."


def test_unless_keeps_a_rule_from_firing_and_must_be_a_regular_expression():
    rule = Rule(fields=RULE.fields, words=r"\bwhere\b", unless=r"\brefund")
    assert rule.excluded("Where is my REFUND for AB-1234?") and not rule.excluded("Where is AB-1234?")
    with pytest.raises(ActionError, match="rule unless"):
        action(rule=Rule(fields=RULE.fields, unless="("))
