"""The bot's actions in a chat turn: which rule fires for a customer message, and the reply it makes.

`BotActions.answer` is asked before a turn's generation. Where an action's rule fires, the turn streams
the action's reply (`ActionReply`, a `Generation` with no model work) instead of the model's. Else, where
the chat template takes tools, the model may call an action itself (`ModelCallReply`): the actions are
its tools, a call's arguments follow their schema while decoding, and text replies stream as usual.

Either way the reply is a sentence made from the result by the plugin, not the model's words: a 135M
model does not copy a status reliably. It is the bot's reply in the history, so later turns see the
result.

A message that looks like a tool call runs nothing. Calls are bounded per session and per client
address (`[actions]`); beyond, the customer is told so and no handler runs. Each call, refused or not,
is published to agents (`ActionCalled`). Any failure here leaves the turn to the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from ..engine.backend import (
    FinishReason,
    Generation,
    OutputFormat,
    SamplingParams,
    SequenceResult,
    StructuredOutput,
    TokenEvent,
    Usage,
)
from ..tasks.actions import LIMITED_REPLY, Action, Arguments, Outcome, call, looks_like_call
from ..tasks.chat import ChatTurn
from ..tasks.tool_calls import (
    AUTO,
    CallReader,
    CallSyntax,
    ChatMessage,
    Tool,
    ToolChoice,
    encode_tool_chat,
    parse_tool_calls,
    template_syntax,
    tool_call_format,
)
from . import session_events as se
from .ratelimit import IPRateLimiter
from .session import Session
from .session_events import SessionEvents
from .state import AppState

log = logging.getLogger("rtserver.actions")
NO_TOKEN = -1  # an action reply's text event: no model token made it
Start = Callable[[list[int], SamplingParams], Awaitable[Generation]]  # a held generation of the turn


class BotActions:
    """The actions of this node's chat turns, with their per-session and per-address counts."""

    def __init__(self, state: AppState, events: SessionEvents):
        self.state = state
        self.events = events
        self.choice: ToolChoice = AUTO  # whether the model must call (tests force `required`)
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
        self,
        session: Session,
        request_id: str,
        turn: ChatTurn,
        client_key: str,
        params: SamplingParams,
        start: Start,
    ) -> Generation | None:
        """The reply of the action whose rule fires for the turn's message; else, where the model may call
        actions, its reply with them as tools; else None: the model answers as usual. Only a generation's
        own start raises.
        """
        actions = self.actions
        if not actions:
            return None
        text = turn.text
        try:
            if looks_like_call(text, tuple(actions)):
                log.info("session %s: a message that looks like a call runs no action", session.id)
                return None
            for action in actions.values():
                arguments = await self._fires(action, text, session)
                if arguments is not None:
                    return ActionReply(self, session, request_id, action, arguments, client_key)
            syntax = self._model_syntax()
        except Exception as exc:  # a rule that cannot be checked leaves the turn to the model
            log.warning("session %s: action rules not checked (%s: %s)", session.id, type(exc).__name__, exc)
            return None
        if syntax is None:
            return None
        reply = ModelCallReply(self, session, request_id, client_key, list(actions.values()), syntax)
        try:
            prompt, fmt = await reply.prepare(turn)
        except Exception as exc:  # a history the template cannot render with tools: answered without them
            log.warning("session %s: no tools this turn (%s: %s)", session.id, type(exc).__name__, exc)
            return None
        reply.stream = await start(prompt, dataclasses.replace(params, output=fmt))
        return reply

    def _model_syntax(self) -> CallSyntax | None:
        """How the chat model writes a call, where it may call actions: `[actions] model_calls`, a template
        that takes tools, a backend that constrains output. Else None."""
        backend = self.state.backend
        if not self.state.settings.actions.model_calls or not isinstance(backend, StructuredOutput):
            return None
        return template_syntax(backend.tokenizer)

    async def _fires(self, action: Action, text: str, session: Session) -> Arguments | None:
        """The arguments `action`'s rule reads from `text` where it fires, else None."""
        rule = action.rule
        if rule is None:
            return None
        arguments = rule.extract(text)
        if any(name not in arguments for name in action.required) or rule.excluded(text):
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

    async def run(
        self, session: Session, request_id: str, action: Action, arguments: Arguments, client_key: str
    ) -> Outcome:
        """One call within the bounds, told to agents."""
        if not self.admit(session, client_key):
            outcome = Outcome(action.name, arguments, "limited", LIMITED_REPLY, error="over the call bounds")
        else:
            outcome = await call(action, arguments)
        log.info(
            "session %s: action %s %s in %.0f ms%s",
            session.id,
            outcome.action,
            outcome.status,
            outcome.ms,
            f" ({outcome.error})" if outcome.error else "",
        )
        self.state.metrics.actions.labels(outcome.action, outcome.status).inc()
        self.events.publish(se.ActionCalled(session, request_id, outcome.to_json()))
        return outcome

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
        return await self.owner.run(
            self.session, self.request_id, self.action, self.arguments, self.client_key
        )

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


