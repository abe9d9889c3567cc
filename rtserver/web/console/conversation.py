"""One conversation as the console knows it: bounded messages, the streamed reply, mood, holder; and
what agents are sent of it: a summary (the list), a message bounded in bytes (the events), a page of
its messages (on an agent's request).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from ..commands import Holder
from ..display import clean_name, clean_text
from ..handoff import Waiting

# Sentiment labels (as the built-in sentiment task names them, English or Chinese) → mood score.
MOOD_SCORE = {"positive": 1.0, "negative": -1.0, "neutral": 0.0, "正面": 1.0, "负面": -1.0, "中性": 0.0}
MAX_STORED_CHARS = 4000  # of one message's text in the console's store
MAX_CONVERSATION_CHARS = 200_000  # of all the messages the store keeps for one conversation
MAX_EVENT_BYTES = 4096  # of one event sent to every agent: a message's text is cut to fit
MAX_EVENT_TEXT_BYTES = 3000  # of the text in one such event (the rest of the event is bounded apart)
MAX_PAGE_BYTES = 64 << 10  # of the messages one `messages` answer holds (an agent asks for older ones)
MAX_PREVIEW_CHARS = 200  # of the last message's text in a summary
MAX_UNREAD = 20  # customer messages' seqs a summary lists (the console page's unread count)

Message = dict[str, Any]  # as agents see it: role, text, seq, ts and what its role adds (docs/protocol.md)
Record = dict[str, Any]  # a conversation as stored (`Conversation.to_json` + the node serving it)


def customer_name(name: str | None, session_id: str) -> str:
    return clean_name(name) or f"Customer {session_id[:6]}"


def cut_bytes(text: str, limit: int) -> str:
    """`text` within `limit` UTF-8 bytes, cut at a character and ended with "…" when cut."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode(errors="ignore") + "…"


def bounded(message: Message) -> Message:
    """A message as every agent's event carries it: its text within MAX_EVENT_TEXT_BYTES (`truncated`
    when cut: the whole text is in the conversation's `messages`)."""
    text = str(message.get("text", ""))
    cut = cut_bytes(text, MAX_EVENT_TEXT_BYTES)
    return message if cut is text else {**message, "text": cut, "truncated": True}


MAX_CALL_PART_BYTES = 1200  # of an action call's arguments or result in a console event


def action_call(call: Mapping[str, object]) -> dict[str, object]:
    """An action call as agents see it: its arguments and result each within MAX_CALL_PART_BYTES (else a
    cut JSON string), its names and error cleaned."""

    def part(value: object) -> object:
        text = json.dumps(value, ensure_ascii=False)
        return value if len(text.encode()) <= MAX_CALL_PART_BYTES else cut_bytes(text, MAX_CALL_PART_BYTES)

    error = call.get("error")
    return {
        "action": clean_text(str(call.get("action", "")), 64),
        "status": clean_text(str(call.get("status", "")), 32),
        "arguments": part(call.get("arguments")),
        "result": part(call.get("result")),
        "error": clean_text(str(error), 300) if error is not None else None,
        "ms": call.get("ms") if isinstance(call.get("ms"), (int, float)) else None,
    }


