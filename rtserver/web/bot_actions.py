"""The bot's actions in a chat turn: which rule fires for a customer message, and the reply it makes.

`BotActions.answer` is asked before a turn's generation. Where an action's rule fires, the turn streams
the action's reply (`ActionReply`, a `Generation` with no model work) instead of the model's. The reply is
a sentence made from the result by the plugin's template, not the model's words: a 135M model does not
copy a status reliably. It is the bot's reply in the history, so later turns see the result.

A message that looks like a tool call runs nothing. Calls are bounded per session and per client
address (`[actions]`); beyond, the customer is told so and no handler runs. Each call, refused or not,
is published to agents (`ActionCalled`). Any failure here leaves the turn to the model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from ..engine.backend import FinishReason, SequenceResult, TokenEvent, Usage
from ..tasks.actions import LIMITED_REPLY, Action, Arguments, Outcome, call, looks_like_call
from . import session_events as se
from .ratelimit import IPRateLimiter
from .session import Session
from .session_events import SessionEvents
from .state import AppState

log = logging.getLogger("rtserver.actions")
NO_TOKEN = -1  # an action reply's text event: no model token made it


class BotActions:
    """The actions of this node's chat turns, with their per-session and per-address counts."""

    def __init__(self, state: AppState, events: SessionEvents):
        self.state = state
        self.events = events
        per_min = state.settings.actions.calls_per_min_per_ip
        self.per_ip = IPRateLimiter(per_min / 60, max(1, int(per_min)))
        self.calls: dict[str, int] = {}  # session id -> action calls it made
        events.subscribe(self._forget)

    @property
    def actions(self) -> dict[str, Action]:
        if not self.state.settings.actions.enabled or self.state.status != "ready":
            return {}
        return self.state.tasks.actions

    async def answer(
        self, session: Session, request_id: str, text: str, client_key: str
    ) -> ActionReply | None:
        """The reply of the action whose rule fires for `text` (the cleaned message), or None: the model
        answers. Never raises.
        """
        actions = self.actions
        if not actions:
            return None
        try:
            if looks_like_call(text, tuple(actions)):
                log.info("session %s: a message that looks like a call runs no action", session.id)
                return None
            for action in actions.values():
                arguments = await self._fires(action, text, session)
                if arguments is not None:
                    return ActionReply(self, session, request_id, action, arguments, client_key)
        except Exception as exc:  # a rule that cannot be checked leaves the turn to the model
            log.warning("session %s: action rules not checked (%s: %s)", session.id, type(exc).__name__, exc)
        return None

    async def _fires(self, action: Action, text: str, session: Session) -> Arguments | None:
        """The arguments `action`'s rule reads from `text` where it fires, else None."""
        rule = action.rule
        if rule is None:
            return None
        arguments = rule.extract(text)
        if any(name not in arguments for name in action.required):
            return None
        if rule.words_match(text) or not (rule.intents or rule.words):
            return arguments
        if not rule.intents:
            return None
        return arguments if await self._intent(text, session) in rule.intents else None

    async def _intent(self, text: str, session: Session) -> object:
        """The intent task's label for `text`, cached per session; None without that task."""
        name = self.state.settings.actions.intent_task
        registry = self.state.tasks
        if name not in registry.tasks:
            return None
        out = await registry.run(self.state.backend_for(name), name, text, scope=("actions", session.id))
        return out.output.get("label") if isinstance(out.output, dict) else None

    def admit(self, session: Session, client_key: str) -> bool:
        """Count a call against the session's and the address's bounds; False where over either."""
        cap = self.state.settings.actions.max_calls_per_session
        made = self.calls.get(session.id, 0)
        if cap and made >= cap:
            return False
        if self.per_ip.enabled and self.per_ip.take(client_key) > 0:
            return False
        self.calls[session.id] = made + 1
        return True

    def _forget(self, event: se.SessionEvent) -> None:
        if isinstance(event, se.Dropped):
            self.calls.pop(event.session.id, None)


class ActionReply:
    """A turn's reply made by an action: a `Generation` whose one text event is the action's sentence.
    The call starts when the turn first reads it; `cancel` stops it.
    """

    def __init__(
        self,
        owner: BotActions,
        session: Session,
        request_id: str,
        action: Action,
        arguments: Arguments,
        client_key: str,
    ):
        self.owner, self.session, self.request_id = owner, session, request_id
        self.action, self.arguments, self.client_key = action, arguments, client_key
        self.started = time.monotonic()
        self._task: asyncio.Task[Outcome] | None = None
        self._cancelled = False

    def _run(self) -> asyncio.Task[Outcome]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._call())
        return self._task

    async def _call(self) -> Outcome:
        if not self.owner.admit(self.session, self.client_key):
            outcome = Outcome(
                self.action.name, self.arguments, "limited", LIMITED_REPLY, error="over the call bounds"
            )
        else:
            outcome = await call(self.action, self.arguments)
        log.info(
            "session %s: action %s %s in %.0f ms%s",
            self.session.id,
            outcome.action,
            outcome.status,
            outcome.ms,
            f" ({outcome.error})" if outcome.error else "",
        )
        self.owner.events.publish(se.ActionCalled(self.session, self.request_id, outcome.to_json()))
        return outcome

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        outcome = await self._outcome()
        if outcome is not None:
            yield TokenEvent(NO_TOKEN, outcome.reply)

    async def _outcome(self) -> Outcome | None:
        if self._cancelled:
            return None
        try:
            return await self._run()
        except asyncio.CancelledError:
            if self._cancelled:
                return None
            raise

    async def result(self) -> SequenceResult:
        outcome = await self._outcome()
        ms = (time.monotonic() - self.started) * 1000
        if outcome is None:
            return SequenceResult("", [], FinishReason.CANCELLED, Usage(), 0.0, None, ms)
        return SequenceResult(outcome.reply, [], FinishReason.EOS, Usage(), 0.0, ms, ms)

    def cancel(self) -> None:
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()
