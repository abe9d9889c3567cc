"""The /ws protocol, server side: every event the server sends a client, declared as TypedDicts (their
JSON Schema is part of schema.py) and built by the functions below, so the wire format is defined in one
place. The agent console's own /ws/console events are in console/events.py. Reference: docs/protocol.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from ..engine.backend import FinishReason, SequenceResult, Usage
from ..tasks import TaskOutput
from ..tasks.citations import Source
from .protocol import PROTOCOL_VERSION, ErrorCode

#
# The events as TypedDicts, for the schema (#/$defs/ServerEvent). The builders below make every one of
# them; tests/web/test_protocol.py checks a real session's events against it.


class UsageCounts(TypedDict):
    prompt_tokens: int
    cached_tokens: Annotated[int, Field(description="reused from the KV cache")]
    generated_tokens: int
    prefilled_tokens: int


class Timing(TypedDict):
    queued_ms: float
    ttft_ms: float | None
    total_ms: float


class HistoryMessage(TypedDict):
    role: Literal["user", "assistant"]
    content: str
    agent: NotRequired[Annotated[str, Field(description="the human agent who wrote this reply")]]


class ReadyEvent(TypedDict):
    """Answers `hello` (or a first message that is not one): the session, the server's limits, the tasks."""

    type: Literal["ready"]
    protocol: str
    session_id: str
    resume_token: str
    resumed: bool
    history_turns: int
    limits: dict[str, object]
    tasks: Annotated[list[dict[str, object]], Field(description="as GET /v1/tasks")]
    auto_tasks: list[str]
    history: Annotated[list[HistoryMessage], Field(description="the session's messages, oldest first")]
    agent: Annotated[str | None, Field(description="the human agent answering instead of the bot")]


class TokenEvent(TypedDict):
    """A non-empty text delta of the chat reply `id`."""

    type: Literal["token"]
    id: str
    text: str


class CitedSource(TypedDict):
    """An article a reply cited: its number in the prompt, title, url ("" = none) and id (its path)."""

    n: int
    title: str
    url: str
    id: str


class DoneEvent(TypedDict):
    """The chat reply `id` ended: its whole text and parsed output."""

    type: Literal["done"]
    id: str
    text: str
    output: dict[str, object]
    finish_reason: FinishReason
    usage: UsageCounts
    timing: Timing
    sources: NotRequired[
        Annotated[
            list[CitedSource], Field(description="knowledge on: the articles the reply cited, in order")
        ]
    ]
    unknown: NotRequired[
        Annotated[bool, Field(description='knowledge on: the reply is the "I don\'t know" sentence')]
    ]


class ResultEvent(TypedDict):
    """The answer of a `task` request, or of an auto-task on a chat message (`auto`)."""

    type: Literal["result"]
    id: str
    task: str
    output: dict[str, object]
    text: str
    usage: dict[str, object]
    timing: dict[str, object]
    cached: bool
    auto: NotRequired[bool]


class ErrorEvent(TypedDict):
    """A refused frame or a failed request (`id` when it belongs to one)."""

    type: Literal["error"]
    code: ErrorCode
    message: str
    id: NotRequired[str]
    busy_id: NotRequired[Annotated[str, Field(description="chat_busy: the turn in progress")]]
    retry_after_s: NotRequired[Annotated[float, Field(description="rate_limited: when to retry")]]
    task: NotRequired[Annotated[str, Field(description="an auto-task's failure: the task")]]
    auto: NotRequired[bool]


class PongEvent(TypedDict):
    type: Literal["pong"]
    data: NotRequired[object]


class ResetEvent(TypedDict):
    """The session's history was cleared."""

    type: Literal["reset"]
    session_id: str


class ShuttingDownEvent(TypedDict):
    """The server is stopping: requests still running after `deadline_s` end with `error shutting_down`."""

    type: Literal["shutting_down"]
    deadline_s: float


class HandoverEvent(TypedDict):
    """A human agent took the session over (`to: "agent"`) or handed it back (`to: "bot"`)."""

    type: Literal["handover"]
    to: Literal["agent", "bot"]
    agent: str | None


class AgentMessageEvent(TypedDict):
    """A reply written by a human agent."""

    type: Literal["agent_message"]
    text: str
    agent: str


class ForwardedEvent(TypedDict):
    """The chat `id` went to the human agent holding the session: no bot reply follows."""

    type: Literal["forwarded"]
    id: str
    agent: str | None


class HandoffEvent(TypedDict):
    """The session waits for a person (`waiting`: the bot no longer answers), or no longer (`ended`)."""

    type: Literal["handoff"]
    state: Literal["waiting", "ended"]
    out_of_hours: Annotated[bool, Field(description="nobody answers now: offer the e-mail form")]
    email: Annotated[str | None, Field(description="the e-mail left for a person (handoff_email)")]


