"""Agent assist in the console: an agent's `assist` frame runs an assist task (reply drafts, summary,
fields, translation) on a conversation's messages and answers that agent alone; asked to, it streams
the replies' text first (`assist_delta`), so drafts show as they are written. An agent's reply is
translated (`translate_reply`) to the language a scoring task (`language`) finds in the customer's
last message.

The conversation is read where the console keeps it: this node's copy, or clustered the record in
Redis (written once a turn), so an agent on any node can ask about any conversation. A task with a
`conversation_prompt` on a session of this node continues the session's own prompt and KV instead
of reading a transcript. An agent may call the tasks for agents and not customers (`Task.audience`), at
`assist` priority (`tasks.declare.CALLER_PRIORITY`: customers' replies first); an agent has at most
`MAX_IN_FLIGHT` of them at once, and those still running end when its console closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from ...tasks import TaskError
from ...tasks.chat import Conversation
from ...tasks.declare import AGENTS, CUSTOMERS
from ...tasks.run import Deltas, no_deltas
from .. import events
from ..errors import error_code
from ..seams import ConsoleBus
from ..session import SessionRegistry
from ..state import AppState
from . import events as agent_events
from .agents import Agent
from .conversation import Message
from .conversations import Conversations
from .frames import AssistCall

log = logging.getLogger("rtserver.console")

MAX_IN_FLIGHT = 6  # assist calls of one agent running at once
MAX_ID_CHARS = 64
MAX_TRANSCRIPT_CHARS = 6000  # the newest messages that fit; the tasks keep the tail of longer ones
SPEAKERS = {"user": "Customer", "bot": "Bot", "agent": "Agent"}
REPLY_TASK = "translate_reply"  # its input: the target language's name, a newline, the reply
LANGUAGE_TASK = "language"  # the scoring task that names the customer's language
DELTA_EVERY_S = 0.05  # one call's text deltas go out at most this often (the first at once)


def transcript(messages: Iterable[Message]) -> str:
    """The conversation as the assist prompts read it: one line a message, newest kept."""
    lines: list[str] = []
    size = 0
    for m in reversed(list(messages)):
        if m.get("role") == "action":  # an action's call: the bot's reply after it says the result
            continue
        text = " ".join(str(m.get("text", "")).split())
        line = f"{SPEAKERS.get(str(m.get('role')), 'Customer')}: {text}"
        if size + len(line) > MAX_TRANSCRIPT_CHARS and lines:
            break
        lines.append(line[-MAX_TRANSCRIPT_CHARS:])
        size += len(line) + 1
    return "\n".join(reversed(lines))


def last_customer_text(messages: Iterable[Message]) -> str:
    for m in reversed(list(messages)):
        if m.get("role") == "user":
            return str(m.get("text", ""))
    return ""


class StreamedText:
    """One call's text deltas on their way to its agent: gathered per reply and sent at most every
    `DELTA_EVERY_S`, the first at once, so a fast model does not flood the agent's queue."""

    def __init__(self, agent: Agent, request_id: str, session_id: str, task: str):
        self.agent = agent
        self.request_id, self.session_id, self.task = request_id, session_id, task
        self.pending: dict[int, str] = {}
        self.sent_at = -DELTA_EVERY_S
        self.timer: asyncio.TimerHandle | None = None

    def __call__(self, sample: int, text: str) -> None:
        self.pending[sample] = self.pending.get(sample, "") + text
        if self.timer is None:
            wait = self.sent_at + DELTA_EVERY_S - time.monotonic()
            if wait <= 0:
                self.flush()
            else:
                self.timer = asyncio.get_running_loop().call_later(wait, self.flush)

    def flush(self) -> None:
        """Send what is gathered (before the call's answer, so the deltas always come first)."""
        self.close()
        for sample, text in sorted(self.pending.items()):
            delta = agent_events.assist_delta(self.request_id, self.session_id, self.task, sample, text)
            self.agent.put(delta)
        self.pending.clear()
        self.sent_at = time.monotonic()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Assist:
    """Runs agents' assist calls; one instance per console."""

    def __init__(
        self, state: AppState, conversations: Conversations, sessions: SessionRegistry, bus: ConsoleBus
    ):
        self.state = state
        self.conversations = conversations
        self.sessions = sessions
        self.bus = bus
        self._running: dict[Agent, dict[str, asyncio.Task[None]]] = {}

    def names(self) -> list[str]:
        """The agents' copilot: the stateless tasks agents may call and customers may not."""
        registry = self.state.tasks
        return [
            n
            for n in registry.names()
            if AGENTS in (task := registry.get(n)).task.callers and CUSTOMERS not in task.task.callers
        ]

    def request(self, agent: Agent, frame: AssistCall) -> None:
        """Check an `assist` frame and start its call; a bad one is answered with an error at once."""
        rid, sid, task, text, stream = frame.id, frame.session_id, frame.task, frame.text, frame.stream

        def refuse(code: str, message: str) -> None:
            agent.put(
                events.error_event(code, message, rid if isinstance(rid, str) else None, session_id=sid)
            )

        mine = self._running.setdefault(agent, {})
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_CHARS:
            refuse("invalid_field", f"'id' must be a string of 1..{MAX_ID_CHARS} characters")
        elif rid in mine:
            refuse("duplicate_id", f"request {rid!r} is already running")
        elif task not in self.names():
            refuse(
                "unknown_task",
                f"assist task {str(task)[:40]!r} is not available (available: {', '.join(self.names())})",
            )
        elif text is not None and not (isinstance(text, str) and len(text) <= MAX_TRANSCRIPT_CHARS):
            refuse("invalid_field", f"'text' must be a string of at most {MAX_TRANSCRIPT_CHARS} characters")
        elif not isinstance(stream, bool):
            refuse("invalid_field", "'stream' must be true or false")
        elif task == REPLY_TASK and not (isinstance(text, str) and text.strip()):
            refuse("invalid_field", f"'text' (the reply to translate) is required for {REPLY_TASK}")
        elif task == REPLY_TASK and LANGUAGE_TASK not in self.state.tasks.names():
            refuse(
                "unknown_task",
                f"{REPLY_TASK} needs the {LANGUAGE_TASK!r} task to find the customer's language "
                "(examples/plugins/language.py)",
            )
        elif len(mine) >= MAX_IN_FLIGHT:
            refuse("too_many_requests", f"at most {MAX_IN_FLIGHT} assist calls at once")
        else:
            assert isinstance(sid, str)
            call = asyncio.get_running_loop().create_task(self._run(agent, rid, sid, task, text, stream))
            mine[rid] = call  # held until done: the loop keeps only weak references

    async def _run(self, agent: Agent, rid: str, sid: str, task: str, text: str | None, stream: bool) -> None:
        streamed = StreamedText(agent, rid, sid, task)
        on_delta: Deltas = streamed if stream else no_deltas
        try:
            messages = await self._messages(sid)
            if messages is None:
                agent.put(
                    events.error_event(
                        "unknown_session", f"no live conversation {sid!r}", rid, session_id=sid
                    )
                )
                return
            given = (
                text if text is not None else (last_customer_text(messages) if task == "translate" else "")
            )
            source = given or transcript(messages)
            if not source.strip():
                agent.put(
                    events.error_event(
                        "empty_text", "the conversation has no messages yet", rid, session_id=sid
                    )
                )
                return
            found: dict[str, str] = {}
            if task == REPLY_TASK:
                found["language"] = await self._customer_language(sid, messages)
                source = f"{found['language'].capitalize()}\n{given}"
            out = await self.state.tasks.run(
                self.state.backend_for(task),
                task,
                {"text": source},
                on_delta=on_delta,
                conversation=None if given else self._live(sid),
                caller=AGENTS,
            )
            streamed.flush()
            agent.put(agent_events.assist(rid, sid, task, {**out.output, **found}, out.text, out.timing))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # this call's alone: the agent gets its code
            code, message = error_code(exc)
            if code == "internal":
                log.exception("assist %s on %s failed", task, sid)
            agent.put(events.error_event(code, message, rid, session_id=sid))
        finally:
            streamed.close()
            self._running.get(agent, {}).pop(rid, None)

    async def _customer_language(self, sid: str, messages: list[Message]) -> str:
        """The label the language task gives the customer's last message (cached per conversation)."""
        said = last_customer_text(messages)
        if not said.strip():
            raise TaskError("empty_text", "the customer has not written yet: no language to translate to")
        backend = self.state.backend_for(LANGUAGE_TASK)
        out = await self.state.tasks.run(
            backend, LANGUAGE_TASK, {"text": said}, scope=("assist", sid), caller=AGENTS
        )
        return str(out.output["label"])

    def _live(self, sid: str) -> Conversation | None:
        """The session as this node's model sees it (None: it lives on another node)."""
        session = self.sessions.sessions.get(sid)
        if session is None or not session.history:
            return None
        return Conversation(list(session.history), session.last_turn, session.id)

    async def _messages(self, sid: str) -> list[Message] | None:
        """The conversation's messages: this node's copy, else its record in the store (clustered)."""
        conv = self.conversations.get(sid)
        if conv is not None:
            return list(conv.messages)
        record = await self.bus.conversation(sid)
        stored = None if record is None else record.get("messages")
        return None if record is None else list(stored) if isinstance(stored, list) else []

    def agent_left(self, agent: Agent) -> None:
        """Its console closed: its calls still running are cancelled."""
        for running in self._running.pop(agent, {}).values():
            running.cancel()
