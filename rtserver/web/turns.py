"""Chat turns for every door. A turn is prepared, held, generated and streamed, then committed or rolled
back.

`ChatTurns` is the one turn service. The `/ws` hub runs a session's turn through `run`. A message for the
agent who holds a session goes through `forward`. `/chat`, `/v1/tasks/chat` and the OpenAI door run
stateless turns. They use `complete` (the whole reply) or `start` (a stream the door reads).

Every generation is held the same way. Its tokens are reserved against the client's budget. When it ends,
however it ends, what it really used is released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..engine.backend import (
    FinishReason,
    Generation,
    Inserted,
    NextTurnPrefetcher,
    SamplingParams,
    SequenceResult,
    Usage,
)
from ..tasks import citations
from ..tasks.chat import ChatTask, ChatTurn, LastTurn, Message
from ..tasks.citations import Retrieved, Source
from . import session_events as se
from .admission import Admission, Surface
from .bot_actions import BotActions
from .errors import GenerationFailed
from .handoff import TurnSignals
from .seams import SessionStore
from .session import Session, SessionTurn
from .session_events import SessionEvents
from .state import AppState

log = logging.getLogger("rtserver.turns")


@dataclass(frozen=True)
class Client:
    """Who asks. Holds the door's surface, the client's key (its budget) and name (the session record)."""

    surface: Surface
    key: str
    name: str | None = None


@dataclass(frozen=True)
class TurnResult:
    """A finished turn. Holds the generation's result and the reply as the chat parses it."""

    result: SequenceResult
    output: dict[str, object]  # the chat's parser's, e.g. {"reply": text}
    sources: tuple[Source, ...] = ()  # with knowledge on: the articles the reply cited
    unknown: bool = False  # with knowledge on: the reply took the "I don't know" path (asks for a person)


class TurnSink(Protocol):
    """How a door follows a session turn as it runs."""

    def submitted(self, stream: Generation) -> None:
        """The generation is queued: the door may cancel it from now on."""

    def started(self, text: str) -> None:
        """The customer's cleaned message is in the history."""

    async def token(self, text: str) -> None:
        """Text of the reply, as it comes."""

    async def done(self, done: TurnResult) -> bool:
        """The turn is stored. Tells whether its customer is still there (a next turn may come)."""

    async def failed(self, exc: Exception) -> None:
        """The turn failed and left no trace."""


def kept_prefix(prompt: list[int], last: LastTurn | None) -> int:
    """How many of the prompt's first tokens are the session's last turn. Their KV is kept."""
    if last is None or prompt[: len(last.ids)] != last.ids:
        return 0
    return len(last.ids)


