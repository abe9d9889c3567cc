"""One conversation as the console knows it: bounded messages, the streamed reply, mood, holder."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from ..commands import Holder

# Sentiment labels (as the built-in sentiment task names them, English or Chinese) → mood score.
MOOD_SCORE = {"positive": 1.0, "negative": -1.0, "neutral": 0.0, "正面": 1.0, "负面": -1.0, "中性": 0.0}
MAX_STORED_CHARS = 4000  # of one message's text in the console's store
MAX_CONVERSATION_CHARS = 200_000  # of all the messages the store keeps for one conversation

Message = dict[str, Any]  # as agents see it: role, text, seq, ts and what its role adds (docs/protocol.md)


class Conversation:
    """What the console knows about one customer session."""

    def __init__(self, session_id: str, customer: str, max_messages: int):
        now = time.time()
        self.session_id = session_id
        self.customer = customer
        self.connected = True
        self.started_at = now
        self.updated_at = now
        self.messages: deque[Message] = deque()
        self.max_messages = max_messages
        self.chars = 0  # of the messages' texts: the store is bounded in size as well as in count
        self.seq = 0
        self.streaming: dict[str, str] | None = None  # {"id", "text"} of the bot reply being streamed
        self.agent: Holder | None = None  # the agent who took over
        # clustered: changed since its record was written; a finished turn waits for its tags until
        # `hold_until` (monotonic); the newest seq the stored record has
        self.dirty = False
        self.hold_until = 0.0
        self.stored_seq = 0

    def add(self, message: Message) -> Message:
        if len(message["text"]) > MAX_STORED_CHARS:
            message["text"] = message["text"][:MAX_STORED_CHARS] + "…"
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

    def last_message(self) -> dict[str, Any] | None:
        if not self.messages:
            return None
        m = self.messages[-1]
        return {"role": m["role"], "text": m["text"][:200], "ts": m["ts"]}

    def to_json(self, window: int) -> dict[str, Any]:
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
            "messages": list(self.messages),
            "streaming": self.streaming,
        }
