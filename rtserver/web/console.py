"""The agent console: `/ws/console`, a registry of live conversations and the fan-out to agents.

The hub calls the small synchronous hooks below (`attached`, `user_message`, `bot_token`, ...) as
things happen in customer sessions; each hook updates the conversation's state here and puts one
event on the send queue of every logged-in agent. Nothing awaits between updating the state and
queueing the event, so an agent that logs in (or reconnects) gets a snapshot of every conversation
(`console_ready`) followed by exactly the events that happened after it: nothing is missed or doubled.

Take-over: an agent can take over one conversation at a time per conversation (a second agent gets
`error already_taken`). While taken over, the customer's `chat` messages are not given to the bot:
they go into the session's history and to the console (the customer gets `forwarded`), the agent's
replies go to the customer as `agent_message` events and into the history as assistant turns, so the
bot knows what was said when the agent hands back. An agent whose console disconnects keeps its
take-overs for `sessions.console_takeover_grace_s` (to reconnect), then they are handed back.

The door: a console socket must log in within `security.console_login_timeout_s` (else 4408), and
after `security.console_login_failures_per_min` wrong tokens from one client IP every login from it is
refused for the rest of the minute (4429). The server assigns agent ids; the `rejoin` token it hands
out (an HMAC of the id) is the only way back to one, so no agent can pose as another.

The store: a conversation keeps at most `sessions.console_max_messages` messages and
MAX_CONVERSATION_CHARS characters; a turn with no reply leaves nothing in it, as in the history.

Hooks never raise: a console failure is logged and never breaks a customer's chat.

Every action goes through `bus` (`seams.ConsoleBus`), written once for both topologies. Alone it is
the null `LocalBus`. Clustered (`cluster.redis_url`, rtserver/web/cluster/bus.py) every event is also
published for the other nodes' agents, conversation records are kept in Redis (an agent's snapshot
comes from there), a take-over is claimed atomically in Redis, and an action on a conversation another
node serves is sent to that node and applied there.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import secrets
import time
import unicodedata
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cachetools import TTLCache
from starlette.websockets import WebSocket, WebSocketDisconnect

from . import events
from . import protocol as P
from . import session_events as se
from .admission import client_key
from .cluster import ClusterUnavailable
from .connection import Close, QueuedConnection, accept, client_ip, refuse
from .seams import Resumed, SessionStore, Topology
from .session import Session, SessionRegistry
from .state import AppState

log = logging.getLogger("rtserver.console")

# Sentiment labels (as the built-in sentiment task names them, English or Chinese) → mood score.
MOOD_SCORE = {"positive": 1.0, "negative": -1.0, "neutral": 0.0, "正面": 1.0, "负面": -1.0, "中性": 0.0}
SENTIMENT_TASK = "sentiment"
MAX_AGENT_MESSAGE_CHARS = 4000
MAX_AGENT_NAME_CHARS = 60
AGENT_MESSAGE_TYPES = ("login", "take_over", "hand_back", "agent_message", "ping")
LOGIN_WINDOW_S = 60.0  # failed logins are counted per client IP over this window
MAX_STORED_CHARS = 4000  # of one message's text in the console's store
MAX_CONVERSATION_CHARS = 200_000  # of all the messages the store keeps for one conversation
TAG_WAIT_S = 5.0  # clustered: a finished turn waits this long for its auto-task tags to be written with


Hook = TypeVar("Hook", bound=Callable[..., None])


def _safe(fn: Hook) -> Hook:
    """Hooks called from the hub: log failures, never raise into a customer's chat."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:
            log.exception("console hook %s failed", fn.__name__)

    return wrapper  # type: ignore[return-value]


def _clean(text: str) -> str:
    return "".join(c for c in text if c in "\n\t" or not (ord(c) < 32 or 127 <= ord(c) < 160)).strip()