class ChatTurns:
    """The one turn service every door calls."""

    def __init__(
        self,
        state: AppState,
        admission: Admission,
        store: SessionStore,
        events: SessionEvents,
        clock: Callable[[], float],
    ):
        self.state = state
        self.admission = admission
        self.store = store
        self.events = events
        self.clock = clock
        self.actions = BotActions(state, events)  # a rule that fires answers instead of the model

    @property
    def chat(self) -> ChatTask:
        return self.state.tasks.chat

    # -- the held generation -----------------------------------------------------------------------
    async def start(
        self,
        client: Client,
        prompt: list[int],
        params: SamplingParams,
        *,
        public_tokens: int = 0,
        session_key: str | None = None,
        counted: int | None = None,
        inserted: Inserted | None = None,
    ) -> Generation:
        """A generation on the chat backend. Its tokens are held against the client's budget until it ends.
        `counted`: the prompt tokens the client's rate pays (all of them unless said). `inserted`: the
        sources a knowledge turn holds (backend.Inserted).
        """
        holds = len(prompt) + params.max_new_tokens  # its whole prompt's KV and room for its reply
        if client.surface is Surface.API:  # the API waits its turn; the public door is refused at once
            held = await self.admission.reserve_queued(client.surface, client.key, holds)
        else:
            held = self.admission.reserve(client.surface, client.key, holds)
        try:
            stream = self.state.backend.generate(
                prompt, params, session_key=session_key, public_tokens=public_tokens, inserted=inserted
            )
        except BaseException:
            held.release(0)
            raise
        self.admission.release_when_done(held, stream, len(prompt) if counted is None else counted)
        return stream

    # -- stateless turns ---------------------------------------------------------------------------
    async def complete(
        self,
        client: Client,
        prompt: list[int],
        public_tokens: int,
        params: SamplingParams,
        endpoint: str,
        session_key: str | None = None,
    ) -> SequenceResult:
        """A whole reply (`start`, then waited for); GenerationFailed when it failed."""
        stream = await self.start(
            client, prompt, params, public_tokens=public_tokens, session_key=session_key
        )
        try:
            result = await stream.result()
        except asyncio.CancelledError:
            stream.cancel()
            raise
        if result.finish_reason is FinishReason.ERROR:
            raise GenerationFailed(result)
        self.state.metrics.observe_generation(endpoint, result)
        self.state.metrics.requests.labels(endpoint, "chat").inc()
        return result

    async def reply(
        self, client: Client, history: list[Message], params: SamplingParams, endpoint: str
    ) -> TurnResult:
        """A stateless turn over a history given whole. The history ends with the user's message."""
        chat = self.chat
        earlier = [
            m if m["role"] == "assistant" else {**m, "content": chat.clean_message(m["content"])}
            for m in history[:-1]
        ]
        turn = chat.prepare_turn(earlier, history[-1]["content"])
        result = await self.complete(client, turn.prompt_ids, turn.public_tokens, params, endpoint)
        return TurnResult(result, chat.parse(result.text))

    # -- session turns -----------------------------------------------------------------------------
    async def run(
        self,
        turn: SessionTurn,
        text: str,
        options: dict[str, object] | None,
        client: Client,
        sink: TurnSink,
    ) -> None:
        """A session's turn, told to `sink`. It is stored before it is acknowledged, else it leaves no
        trace.
        """
        session, request_id = turn.session, turn.request_id
        reply, reason, cited = None, "error", citations.Cited((), False)
        try:
            with turn:
                chat = self.chat
                prepared = chat.prepare_turn(
                    session.history, text, session.last_turn, knowledge=chat.knowledge is not None
                )
                stream, found, params = await self._generate(turn, prepared, options, client)
                sink.submitted(stream)
                turn.add_message(prepared.history, prepared.cut)
                self.events.publish(se.TurnStarted(session, request_id, prepared.text))
                sink.started(prepared.text)
                result = await self._streamed(stream, session, request_id, sink)
                if found is not None and result.finish_reason is not FinishReason.CANCELLED:
                    result, cited = await self._cite(
                        client, session, request_id, sink, prepared, found, params, result
                    )
                if result.text or result.finish_reason is not FinishReason.CANCELLED:
                    last = chat.finished(prepared, result.text, result.token_ids)
                    turn.add_reply(result.text, last)
                    await self.store.save(session, client.name)  # acknowledged only once stored
                    turn.commit()
                reply, reason = result.text, result.finish_reason.value
                # the hand-off policy's view of the turn (web/handoff.py)
                signals = TurnSignals(text=prepared.text, bot_unknown=cited.unknown)
                self.events.publish(se.Signalled(session, request_id, signals))
        except Exception as exc:
            await sink.failed(exc)
            return
        finally:
            self.events.publish(se.TurnFinished(session, request_id, reply, reason, cited.sources))
        self.state.metrics.observe_generation("ws_chat", result)
        self.state.metrics.requests.labels("ws", "chat").inc()
        if await sink.done(TurnResult(result, chat.parse(result.text), cited.sources, cited.unknown)):
            self.prefetch(session)

    async def _generate(
        self, turn: SessionTurn, prepared: ChatTurn, options: dict[str, object] | None, client: Client
    ) -> tuple[Generation, Retrieved | None, SamplingParams]:
        """The turn's generation: an action's reply where one fires, else the model's. With the sources
        it answers from (None: nothing to cite) and its sampling.
        """
        session = turn.session
        params = self.chat.task.sampling(options or None)

        async def held(ids: list[int], p: SamplingParams) -> Generation:  # an action turn's own
            return await self.start(client, ids, p, session_key=session.id)

        acted = await self.actions.answer(session, turn.request_id, prepared, client.key, params, held)
        if acted is not None:  # an action's sentence cites nothing
            return acted, None, params
        found = prepared.sources
        if found is not None:  # the answer, or the "I don't know" sentence alone
            params = dataclasses.replace(params, output=citations.answer_format(len(found.sources)))
        stream = await self.start(
            client,
            prepared.prompt_ids,
            params,
            public_tokens=prepared.public_tokens,
            session_key=session.id,
            # the client's rate pays only what is computed anew
            counted=len(prepared.prompt_ids) - kept_prefix(prepared.prompt_ids, session.last_turn),
            inserted=prepared.inserted,
        )
        return stream, found, params

    async def _streamed(
        self, stream: Generation, session: Session, request_id: str, sink: TurnSink
    ) -> SequenceResult:
        """A generation's text told to the sink and the console as it comes; its result."""
        async for event in stream:
            if event.text:
                await sink.token(event.text)
                self.events.publish(se.Token(session, request_id, event.text))
        result = await stream.result()
        if result.finish_reason is FinishReason.ERROR:
            raise GenerationFailed(result)
        return result

    async def _cite(
        self,
        client: Client,
        session: Session,
        request_id: str,
        sink: TurnSink,
        prepared: ChatTurn,
        found: Retrieved,
        params: SamplingParams,
        answer: SequenceResult,
    ) -> tuple[SequenceResult, citations.Cited]:
        """A knowledge reply's ending: the numbers of the sources it used, held to those given. It continues
        the answer's own tokens (their KV is the session's). The "I don't know" answer has none.
        """
        if citations.is_unknown(answer.text, found.sources):
            return answer, citations.Cited((), True)
        special = set(self.chat.tokenizer.all_special_ids)
        ids = list(answer.token_ids)
        while ids and ids[-1] in special:
            ids.pop()
        n = len(found.sources)
        ending = dataclasses.replace(
            params, output=citations.ending_format(n), max_new_tokens=citations.ending_tokens(n), stop=[]
        )
        prompt = prepared.prompt_ids + ids
        stream = await self.start(
            client, prompt, ending, public_tokens=prepared.public_tokens, session_key=session.id, counted=0
        )
        sink.submitted(stream)
        end = await self._streamed(stream, session, request_id, sink)
        cited = citations.parse(answer.text, end.text, found.sources)
        usage = Usage(
            prompt_tokens=answer.usage.prompt_tokens,
            cached_tokens=answer.usage.cached_tokens + end.usage.cached_tokens,
            generated_tokens=answer.usage.generated_tokens + end.usage.generated_tokens,
            prefilled_tokens=answer.usage.prefilled_tokens + end.usage.prefilled_tokens,
        )
        merged = dataclasses.replace(
            answer,
            text=answer.text + end.text,
            token_ids=ids + end.token_ids,
            finish_reason=end.finish_reason
            if end.finish_reason is FinishReason.CANCELLED
            else answer.finish_reason,
            usage=usage,
            total_ms=answer.total_ms + end.total_ms,
        )
        return merged, cited

    async def forward(self, session: Session, request_id: str, text: str, client: Client) -> str:
        """A customer message for the agent who holds the session. It is stored, then published. Returns the
        cleaned text. Raises what refused it (nothing is kept then).
        """
        prepared = self.chat.prepare_turn(session.history, text)
        kept = session.forward(prepared.history, prepared.cut)
        try:  # stored before it is acknowledged
            await self.store.save(session, client.name)
        except BaseException:
            session.restore(kept)
            raise
        session.touch(self.clock())
        self.events.publish(se.Forwarded(session, request_id, prepared.text))
        return prepared.text

    def prefetch(self, session: Session) -> None:
        """The reply has ended: let the chat backend compute the next prompt's start early. That start is
        the history, the end of the reply and the next user header. It runs before the next message comes.
        It runs only where it can (a remote backend) and where the template splits safely there. Best
        effort: it never raises into the ended turn.
        """
        if not self.state.settings.backend.prefetch_next_turn or session.last_turn is None:
            return
        try:
            backend = self.state.backend  # raises while the server stops
            if isinstance(backend, NextTurnPrefetcher):
                # computed when the backend sends the prefetch, not here: a client that answers at
                # once would otherwise wait for it
                backend.prefetch(
                    _NextPrefix(self.chat, list(session.history), session.last_turn), session_key=session.id
                )
        except Exception as exc:
            log.debug("no next-turn prefetch for session %s (%s)", session.id, exc)


@dataclass(frozen=True)
class _NextPrefix:
    """The next turn's prompt prefix, computed only when called."""

    chat: ChatTask
    history: list[Message]
    last: LastTurn

    def __call__(self) -> list[int] | None:
        return self.chat.next_turn_prefix(self.history, self.last)
