"""The agent console: `/ws/console`, a registry of live conversations and the fan-out to agents.

The hub publishes what happens in customer sessions as typed events (`session_events.py`);
`ConsoleHub.on_event` hands each to its synchronous hook (`attached`, `user_message`, `bot_token`,
...), which updates the conversation and puts one event on the send queue of every logged-in agent.
A hook's failure is logged by `SessionEvents` and never breaks a customer's chat. The parts, one
job each:

- `conversations.py`: the registry of conversations, the hooks, the store writes (`conversation.py`:
  one conversation, its bounded messages and mood);
- `actions.py`: take over, hand back, agent replies, decided through the bus and applied on the node
  serving the conversation; the grace of an agent whose console went away; a resume elsewhere;
- `queue.py`: the hand-off queue — conversations waiting for a person (web/handoff.py's policy),
  their customers' places, the e-mail left out of hours;
- `assist.py`: agent assist — reply drafts, summaries, fields, translation — run on a conversation's
  messages for the agent who asked;
- `door.py`: the endpoint, login and frames (`login.py`: failed logins, names, rejoin tokens;
  `snapshot.py`: what an agent gets at login); `agents.py`: the connections and their fan-out.

Every action goes through `bus` (`seams.ConsoleBus`), written once for both topologies. Alone it is
the null `LocalBus`. Clustered (`cluster.redis_url`, rtserver/web/cluster/bus.py) every event is also
published for the other nodes' agents, conversation records are kept in Redis (an agent's snapshot
comes from there), a take-over is claimed atomically in Redis, and an action on a conversation another
node serves is sent to that node and applied there.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.websockets import WebSocket

from .. import session_events as se
from ..commands import BusCommand, Holder
from ..events import Event, error_event
from ..handoff import HandoffPolicy, Waiting
from ..seams import Resumed, SessionStore, Topology
from ..session import Session, SessionRegistry
from ..state import AppState
from .actions import Actions
from .agents import Agents
from .assist import Assist
from .conversations import Conversations
from .door import Door
from .guard import spawn
from .login import RejoinTokens
from .queue import HandoffQueue, NotWaiting
from .snapshot import Snapshots
from .timer import LOOP_TIMER, Timer

__all__ = ["ConsoleHub"]


class ConsoleHub:
    """The console as the hub and the app see it: the hooks, the holder of a session, the endpoint."""

    def __init__(
        self,
        state: AppState,
        sessions: SessionRegistry,
        store: SessionStore,
        topology: Topology,
        clock: Callable[[], float] = time.monotonic,
        timer: Timer = LOOP_TIMER,
    ):
        ss = state.settings.sessions
        self.agents = Agents()
        # clustered: across nodes; alone, the null bus (the conversations here are all there are)
        self.bus = topology.console_bus(self.agents.deliver, self._command, self._resync, self._holder_of)
        self.conversations = Conversations(state, self.bus, self.agents, topology.node_id, clock)
        self.queue = HandoffQueue(
            HandoffPolicy(state.settings.handoff),
            self.conversations,
            sessions,
            self.bus,
            lambda: topology.console_agents(self.agents.count()),
            lambda reason: state.metrics.handoffs.labels(reason).inc(),
        )
        self.actions = Actions(
            self.conversations,
            sessions,
            store,
            self.bus,
            self.agents,
            ss.console_takeover_grace_s,
            timer,
            self.queue.end,
        )
        self.assist = Assist(state, self.conversations, sessions, self.bus)
        snapshots = Snapshots(self.conversations, self.bus, topology, ss.idle_timeout_s)
        rejoin = RejoinTokens(self.bus)
        self.door = Door(
            state,
            self.agents,
            self.actions,
            self.assist,
            snapshots,
            rejoin,
            topology.limits,
            timer,
            lambda: spawn(self.queue.refresh()),
        )
        topology.on_beat(self.beat)

    # -- what the hub calls ---------------------------------------------------------------------
    def on_event(self, event: se.SessionEvent) -> None:
        """A session event from the hub, to the conversations' hook (`SessionEvents` logs a failure)."""
        conversations = self.conversations
        match event:
            case se.Attached(session, client_name, resumed):
                conversations.attached(session, client_name, resumed)
                self.queue.attached(session)
            case se.Detached(session):
                conversations.detached(session)
            case se.Dropped(session):
                waiting = self.queue.waiting(session.id)
                if conversations.drop(session):
                    self.actions.cancel_release(session.id)
                    if not conversations.closing:
                        self.queue.dropped(session.id, waiting)
            case se.TurnStarted(session, request_id, text):
                conversations.user_message(session, request_id, text)
            case se.Forwarded(session, request_id, text):
                conversations.user_message(session, request_id, text, to_agent=True)
            case se.Token(session, request_id, text):
                conversations.bot_token(session, request_id, text)
            case se.TurnFinished(session, request_id, reply, finish_reason, sources):
                conversations.bot_done(session, request_id, reply, finish_reason, sources)
            case se.Tagged(session, request_id, task, output):
                conversations.auto_result(session, request_id, task, output)
                self.queue.tagged(session)
            case se.Signalled(session, _, signals):
                self.queue.turn_ended(session, signals)
            case se.Cleared(session):
                conversations.reset(session)
                if (conv := conversations.get(session.id)) is not None:
                    self.queue.end(conv)  # a customer who starts over talks to the bot again
            case se.ActionCalled(session, request_id, call):
                conversations.action_called(session, request_id, call)

    async def resumed(self, found: Resumed) -> None:
        await self.actions.resumed(found)
        if self.queue.policy.enabled:  # clustered: a hand-off under way, as the record has it
            record = await self.bus.conversation(found.session.id)
            # another node served it last: its record is newer than what this node remembers
            if record is not None and record.get("node") != self.conversations.node_id:
                self.conversations.set_handoff(found.session.id, Waiting.from_json(record.get("handoff")))

    def to_people(self, session: Session, text: str) -> bool:
        """Whether a customer message goes to people instead of the bot (the conversation waits)."""
        return self.queue.on_message(session, text)

    async def leave_email(self, session: Session, email: str) -> Event:
        """The e-mail a waiting customer leaves; the event that answers it (an error when not waiting)."""
        try:
            return await self.queue.leave_email(session, email)
        except NotWaiting as exc:
            return error_event(exc.code, exc.message)

    def holder(self, session: Session) -> Holder | None:
        """The agent answering this session instead of the bot, or None."""
        return self.conversations.holder_of(session.id)

    def agent_count(self) -> int:
        return self.agents.count()

    async def endpoint(self, ws: WebSocket) -> None:
        await self.door.endpoint(ws)

    def close_all(self) -> None:
        self.conversations.closing = True
        self.door.close()
        self.actions.close()

    # -- what the bus and the heartbeat call ----------------------------------------------------
    async def beat(self) -> None:
        """Clustered heartbeat: held take-overs renewed, conversations written and swept, and those
        whose holder's node died handed back."""
        await self.actions.renew_holds()
        await self.conversations.beat()
        await self.actions.expire_holders()
        await self.queue.refresh()

    async def _command(self, command: BusCommand) -> None:
        await self.actions.apply(command)

    def _resync(self) -> None:
        self.door.resync()

    def _holder_of(self, session_id: str) -> Holder | None:
        return self.conversations.holder_of(session_id)