def _agent_name(raw: Any) -> str:
    """A display name: one line, no control, format (bidi overrides) or surrogate characters."""
    if not isinstance(raw, str):
        return "Agent"
    kept = "".join(
        c for c in raw[: 4 * MAX_AGENT_NAME_CHARS] if unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co")
    )
    return " ".join(kept.split())[:MAX_AGENT_NAME_CHARS] or "Agent"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class LoginFailures:
    """Failed console logins per client IP in a window from its first failure; at the limit every
    login is refused, a right token too, so a guesser learns nothing more."""

    def __init__(self, limit: int, max_ips: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        self.windows: TTLCache = TTLCache(maxsize=max_ips, ttl=LOGIN_WINDOW_S, timer=clock)

    def check(self, ip: str, failed: bool = False) -> float:
        """Count a failure first if `failed`: seconds until the IP may try again (0.0: it may now)."""
        window = self.windows.get(ip)
        if failed:
            if window is None:
                window = self.windows[ip] = [self.clock() + LOGIN_WINDOW_S, 0]
            window[1] += 1
        if window is None or window[1] < self.limit:
            return 0.0
        return max(0.001, window[0] - self.clock())


class Conversation:
    """What the console knows about one customer session."""

    def __init__(self, session_id: str, customer: str, max_messages: int):
        now = time.time()
        self.session_id = session_id
        self.customer = customer
        self.connected = True
        self.started_at = now
        self.updated_at = now
        self.messages: deque[dict] = deque()
        self.max_messages = max_messages
        self.chars = 0  # of the messages' texts: the store is bounded in size as well as in count
        self.seq = 0
        self.streaming: dict | None = None  # {"id", "text"} of the bot reply being streamed
        self.agent: dict | None = None  # {"id", "name"} of the agent who took over
        # clustered: changed since its record was written; a finished turn waits for its tags until
        # `hold_until` (monotonic); the newest seq the stored record has
        self.dirty = False
        self.hold_until = 0.0
        self.stored_seq = 0

    def add(self, message: dict) -> dict:
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

    def remove(self, message: dict) -> None:
        for i, m in enumerate(self.messages):
            if m is message:
                del self.messages[i]
                self.chars -= len(m["text"])
                return

    def clear(self) -> None:
        self.messages.clear()
        self.chars = 0

    def find_user_message(self, request_id: str) -> dict | None:
        for m in reversed(self.messages):
            if m["role"] == "user" and m.get("id") == request_id:
                return m
        return None

    def mood(self, window: int) -> dict:
        labels = [
            m["sentiment"] for m in reversed(self.messages) if m["role"] == "user" and m.get("sentiment")
        ][:window]
        if not labels:
            return {"label": "unknown", "score": None, "n": 0}
        score = sum(MOOD_SCORE.get(str(label).lower(), 0.0) for label in labels) / len(labels)
        label = "negative" if score <= -1 / 3 else "positive" if score >= 1 / 3 else "neutral"
        return {"label": label, "score": round(score, 3), "n": len(labels)}

    def last_message(self) -> dict | None:
        if not self.messages:
            return None
        m = self.messages[-1]
        return {"role": m["role"], "text": m["text"][:200], "ts": m["ts"]}

    def to_json(self, window: int) -> dict:
        return {
            "session_id": self.session_id,
            "customer": self.customer,
            "connected": self.connected,
            "started_at": self.started_at,
            "updated_at": self.updated_at,
            "agent": self.agent,
            "mood": self.mood(window),
            "last_message": self.last_message(),
            "seq": self.seq,
            "messages": list(self.messages),
            "streaming": self.streaming,
        }


class Agent(QueuedConnection):
    """One logged-in console connection."""

    def __init__(self, ws: WebSocket, queue_size: int):
        super().__init__(ws, queue_size)
        self.id = ""
        self.name = ""
        self.logged_in = False
        self.held: list[dict] | None = None  # events held while its snapshot is read from Redis
        self.rejoin: str | None = None  # given back at a later login, it restores this id

    def put(self, event: dict) -> None:
        """Queue an event; an agent that does not read is closed (it resyncs from a snapshot)."""
        if self.stopping.is_set():
            return
        if self.held is not None and event.get("type") != "console_ready":
            self.held.append(event)
            return
        try:
            self.queue.put_nowait(events.dumps(event))
        except asyncio.QueueFull:
            log.warning("closing console connection of %s: not reading", self.name)
            self.stop(Close.SLOW_CLIENT, "slow client")


class ConsoleHub:
    """Registry of conversations + the set of agents; the hub publishes session events here through the
    hooks, and the console reaches customers through their sessions' `Customer` connections."""

    def __init__(
        self,
        state: AppState,
        sessions: SessionRegistry,
        store: SessionStore,
        topology: Topology,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.state = state
        self.clock = clock  # when a turn's record waits for its tags (TAG_WAIT_S)
        self.sessions = sessions
        self.store = store  # agent messages and forwarded customer ones are stored through it
        self.topology = topology
        self.settings = state.settings
        ss = self.settings.sessions
        self.mood_window = ss.console_mood_window
        self.max_messages = ss.console_max_messages
        self.grace_s = ss.console_takeover_grace_s
        self.conversations: dict[str, Conversation] = {}
        self.agents: set[Agent] = set()
        self._release: dict[str, asyncio.TimerHandle] = {}
        # clustered: across nodes; alone, the null bus (the conversations here are all there are)
        self.bus = topology.console_bus(self.deliver, self.on_bus_command, self.resync, self._holder_of)
        self.node_id = topology.node_id
        topology.on_beat(self.beat)
        self._holders: dict[str, dict | None] = {}  # read from Redis at resume, until the session attaches
        self._holds: dict[str, str] = {}  # session id -> agent id: take-overs claimed by this node's agents
        self.closing = False  # the node is stopping
        sec = self.settings.security
        self.login_failures = LoginFailures(sec.console_login_failures_per_min)
        # signs the `rejoin` tokens that give an agent its id back (clustered: a key shared in Redis)
        self._rejoin_key: bytes | None = None

    # -- fan-out --------------------------------------------------------------------------------
    def agent_count(self) -> int:
        return sum(1 for a in self.agents if a.logged_in)

    def broadcast(self, event: dict) -> None:
        self.deliver(event)
        self.bus.publish(event)

    def deliver(self, event: dict) -> None:
        """To this node's agents (events of other nodes come in here from the bus)."""
        for agent in list(self.agents):
            if agent.logged_in:
                agent.put(event)

    def record(self, conv: Conversation) -> dict:
        """The conversation as stored in Redis (and in the session's record)."""
        return {**conv.to_json(self.mood_window), "streaming": None, "node": self.node_id}

    def _save(self, conv: Conversation, force: bool = False) -> None:
        conv.dirty, conv.hold_until, conv.stored_seq = False, 0.0, conv.seq
        self.bus.save_conversation(self.record(conv), force)

    def _tagged(self, message: dict) -> bool:
        """Every auto-task has tagged this customer message."""
        return set(self.state.tasks.auto_tasks) <= set(message.get("tags", {}))

    def _store_turn(self, conv: Conversation, message: dict | None) -> None:
        """A turn ended (customer `message` answered or forwarded): write it once, with its tags."""
        if message is None or self._tagged(message):
            self._save(conv)
        else:  # written when the tags come, or by the heartbeat after TAG_WAIT_S
            conv.dirty, conv.hold_until = True, self.clock() + TAG_WAIT_S

    def _conv_event(self, conv: Conversation, force: bool = False) -> None:
        self.broadcast({"type": "conversation", "conversation": conv.to_json(self.mood_window)})
        self._save(conv, force)

    def _conv(self, session: Session) -> Conversation | None:
        return self.conversations.get(session.id)

    def holder(self, session: Session) -> dict | None:
        """The agent ({"id", "name"}) answering this session instead of the bot, or None."""
        return self._holder_of(session.id)

    def _holder_of(self, session_id: str) -> dict | None:
        conv = self.conversations.get(session_id)
        if conv is None:
            return self._holders.get(session_id)
        return conv.agent

    def set_holder(self, session: Session, agent: dict | None) -> None:
        """Clustered resume: who holds the session, as Redis says (the node may not know it yet)."""
        conv = self.conversations.get(session.id)
        if conv is not None:
            conv.agent = agent
        else:
            self._holders[session.id] = agent

    # -- hooks (the hub's session events; synchronous, never raise) ------------------------------
    def on_event(self, event: se.SessionEvent) -> None:
        match event:
            case se.Attached(session, client_name, resumed):
                self.attached(session, client_name, resumed)
            case se.Detached(session):
                self.detached(session)
            case se.Dropped(session):
                self.dropped(session)
            case se.TurnStarted(session, request_id, text):
                self.user_message(session, request_id, text)
            case se.Forwarded(session, request_id, text):
                self.user_message(session, request_id, text, to_agent=True)
            case se.Token(session, request_id, text):
                self.bot_token(session, request_id, text)
            case se.TurnFinished(session, request_id, reply, finish_reason):
                self.bot_done(session, request_id, reply, finish_reason)
            case se.Tagged(session, request_id, task, output):
                self.auto_result(session, request_id, task, output)
            case se.Cleared(session):
                self.reset(session)

    @_safe
    def attached(self, session: Session, client_name: str | None, resumed: bool) -> None:
        conv = self._conv(session)
        name = client_name or f"Customer {session.id[:6]}"
        if conv is None:
            conv = Conversation(session.id, name, self.max_messages)
            conv.agent = self._holders.pop(session.id, None)
            self.conversations[session.id] = conv
            for m in session.history:  # a session older than the console's record of it
                role = "agent" if m.get("agent") else "bot" if m["role"] == "assistant" else "user"
                conv.add(
                    {"role": role, "text": m["content"], **({"agent": m["agent"]} if m.get("agent") else {})}
                )
        else:
            if client_name:
                conv.customer = client_name
        conv.connected = True
        conv.updated_at = time.time()
        self._conv_event(conv, force=True)  # clustered: this node serves the conversation now

    @_safe
    def detached(self, session: Session) -> None:
        conv = self._conv(session)
        if conv is not None and session.connection is None:
            conv.connected = False
            conv.streaming = None
            self._conv_event(conv)

    @_safe
    def dropped(self, session: Session) -> None:
        self._holders.pop(session.id, None)
        if self.conversations.pop(session.id, None) is not None:
            timer = self._release.pop(session.id, None)
            if timer is not None:
                timer.cancel()
            if not self.closing:  # clustered: only if no other node serves it since; a node that
                # stops leaves its conversations in Redis (their sessions resume elsewhere)
                self._spawn(self._remove(session.id))

    async def _remove(self, session_id: str) -> None:
        record = await self.bus.conversation(session_id)
        if record is None or record.get("node") == self.node_id:
            self.bus.remove_conversation(session_id)
            self.broadcast({"type": "removed", "session_id": session_id})

    def _spawn(self, coro: Awaitable[Any]) -> None:
        async def run() -> None:
            try:
                await coro
            except ClusterUnavailable:
                pass
            except Exception:
                log.exception("console task failed")

        asyncio.get_running_loop().create_task(run())

    @_safe
    def user_message(self, session: Session, request_id: str, text: str, to_agent: bool = False) -> None:
        conv = self._conv(session)
        if conv is None:
            return
        msg = conv.add(
            {"role": "user", "id": request_id, "text": text, "sentiment": None, "to_agent": to_agent}
        )
        # clustered: a message the bot answers is stored with the reply (bot_done), keeping Redis work
        # off the way to the first token; one for an agent ends its turn
        self._message_event(conv, msg, save=False)
        if to_agent:
            self._store_turn(conv, msg)

    @_safe
    def bot_token(self, session: Session, request_id: str, delta: str) -> None:
        conv = self._conv(session)
        if conv is None:
            return
        if conv.streaming is None or conv.streaming["id"] != request_id:
            conv.streaming = {"id": request_id, "text": ""}
        conv.streaming["text"] += delta
        self.broadcast({"type": "token", "session_id": session.id, "id": request_id, "text": delta})

    @_safe
    def bot_done(self, session: Session, request_id: str, text: str | None, finish_reason: str) -> None:
        """The bot's turn ended: `text` is the reply (None when it failed or left no text)."""
        conv = self._conv(session)
        if conv is None:
            return
        if conv.streaming is not None and conv.streaming["id"] == request_id:
            conv.streaming = None
        user = conv.find_user_message(request_id)
        if user is not None and user.get("to_agent"):
            user = None
        if text:
            msg = conv.add({"role": "bot", "id": request_id, "text": text, "finish_reason": finish_reason})
            self._message_event(conv, msg, save=False)
            self._store_turn(conv, user)
            return
        # no reply: the turn leaves no trace here either (as in the session's history)
        event = {
            "type": "stream_end",
            "session_id": session.id,
            "id": request_id,
            "finish_reason": finish_reason,
        }
        if user is not None:
            conv.remove(user)
            event["dropped"] = user["seq"]
            if user["seq"] <= conv.stored_seq:  # the stored record has it: write it again, later
                conv.dirty = True
        self.broadcast(event)

    @_safe
    def auto_result(self, session: Session, request_id: str, task: str, output: Any) -> None:
        conv = self._conv(session)
        if conv is None:
            return
        msg = conv.find_user_message(request_id)
        if msg is None:
            return
        label = output.get("label") if isinstance(output, dict) else None
        if label is None:
            return
        msg.setdefault("tags", {})[task] = label
        if task == SENTIMENT_TASK:
            msg["sentiment"] = label
        if session.chat_request != request_id:  # else the reply's end writes it
            if conv.hold_until and self._tagged(msg):
                self._save(conv)  # the turn was waiting for this
            else:
                conv.dirty = True  # the heartbeat writes it
        self.broadcast(
            {
                "type": "tag",
                "session_id": session.id,
                "seq": msg["seq"],
                "id": request_id,
                "task": task,
                "label": label,
                "mood": conv.mood(self.mood_window),
            }
        )

    @_safe
    def reset(self, session: Session) -> None:
        conv = self._conv(session)
        if conv is not None:
            conv.clear()
            conv.streaming = None
            conv.updated_at = time.time()
            self._conv_event(conv)

    def _message_event(self, conv: Conversation, msg: dict, save: bool = True) -> None:
        if save:
            self._save(conv)
        self.broadcast(
            {
                "type": "message",
                "session_id": conv.session_id,
                "message": msg,
                "mood": conv.mood(self.mood_window),
                "updated_at": conv.updated_at,
            }
        )

    async def _persist(self, session: Session) -> None:
        await self.store.save(session, getattr(session.connection, "client_name", None))

    async def resumed(self, found: Resumed) -> None:
        """A session resumed: who holds it, and close its connection on the node that served it."""
        session = found.session
        self.set_holder(session, await self.bus.holder(session.id))  # clustered: maybe from another node
        if found.served_on and found.served_on != self.node_id:
            # a connection to it on another node is closed there (4409)
            await self.bus.command(found.served_on, {"cmd": "session_taken", "session_id": session.id})

    # -- agent actions --------------------------------------------------------------------------
    def _session(self, session_id: Any) -> Session | None:
        if not isinstance(session_id, str):
            return None
        return self.sessions.sessions.get(session_id)

    async def _to_customer(self, session: Session, event: dict) -> None:
        conn = session.connection
        if conn is not None:
            await conn.send(event)

    async def take_over(self, agent: Agent, session_id: Any) -> None:
        await self._action(agent, "take_over", session_id)

    def _taken_error(self, session_id: str, holder: dict) -> dict:
        return events.error_event(
            "already_taken",
            f"{holder['name']} has already taken over this conversation",
            session_id=session_id,
            agent=holder,
        )

    async def apply_take_over(self, session_id: str, holder: dict) -> None:
        """On the node serving the conversation: the agent answers from now on."""
        self._cancel_release(session_id)
        conv = self.conversations.get(session_id)
        session = self._session(session_id)
        if conv is None or session is None:
            return
        if conv.agent is not None and conv.agent["id"] == holder["id"]:  # already: say so again
            self._conv_event(conv)
            return
        conv.agent = dict(holder)
        conv.updated_at = time.time()
        self._conv_event(conv)
        await self._to_customer(session, {"type": "handover", "to": "agent", "agent": holder["name"]})

    async def hand_back(self, agent: Agent, session_id: Any) -> None:
        await self._action(agent, "hand_back", session_id)

    async def apply_hand_back(self, session_id: str) -> None:
        self._cancel_release(session_id)
        conv = self.conversations.get(session_id)
        session = self._session(session_id)
        if conv is None or session is None or conv.agent is None:  # (handed back already)
            return
        conv.agent = None
        conv.updated_at = time.time()
        self._conv_event(conv)
        await self._to_customer(session, {"type": "handover", "to": "bot", "agent": None})

    def _agent_text(self, agent: Agent, session_id: Any, text: Any) -> str | None:
        if not isinstance(text, str):
            agent.put(events.error_event("invalid_field", "'text' must be a string", session_id=session_id))
            return None
        text = _clean(text)[:MAX_AGENT_MESSAGE_CHARS]
        if not text:
            agent.put(events.error_event("empty_text", "the message is empty", session_id=session_id))
            return None
        return text

    async def agent_message(self, agent: Agent, session_id: Any, text: Any) -> None:
        await self._action(agent, "agent_message", session_id, text)

    async def apply_agent_message(self, session_id: str, text: str, agent_name: str) -> None:
        conv = self.conversations.get(session_id)
        session = self._session(session_id)
        if conv is None or session is None:
            return
        session.add_agent_reply(text, agent_name)
        session.touch(self.sessions.clock())
        try:  # into the session's record (clustered, it survives this node)
            await self._persist(session)
        except ClusterUnavailable:
            log.warning("agent message in session %s not stored: Redis unavailable", session_id)
        msg = conv.add({"role": "agent", "text": text, "agent": agent_name})
        self._message_event(conv, msg)
        await self._to_customer(session, {"type": "agent_message", "text": text, "agent": agent_name})

    async def _action(self, agent: Agent, kind: str, session_id: Any, text: Any = None) -> None:
        """take_over / hand_back / agent_message: the holder on the bus decides (clustered: in Redis),
        the node serving the conversation applies it."""
        try:
            await self._action_inner(agent, kind, session_id, text)
        except ClusterUnavailable as exc:
            agent.put(events.error_event(exc.code, exc.message, session_id=session_id))

    async def _action_inner(self, agent: Agent, kind: str, session_id: Any, text: Any) -> None:
        record = await self.bus.conversation(session_id) if isinstance(session_id, str) else None
        if record is None and isinstance(session_id, str) and session_id in self.conversations:
            record = {"node": self.node_id}
        if record is None:
            agent.put(
                events.error_event(
                    "unknown_session", f"no live conversation {session_id!r}", session_id=session_id
                )
            )
            return
        me = {"id": agent.id, "name": agent.name}
        command: dict[str, Any] = {"cmd": kind, "session_id": session_id}
        if kind == "take_over":
            holder = await self.bus.claim(session_id, me)
            if holder.get("id") != agent.id:
                agent.put(self._taken_error(session_id, holder))
                return
            self._holds[session_id] = agent.id
            command["agent"] = holder
        elif kind == "hand_back":
            if not await self.bus.release(session_id, agent.id):
                agent.put(
                    events.error_event(
                        "not_taken_over", "you have not taken over this conversation", session_id=session_id
                    )
                )
                return
            self._holds.pop(session_id, None)
        else:
            current = await self.bus.holder(session_id)
            if current is None or current.get("id") != agent.id:
                agent.put(
                    events.error_event(
                        "not_taken_over", "take over the conversation before replying", session_id=session_id
                    )
                )
                return
            clean = self._agent_text(agent, session_id, text)
            if clean is None:
                return
            command.update(text=clean, agent=me)
        node = record.get("node")
        if node == self.node_id:
            await self.apply_command(command)
        elif not isinstance(node, str) or not await self.bus.command(node, command):
            agent.put(
                events.error_event(
                    "unknown_session",
                    f"the node serving conversation {session_id!r} is not reachable",
                    session_id=session_id,
                )
            )

    async def apply_command(self, command: dict) -> None:
        """An action for a conversation this node serves (from an agent here or on another node)."""
        sid, kind, agent = command.get("session_id"), command.get("cmd"), command.get("agent")
        if not isinstance(sid, str):
            return
        if kind == "session_taken":  # the customer resumed its session on another node
            session = self._session(sid)
            conn = session.connection if session is not None else None
            if conn is not None:
                await conn.error("session_taken_over", "this session was resumed by another connection")
                conn.cancel_all()
                conn.stop(Close.TAKEN_OVER, "session taken over")
        elif kind == "take_over" and isinstance(agent, dict):
            await self.apply_take_over(sid, {"id": str(agent.get("id")), "name": str(agent.get("name"))})
        elif kind == "hand_back":
            await self.apply_hand_back(sid)
        elif kind == "agent_message" and isinstance(agent, dict) and isinstance(command.get("text"), str):
            await self.apply_agent_message(sid, command["text"], str(agent.get("name")))

    async def beat(self) -> None:
        """Clustered heartbeat: the take-overs of this node's agents stay alive; changed conversations
        are written, this node's renewed, expired ones removed (agents are told); a conversation served
        here whose holder's key is gone (its node died) goes back to the bot."""
        await self.bus.renew_holds(dict(self._holds))
        now = self.clock()
        for dirty in list(self.conversations.values()):
            if dirty.dirty and dirty.hold_until <= now:
                self._save(dirty)
        for sid in await self.bus.renew_and_sweep(list(self.conversations)):
            if sid not in self.conversations:
                self.broadcast({"type": "removed", "session_id": sid})
        held = [sid for sid, conv in self.conversations.items() if conv.agent is not None]
        if not held:
            return
        for sid, holder in zip(held, await self.bus.holders(held), strict=True):
            conv = self.conversations.get(sid)
            if holder is None and conv is not None and conv.agent is not None:
                log.info("conversation %s handed back: its agent's take-over expired", sid)
                await self.apply_hand_back(sid)

    async def _release_held(self, session_id: str, agent_id: str) -> None:
        if not await self.bus.release(session_id, agent_id):
            return
        record = await self.bus.conversation(session_id)
        node = record.get("node") if record else self.node_id
        command = {"cmd": "hand_back", "session_id": session_id}
        if node == self.node_id:
            await self.apply_command(command)
        elif isinstance(node, str):
            await self.bus.command(node, command)

    def _cancel_release(self, session_id: str) -> None:
        timer = self._release.pop(session_id, None)
        if timer is not None:
            timer.cancel()

    def _agent_left(self, agent: Agent) -> None:
        """Schedule hand-back of the take-overs of an agent id that has no console connected."""
        if not agent.id or any(a.id == agent.id and a.logged_in for a in self.agents):
            return
        loop = asyncio.get_running_loop()
        for sid, agent_id in list(self._holds.items()):  # the take-overs its agents claimed, any node's
            if agent_id == agent.id and sid not in self._release:
                self._release[sid] = loop.call_later(self.grace_s, self._release_orphan, sid, agent.id)

    def _release_orphan(self, session_id: str, agent_id: str) -> None:
        self._release.pop(session_id, None)
        if not any(a.id == agent_id and a.logged_in for a in self.agents):
            self._holds.pop(session_id, None)
            self._spawn(self._release_held(session_id, agent_id))

    # -- the endpoint ---------------------------------------------------------------------------
    def snapshot(self, agent: Agent) -> dict:
        return {
            "type": "console_ready",
            "protocol": P.PROTOCOL_VERSION,
            "agent": {"id": agent.id, "name": agent.name},
            "rejoin": agent.rejoin,
            "mood_window": self.mood_window,
            "conversations": [c.to_json(self.mood_window) for c in self.conversations.values()],
        }

    # -- the door -------------------------------------------------------------------------------
    async def _failed_logins(self, ip: str, failed: bool = False) -> float:
        """Seconds this IP must wait before its next login (counting a failure first if `failed`):
        cluster-wide in Redis when clustered, this node's own count while Redis is down."""
        limit = self.settings.security.console_login_failures_per_min
        if not limit:
            return 0.0
        local = self.login_failures.check(ip, failed)
        return await self.topology.limits.failed_logins(ip, limit, LOGIN_WINDOW_S, failed, local)

    async def _rejoin_secret(self) -> bytes | None:
        if self._rejoin_key is None:
            try:
                self._rejoin_key = (await self.bus.shared_secret("rejoin")).encode()
            except ClusterUnavailable:
                return None
        return self._rejoin_key

    def rejoin_token(self, agent_id: str, key: bytes) -> str:
        return f"{agent_id}.{hmac.new(key, agent_id.encode(), hashlib.sha256).hexdigest()}"

    def _rejoined_id(self, given: Any, key: bytes | None) -> str | None:
        """The agent id a valid `rejoin` token names (an id this server gave out), else None."""
        if key is None or not isinstance(given, str) or given.count(".") != 1:
            return None
        agent_id = given.split(".")[0]
        if not agent_id or not hmac.compare_digest(_digest(self.rejoin_token(agent_id, key)), _digest(given)):
            return None
        return agent_id

    async def login(self, agent: Agent, obj: dict) -> bool:
        ip = client_key(client_ip(agent.ws))  # an IPv6 guesser counts by its /64
        wait = await self._failed_logins(ip)
        if wait > 0:
            limit = self.settings.security.console_login_failures_per_min
            agent.put(
                events.error_event(
                    "rate_limited",
                    f"too many failed console logins from this address (limit {limit} a minute); "
                    f"retry in {wait:.0f} s",
                    retry_after_s=round(wait, 3),
                )
            )
            agent.stop(Close.RATE_LIMITED, "rate limited")
            return False
        given = obj.get("token")
        token = self.settings.security.console_token
        # digests of equal length: the comparison tells nothing about the token, not even its length
        if not (isinstance(given, str) and hmac.compare_digest(_digest(given), _digest(token))):
            await self._failed_logins(ip, failed=True)
            agent.put(events.error_event("unauthorized", "wrong console token"))
            agent.stop(Close.UNAUTHORIZED, "unauthorized")
            return False
        key = await self._rejoin_secret()
        if agent.stopping.is_set():  # closed meanwhile (login deadline, server stopping)
            return False
        return self._login(agent, obj, key)

    def _login(self, agent: Agent, obj: dict, key: bytes | None) -> bool:
        agent.name = _agent_name(obj.get("agent"))
        # the server names agents: an id is only ever given back to who holds its rejoin token
        agent.id = self._rejoined_id(obj.get("rejoin"), key) or secrets.token_urlsafe(12)
        agent.rejoin = self.rejoin_token(agent.id, key) if key is not None else None
        # Snapshot and registration in one synchronous step: every later event follows the snapshot.
        # (Clustered, the snapshot is read from Redis: events are held until it is sent.)
        agent.logged_in = True
        agent.held = []
        for sid, timer in list(self._release.items()):
            conv = self.conversations.get(sid)
            if (conv is not None and conv.agent is not None and conv.agent["id"] == agent.id) or (
                self._holds.get(sid) == agent.id
            ):
                timer.cancel()
                self._release.pop(sid, None)
        return True

    async def send_snapshot(self, agent: Agent) -> None:
        """After login: the snapshot (clustered, read from Redis, with this node's own conversations as
        they are now), then the events held meanwhile — a message the snapshot has is not sent again."""
        try:
            records = await self.bus.conversations()
            alive = await self.topology.alive_nodes()
        except ClusterUnavailable:
            records, alive = [], {self.node_id}
        convs: dict[str, dict] = {}
        horizon = time.time() - self.settings.sessions.idle_timeout_s
        for record in records:
            if record.get("node") not in alive:
                record["connected"] = False  # its node is gone: resumable elsewhere, not connected
                if float(record.get("updated_at") or 0) < horizon:
                    continue
            convs[record["session_id"]] = record
        for sid, conv in self.conversations.items():
            convs[sid] = conv.to_json(self.mood_window)
        snap = self.snapshot(agent)
        snap["conversations"] = list(convs.values())
        held, agent.held = agent.held or [], None
        agent.put(snap)
        for event in held:
            if event.get("type") == "message":
                conv_json = convs.get(event.get("session_id", ""))
                if conv_json is not None and event["message"].get("seq", 0) <= conv_json.get("seq", 0):
                    continue
            agent.put(event)

    async def handle(self, agent: Agent, raw: str | bytes) -> None:
        try:
            obj = P.load_object(raw, self.settings.server.max_frame_bytes)
        except P.ProtocolError as exc:
            agent.put(events.error_event(exc.code, exc.message))
            return
        kind = obj.get("type")
        if kind not in AGENT_MESSAGE_TYPES:
            agent.put(
                events.error_event(
                    "unknown_type", f"unknown message type {kind!r} (known: {', '.join(AGENT_MESSAGE_TYPES)})"
                )
            )
            return
        if kind == "ping":
            agent.put(events.pong_event(obj.get("data")))
            return
        if kind == "login":
            if agent.logged_in:
                agent.put(events.error_event("already_started", "already logged in"))
            elif await self.login(agent, obj):
                await self.send_snapshot(agent)
            return
        if not agent.logged_in:
            agent.put(events.error_event("unauthorized", "send login with the console token first"))
            agent.stop(Close.UNAUTHORIZED, "unauthorized")
            return
        sid = obj.get("session_id")
        if kind == "take_over":
            await self.take_over(agent, sid)
        elif kind == "hand_back":
            await self.hand_back(agent, sid)
        else:
            await self.agent_message(agent, sid, obj.get("text"))

    async def endpoint(self, ws: WebSocket) -> None:
        if not await accept(ws, self.settings.security, self.state.metrics):
            return
        if not self.settings.security.console_token:
            await refuse(
                ws,
                self.state.metrics,
                "console_disabled",
                "the console is disabled (security.console_token is empty)",
                Close.DISABLED,
                "console disabled",
            )
            return
        agent = Agent(ws, max(64, 4 * self.settings.server.send_queue_size))
        self.agents.add(agent)
        writer = asyncio.create_task(agent.writer())
        deadline = asyncio.get_running_loop().call_later(
            self.settings.security.console_login_timeout_s, self._login_late, agent
        )

        async def reader() -> None:
            try:
                while not agent.stopping.is_set():
                    message = await ws.receive()
                    if message["type"] == "websocket.disconnect":
                        break
                    raw = message.get("text")
                    await self.handle(agent, raw if raw is not None else (message.get("bytes") or b""))
            except (WebSocketDisconnect, RuntimeError):
                pass
            finally:
                agent.stop()

        read = asyncio.create_task(reader())
        try:
            await agent.stopping.wait()
        finally:
            deadline.cancel()
            self.agents.discard(agent)
            read.cancel()
            if agent.logged_in:
                agent.logged_in = False
                self._agent_left(agent)
            await agent.finish(read, writer)

    def _login_late(self, agent: Agent) -> None:
        if not agent.logged_in and not agent.stopping.is_set():
            timeout = self.settings.security.console_login_timeout_s
            agent.put(events.error_event("login_timeout", f"no login within {timeout:g} s"))
            agent.stop(Close.LOGIN_TIMEOUT, "login timeout")

    async def on_bus_command(self, command: dict) -> None:
        await self.apply_command(command)

    def resync(self) -> None:
        """The bus resubscribed after losing Redis: events may be missing, agents get a new snapshot."""
        for agent in list(self.agents):
            if agent.logged_in and agent.held is None:
                agent.held = []
                self._spawn(self.send_snapshot(agent))

    def close_all(self) -> None:
        self.closing = True
        for agent in list(self.agents):
            agent.stop(Close.GOING_AWAY, "server shutting down")
        for timer in self._release.values():
            timer.cancel()
        self._release.clear()