class ModelCallReply:
    """A turn's reply where the model may call an action. Its text streams as it comes; a call is held,
    run, and the action's sentence is the reply. `BotActions.answer` starts its generation.
    """

    def __init__(
        self,
        owner: BotActions,
        session: Session,
        request_id: str,
        client_key: str,
        actions: list[Action],
        syntax: CallSyntax,
    ):
        self.owner, self.session, self.request_id, self.client_key = owner, session, request_id, client_key
        self.actions = {a.name: a for a in actions}
        self.tools = [Tool(a.name, a.description, a.parameters) for a in actions]
        self.syntax = syntax
        self.started = time.monotonic()
        self.stream: Generation | None = None
        self.text = ""  # the reply as the customer got it
        self.outcome: Outcome | None = None
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._cancelled = False

    async def prepare(self, turn: ChatTurn) -> tuple[list[int], OutputFormat]:
        """The prompt with the actions as tools, the history as the template renders it with them, and
        the format of its reply (compiled here, off the event loop)."""
        chat = self.owner.state.tasks.chat
        messages = [ChatMessage(m["role"], m["content"]) for m in turn.history]
        prompt, self.syntax = encode_tool_chat(
            chat.tokenizer, messages, self.tools, chat.task.system_prompt or ""
        )
        fmt = tool_call_format(self.tools, self.owner.choice, self.syntax)
        backend = self.owner.state.backend
        if isinstance(backend, StructuredOutput):
            await backend.prepare_output(fmt)
        return prompt.ids, fmt

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        assert self.stream is not None
        reader = CallReader(self.syntax)
        try:
            async for event in self.stream:
                shown, _ = reader.feed(event.text)
                if shown:
                    self.text += shown
                    yield TokenEvent(event.token_id, shown)
            shown, _ = reader.end()
            if shown:
                self.text += shown
                yield TokenEvent(NO_TOKEN, shown)
            result = await self.stream.result()
            calls = parse_tool_calls(result.text, self.tools, self.syntax) if reader.mode == "calls" else []
            if calls and not self._cancelled and result.finish_reason is not FinishReason.ERROR:
                first = calls[0]  # one call a turn: its sentence is the reply
                self.outcome = await self.owner.run(
                    self.session, self.request_id, self.actions[first.name], first.args(), self.client_key
                )
                self.text = self.outcome.reply
                yield TokenEvent(NO_TOKEN, self.text)
        finally:
            if not self._done.done():
                self._done.set_result(None)

    async def result(self) -> SequenceResult:
        assert self.stream is not None
        result = await self.stream.result()
        await self._done
        if self.outcome is None and result.finish_reason is FinishReason.ERROR:
            return result
        reason = result.finish_reason if self.outcome is None else FinishReason.EOS
        if self._cancelled and not self.text:
            reason = FinishReason.CANCELLED
        ms = (time.monotonic() - self.started) * 1000
        # no token ids: the session's next prompt is encoded anew (this one held the tools)
        return dataclasses.replace(result, text=self.text, token_ids=[], finish_reason=reason, total_ms=ms)

    def cancel(self) -> None:
        self._cancelled = True
        if self.stream is not None:
            self.stream.cancel()