class QueuePositionEvent(TypedDict):
    """While waiting for a person: the session's place among the conversations waiting, 1 = next."""

    type: Literal["queue_position"]
    position: int
    agents_online: Annotated[int, Field(description="agents signed in to the console, all nodes")]


ServerEvent = (
    ReadyEvent
    | TokenEvent
    | DoneEvent
    | ResultEvent
    | ErrorEvent
    | PongEvent
    | ResetEvent
    | ShuttingDownEvent
    | HandoverEvent
    | AgentMessageEvent
    | ForwardedEvent
    | HandoffEvent
    | QueuePositionEvent
)


Event = dict[str, object]  # one server event as a client receives it: a JSON object


def dumps(event: Event) -> str:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


def ready_event(
    session_id: str,
    resume_token: str,
    resumed: bool,
    history_turns: int,
    limits: dict[str, object],
    tasks: list[dict[str, object]],
    auto_tasks: list[str],
    history: Sequence[Mapping[str, object]] | None = None,
    agent: str | None = None,
) -> Event:
    """`history` (1.1): the session's messages, for a client to show what it resumed; `agent` (1.1): the
    name of the human agent answering instead of the bot, or None."""
    return {
        "type": "ready",
        "protocol": PROTOCOL_VERSION,
        "session_id": session_id,
        "resume_token": resume_token,
        "resumed": resumed,
        "history_turns": history_turns,
        "limits": limits,
        "tasks": tasks,
        "auto_tasks": auto_tasks,
        "history": [history_message(m) for m in history or ()],
        "agent": agent,
    }


def history_message(m: Mapping[str, object]) -> dict[str, object]:
    """A history entry as clients see it: {role, content} plus `agent` for a human agent's reply."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("agent"):
        out["agent"] = m["agent"]
    return out


def token_event(request_id: str, text: str) -> Event:
    return {"type": "token", "id": request_id, "text": text}


def usage_json(usage: Usage) -> dict[str, object]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "generated_tokens": usage.generated_tokens,
        "prefilled_tokens": usage.prefilled_tokens,
    }


def timing_json(result: SequenceResult) -> dict[str, object]:
    return {
        "queued_ms": round(result.queued_ms, 2),
        "ttft_ms": None if result.ttft_ms is None else round(result.ttft_ms, 2),
        "total_ms": round(result.total_ms, 2),
    }


def done_event(
    request_id: str,
    result: SequenceResult,
    output: dict[str, object],
    sources: Sequence[Source] | None = None,
    unknown: bool = False,
) -> Event:
    """`sources`: with knowledge on, the articles cited, and `unknown` with them."""
    event: Event = {
        "type": "done",
        "id": request_id,
        "text": result.text,
        "output": output,
        "finish_reason": result.finish_reason.value,
        "usage": usage_json(result.usage),
        "timing": timing_json(result),
    }
    if sources is not None:
        event["sources"] = [s.json() for s in sources]
        event["unknown"] = unknown
    return event


def result_event(request_id: str, out: TaskOutput, auto: bool = False) -> Event:
    event: Event = {
        "type": "result",
        "id": request_id,
        "task": out.task,
        "output": out.output,
        "text": out.text,
        "usage": out.usage,
        "timing": out.timing,
        "cached": out.cached,
    }
    if auto:
        event["auto"] = True
    return event


def error_event(code: str, message: str, request_id: str | None = None, **extra: object) -> Event:
    event: Event = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        event["id"] = request_id
    event.update(extra)
    return event


def pong_event(data: object = None) -> Event:
    event: Event = {"type": "pong"}
    if data is not None:
        event["data"] = data
    return event


def reset_event(session_id: str) -> Event:
    return {"type": "reset", "session_id": session_id}


def shutting_down_event(deadline_s: float) -> Event:
    return {"type": "shutting_down", "deadline_s": deadline_s}


def handover_event(agent: str | None) -> Event:
    """To the agent named, or back to the bot when `agent` is None."""
    return {"type": "handover", "to": "bot" if agent is None else "agent", "agent": agent}


def agent_message_event(text: str, agent: str) -> Event:
    return {"type": "agent_message", "text": text, "agent": agent}


def forwarded_event(request_id: str, agent: str | None) -> Event:
    return {"type": "forwarded", "id": request_id, "agent": agent}


def handoff_event(waiting: bool, out_of_hours: bool = False, email: str | None = None) -> Event:
    return {
        "type": "handoff",
        "state": "waiting" if waiting else "ended",
        "out_of_hours": out_of_hours,
        "email": email,
    }


def queue_position_event(position: int, agents_online: int) -> Event:
    return {"type": "queue_position", "position": position, "agents_online": agents_online}