def user_seqs(messages: Iterable[object]) -> list[int]:
    """The seqs of the newest MAX_UNREAD customer messages."""
    seqs = [m.get("seq") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return [s for s in seqs if isinstance(s, int)][-MAX_UNREAD:]


def summary(record: Mapping[str, object]) -> dict[str, object]:
    """A conversation as agents' lists show it (no messages), from a stored record or `to_json`; its
    texts cleaned and bounded whoever wrote them."""
    last, messages = record.get("last_message"), record.get("messages")
    agent = Holder.from_json(record.get("agent"))
    return {
        "session_id": str(record.get("session_id", ""))[:64],
        "customer": customer_name(str(record.get("customer") or ""), str(record.get("session_id", ""))),
        "connected": bool(record.get("connected")),
        "started_at": record.get("started_at"),
        "updated_at": record.get("updated_at"),
        "agent": {"id": agent.id[:64], "name": clean_name(agent.name) or "Agent"} if agent else None,
        "mood": record.get("mood"),
        "last_message": {
            "role": str(last.get("role"))[:8],
            "text": clean_text(str(last.get("text", "")), MAX_PREVIEW_CHARS),
            "ts": last.get("ts"),
        }
        if isinstance(last, dict)
        else None,
        "seq": record.get("seq") if isinstance(record.get("seq"), int) else 0,
        "user_seqs": user_seqs(messages if isinstance(messages, list) else []),
        "handoff": waiting.to_json() if (waiting := Waiting.from_json(record.get("handoff"))) else None,
    }


def listed(record: Mapping[str, object]) -> bool:
    """Agents see a conversation once it has had a message: an empty session is nobody's work."""
    seq = record.get("seq")
    return isinstance(seq, int) and seq > 0


def page(messages: list[Message], before: int | None) -> tuple[list[Message], bool]:
    """The newest messages older than seq `before` (all when None) within MAX_PAGE_BYTES, oldest first,
    and whether older ones are left."""
    out: list[Message] = []
    size = 0
    older = [m for m in messages if before is None or int(m.get("seq") or 0) < before]
    for m in reversed(older):
        size += len(json.dumps(m, ensure_ascii=False).encode()) + 1
        if size > MAX_PAGE_BYTES and out:
            break
        out.append(m)
    return out[::-1], len(out) < len(older)


class Conversation:
    """What the console knows about one customer session."""

    def __init__(self, session_id: str, customer: str | None, max_messages: int):
        now = time.time()
        self.session_id = session_id
        self.customer = customer_name(customer, session_id)
        self.connected = True
        self.started_at = now
        self.updated_at = now
        self.messages: deque[Message] = deque()
        self.max_messages = max_messages
        self.chars = 0  # of the messages' texts: the store is bounded in size as well as in count
        self.seq = 0
        self.streaming: dict[str, str] | None = None  # {"id", "text"} of the bot reply being streamed
        self.agent: Holder | None = None  # the agent who took over
        self.handoff: Waiting | None = None  # waiting for a person (console/queue.py)
        self.handoff_after = 0  # the seq a hand-off ended at: the signals before it were answered
        # clustered: changed since its record was written; a finished turn waits for its tags until
        # `hold_until` (monotonic); the newest seq the stored record has
        self.dirty = False
        self.hold_until = 0.0
        self.stored_seq = 0

    @property
    def listed(self) -> bool:
        return self.seq > 0

    def add(self, message: Message) -> Message:
        message["text"] = clean_text(message["text"], MAX_STORED_CHARS + 1, strip=False)  # shown to agents
        self.seq += 1
        message["seq"] = self.seq
        message["ts"] = time.time()
        self.messages.append(message)
        self.chars += len(message["text"])
        while len(self.messages) > self.max_messages or (
            self.chars > MAX_CONVERSATION_CHARS and len(self.messages) > 1
        ):
            self.chars -= len(self.messages.popleft()["text"])
        self.updated_at = message["ts"]
        return message

    def add_history(self, history: Iterable[Mapping[str, str]]) -> None:
        """The turns of a session older than the console's record of it."""
        for m in history:
            role = "agent" if m.get("agent") else "bot" if m["role"] == "assistant" else "user"
            self.add(
                {"role": role, "text": m["content"], **({"agent": m["agent"]} if m.get("agent") else {})}
            )

    def remove(self, message: Message) -> None:
        for i, m in enumerate(self.messages):
            if m is message:
                del self.messages[i]
                self.chars -= len(m["text"])
                return

    def clear(self) -> None:
        self.messages.clear()
        self.chars = 0

    def find_user_message(self, request_id: str) -> Message | None:
        for m in reversed(self.messages):
            if m["role"] == "user" and m.get("id") == request_id:
                return m
        return None

    def mood(self, window: int) -> dict[str, Any]:
        labels = [
            m["sentiment"] for m in reversed(self.messages) if m["role"] == "user" and m.get("sentiment")
        ][:window]
        if not labels:
            return {"label": "unknown", "score": None, "n": 0}
        score = sum(MOOD_SCORE.get(str(label).lower(), 0.0) for label in labels) / len(labels)
        label = "negative" if score <= -1 / 3 else "positive" if score >= 1 / 3 else "neutral"
        return {"label": label, "score": round(score, 3), "n": len(labels)}

    def recent_moods(self, window: int) -> tuple[float, ...]:
        """Mood scores of the newest rated customer messages since the last hand-off, newest first."""
        labels = [
            m["sentiment"]
            for m in reversed(self.messages)
            if m["role"] == "user" and m.get("sentiment") and m["seq"] > self.handoff_after
        ]
        return tuple(MOOD_SCORE.get(str(label).lower(), 0.0) for label in labels[:window])

    def last_tag(self, task: str) -> str | None:
        """The label `task` gave the newest customer message, if any (and since the last hand-off)."""
        for m in reversed(self.messages):
            if m["role"] == "user":
                label = m.get("tags", {}).get(task) if m["seq"] > self.handoff_after else None
                return str(label) if label is not None else None
        return None

    def last_message(self) -> dict[str, Any] | None:
        if not self.messages:
            return None
        m = self.messages[-1]
        return {"role": m["role"], "text": clean_text(m["text"], MAX_PREVIEW_CHARS), "ts": m["ts"]}

    def summary(self, window: int) -> dict[str, Any]:
        """What agents' lists show, and every `conversation` event carries: no messages."""
        return {
            "session_id": self.session_id,
            "customer": self.customer,
            "connected": self.connected,
            "started_at": self.started_at,
            "updated_at": self.updated_at,
            "agent": self.agent.to_json() if self.agent is not None else None,
            "mood": self.mood(window),
            "last_message": self.last_message(),
            "seq": self.seq,
            "user_seqs": user_seqs(self.messages),
            "handoff": self.handoff.to_json() if self.handoff is not None else None,
        }

    def to_json(self, window: int) -> dict[str, Any]:
        """The whole conversation: the summary's fields, its messages and the reply being streamed."""
        whole = self.summary(window)
        del whole["user_seqs"]
        return whole | {"messages": list(self.messages), "streaming": self.streaming}
