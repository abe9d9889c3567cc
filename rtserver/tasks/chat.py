"""The stateful chat task: how one chat turn becomes a prompt, for every front door.

`ChatTask.prepare_turn` continues from the last turn's ids. So a turn's cost does not grow with the history.
The history window is cut in big chunks, down to half its limits. So the prompt's start stays the same for
many turns, and the backend reuses the session's KV. Message contents are data, never template. Each is
tokenized on its own with special tokens split. Roles come only from the history. Only the template's header
and the system prompt (`public_tokens`) may be shared with other sessions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from ..config import ChatSettings
from ..engine.backend import Inserted, Tokenizer
from .citations import Retrieved, retrieved
from .declare import Task, TaskError, require_chat_template
from .kb_index import KnowledgeBase

Message = dict[str, str]  # {"role", "content"}: one chat message as the template renders it
CHAT = "chat"  # the chat's name where tasks are listed (`/v1/tasks`, the `ready` event)

# a stand-in for the next user message when its prefix is computed (its size decides whether the window
# would be cut)
NEXT_MESSAGE_SENTINEL = "QzxNextUserMessageSentinelQzx"


def _stand_in(i: int) -> str:
    """Message i's content while the template renders. It is letters only: templates may trim or escape
    other characters. All have one length and frame, so that none is part of another.
    """
    return "QzxMessage" + "".join(chr(ord("a") + i // 26**k % 26) for k in (3, 2, 1, 0)) + "Qzx"


@dataclass
class LastTurn:
    """A finished chat turn as the model saw it. The next prompt can reuse its exact tokens."""

    text: str  # the rendered prompt followed by the reply text
    ids: list[int]  # the prompt's ids followed by the generated ids (end-of-turn token excluded)


@dataclass(frozen=True)
class Conversation:
    """A live chat session as an assist call reads it. Holds the window the model saw, and its KV's key."""

    history: list[Message]
    last: LastTurn | None
    session_key: Hashable


@dataclass
class ChatPrompt:
    """A chat prompt. Holds its rendered text, its token ids and how many of those the server wrote."""

    rendered: str
    ids: list[int]
    public_tokens: int  # the ids before the first content a client or agent wrote


@dataclass
class ChatTurn:
    """A user message made ready for the model. `history` is the window to render, ending with it."""

    text: str  # the cleaned message
    history: list[Message]
    cut: bool  # whether older turns were dropped to fit the window
    rendered: str  # the window rendered by the chat template
    prompt_ids: list[int]  # its token ids, the last turn's own ids kept (`encode_chat`)
    public_tokens: int  # leading ids the server wrote (template header, system prompt): shareable
    sources: Retrieved | None = None  # with knowledge on: the articles the prompt gives, numbered
    inserted: Inserted | None = None  # where the sources sit in the prompt (the engine reuses their KV)
    plain: ChatPrompt | None = None  # with sources: the prompt without them, as the next turn sees it


def window(
    history: list[Message], max_turns: int, max_tokens: int, count_tokens: Callable[[list[Message]], int]
) -> tuple[list[Message], bool]:
    """(history to render, whether it was cut). `history` ends with the new user message.

    Limits are `max_turns` user turns and `max_tokens` rendered tokens. Over either, drop the oldest whole
    turns until at most half of each limit remains. The newest user message is always kept.
    """
    starts = [i for i, m in enumerate(history) if m["role"] == "user"]
    over_turns = max_turns > 0 and len(starts) > max_turns
    over_tokens = max_tokens > 0 and count_tokens(history) > max_tokens
    if not (over_turns or over_tokens):
        return history, False
    turn_target = max(1, max_turns // 2) if max_turns > 0 else len(starts)
    token_target = max(1, max_tokens // 2) if max_tokens > 0 else None
    # Keep the newest k turns: the largest k <= turn_target whose render fits token_target.
    k = min(turn_target, len(starts))
    while k > 1:
        candidate = history[starts[-k] :]
        if token_target is None or count_tokens(candidate) <= token_target:
            break
        k -= 1
    return history[starts[-k] :], True


def template_segments(tokenizer: Tokenizer, messages: list[Message]) -> list[tuple[str, bool]]:
    """The messages rendered through the chat template, generation prompt added. They come as (text,
    is_content) pieces. The template's own text and each message's content alternate, in order. Raises
    TaskError where the template does not render each content exactly once, in order.
    """
    require_chat_template(tokenizer)
    marks = [_stand_in(i) for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": mark} for m, mark in zip(messages, marks)],
        tokenize=False,
        add_generation_prompt=True,
    )
    segments: list[tuple[str, bool]] = []
    at = 0
    for m, mark in zip(messages, marks):
        i = rendered.find(mark, at)
        if i < 0 or rendered.count(mark) != 1:
            raise TaskError("internal", "the chat template does not render each message once, in order")
        segments += [(rendered[at:i], False), (m["content"], True)]
        at = i + len(mark)
    segments.append((rendered[at:], False))
    return segments


def _encode(tokenizer: Tokenizer, segments: list[tuple[str, bool]]) -> list[int]:
    """Token ids of segments. The template's keep their special tokens; contents are plain text."""
    ids: list[int] = []
    for text, content in segments:
        if not text:
            continue
        if content:
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        else:
            ids += tokenizer.encode(text, add_special_tokens=False)
    return ids


def _continued_at(segments: list[tuple[str, bool]], rendered: str, last: LastTurn | None) -> int | None:
    """The first segment after the last turn's text. Only where `rendered` continues it at a segment edge."""
    if last is None or not rendered.startswith(last.text):
        return None
    offset = 0
    for k, (text, _) in enumerate(segments):
        if offset == len(last.text):
            return k
        offset += len(text)
    return None


def encode_chat(
    tokenizer: Tokenizer, messages: list[Message], last: LastTurn | None = None, public_messages: int = 0
) -> ChatPrompt:
    """The prompt of chat messages. The first `public_messages` of them are the server's own (its system
    prompt). So their contents count as public.

    Re-tokenizing a reply does not always give back the tokens the model generated. BPE spells one text in
    several ways. Every token after the first difference would be prefilled again, although the session's KV
    holds it. So the prompt may continue the last turn's text at a special token. That is a hard token
    boundary, e.g. `<|im_end|>`. Then the last turn's own ids are kept and only the rest is tokenized.
    Otherwise all of it is: a cut window, an agent's reply, a new system prompt.
    """
    segments = template_segments(tokenizer, messages)
    rendered = "".join(text for text, _ in segments)
    private = 2 * public_messages + 1  # the segment of the first content the server did not write
    public = _encode(tokenizer, segments[:private])
    start = _continued_at(segments, rendered, last)
    if last is not None and start is not None:
        rest = _encode(tokenizer, segments[start:])
        if rest and rest[0] in tokenizer.all_special_ids:
            ids = last.ids + rest
            return ChatPrompt(rendered, ids, len(public) if ids[: len(public)] == public else 0)
    return ChatPrompt(rendered, public + _encode(tokenizer, segments[private:]), len(public))


def finished_turn(
    tokenizer: Tokenizer,
    rendered: str,
    prompt_ids: list[int],
    reply: str,
    generated_ids: list[int],
) -> LastTurn | None:
    """The LastTurn of a reply. None when its generated ids do not spell the reply kept in the history (a
    stop string cut it).
    """
    ids = list(generated_ids)
    while ids and ids[-1] in tokenizer.all_special_ids:
        ids.pop()
    if tokenizer.decode(ids) != reply:
        return None
    return LastTurn(rendered + reply, prompt_ids + ids)


def chat_task(settings: ChatSettings) -> Task:
    """The chat as a task declaration (`[chat]`). It is described and checked like every task. Raises
    ValueError naming a setting that cannot be used.
    """
    task = Task(
        name=CHAT,
        description="Multi-turn assistant; streams its reply and keeps the conversation between turns.",
        stateful=True,
        input_kind="chat",
        system_prompt=settings.system_prompt,
        max_input_chars=settings.max_input_chars,
        max_input_tokens=settings.max_input_tokens,
        truncate=settings.truncate,
        max_new_tokens=settings.max_new_tokens,
        stop=list(settings.stop),
        decoding=dict(settings.decoding),
        overridable={key: (span[0], span[1]) for key, span in settings.overridable.items() if len(span) == 2},
        max_history_turns=settings.max_history_turns,
        max_history_tokens=settings.max_history_tokens,
        speculate=True,
    )
    bad = [key for key, span in settings.overridable.items() if len(span) != 2]
    if bad:
        raise ValueError(f"overridable {bad[0]!r}: expected a [low, high] range")
    task.validate()
    return task


class ChatTask:
    """The chat task bound to a tokenizer. It prepares turns and renders a session's history window."""

    def __init__(self, task: Task, tokenizer: Tokenizer, knowledge: KnowledgeBase | None = None):
        self.task = task
        self.tokenizer = tokenizer
        self.knowledge = knowledge  # the articles session turns answer from, with citations
        self._generation: tuple[str, list[int]] | None = None  # see _generation_prompt
        # the ids of the articles' text: the sources' parts come back turn after turn
        self._part_ids = functools.lru_cache(maxsize=4096)(self._plain_ids)
        self.cut = functools.lru_cache(maxsize=4096)(self._cut)  # an article's text cut to its share

    # -- knowledge --------------------------------------------------------------------------------
    def retrieve(self, history: list[Message], text: str) -> Retrieved | None:
        """The sources for a customer message, found with the customer's message before it. None when
        knowledge is off.
        """
        kb = self.knowledge
        if kb is None or kb.index is None:
            return None
        before = next((m["content"] for m in reversed(history) if m["role"] == "user"), "")
        budget = kb.settings.source_tokens
        return retrieved(kb.search(f"{text}\n{before}"), budget, self.cut)

    def _with_sources(
        self, p: ChatPrompt, sources: Retrieved, parts: list[list[int]], text: str
    ) -> ChatTurn | None:
        """The turn whose prompt is the plain one `p` with the sources' parts before the message. Each part is
        tokenized on its own, and so is the message, as the next turn's prompt (without the sources) holds
        it. None where the template's prompt does not end as expected.
        """
        header, generation = self._generation_prompt()
        tail = self._plain_ids(text) + generation  # a customer's text is not kept in the cache
        start = len(p.ids) - len(tail)
        if start < p.public_tokens or p.ids[start:] != tail:
            return None
        ids, segments = p.ids[:start], []
        for piece in parts:
            segments.append((len(ids), len(ids) + len(piece)))
            ids = ids + piece
        at = len(p.rendered) - len(text) - len(header)
        rendered = p.rendered[:at] + sources.block + p.rendered[at:]
        block = Inserted(start, len(ids), tuple(segments))
        return ChatTurn(text, [], False, rendered, ids + tail, p.public_tokens, sources, block, p)

    def _generation_prompt(self) -> tuple[str, list[int]]:
        """The template's text after the last user message (the assistant's header), and its ids."""
        if self._generation is None:
            text = template_segments(self.tokenizer, [{"role": "user", "content": "x"}])[-1][0]
            self._generation = text, _encode(self.tokenizer, [(text, False)])
        return self._generation

    def _plain_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def finished(self, turn: ChatTurn, reply: str, generated_ids: list[int]) -> LastTurn | None:
        """The LastTurn a turn leaves. A knowledge turn's is its prompt without the sources: the next turn
        leaves them out, and the engine moves the KV after them back.
        """
        p = turn.plain or ChatPrompt(turn.rendered, turn.prompt_ids, turn.public_tokens)
        return self.finished_turn(p.rendered, p.ids, reply, generated_ids)

    def _cut(self, text: str, tokens: int) -> str:
        """The text's first `tokens` tokens, as text."""
        ids = self._part_ids(text)
        if len(ids) <= tokens:
            return text
        return self.tokenizer.decode(ids[:tokens], skip_special_tokens=True).rstrip("\ufffd") + "…"

    # -- a new user message -----------------------------------------------------------------------
    def clean_message(self, text: object) -> str:
        """The task's cleaning: control characters stripped, size checked. Then its token limit. A longer
        message keeps its newest `max_input_tokens` tokens, counted as the prompt holds it.
        """
        cleaned = self.task.clean_text(text)
        ids = self.tokenizer.encode(cleaned, add_special_tokens=False, split_special_tokens=True)
        limit = self.task.max_input_tokens
        if len(ids) <= limit:
            return cleaned
        return self.tokenizer.decode(ids[-limit:], skip_special_tokens=True).lstrip("\ufffd").strip()

    def prepare_turn(
        self, history: list[Message], text: object, last: LastTurn | None = None, knowledge: bool = False
    ) -> ChatTurn:
        """The cleaned message, the history window (ending with it) and its prompt. The prompt continues
        `last` (the session's last turn) where the window still starts with it. With `knowledge` the prompt
        gives the message's sources before it; the history keeps the message alone.
        """
        text = self.clean_message(text)
        sources = self.retrieve(history, text) if knowledge else None
        parts = [self._part_ids(part) for part in sources.parts] if sources is not None else []
        extra = sum(len(piece) for piece in parts)
        prompts: dict[int, ChatPrompt] = {}  # window size -> its prompt, as counted

        def count(candidate: list[Message]) -> int:
            # the window is measured in the tokens it is sent as; with the last turn's ids kept, only
            # the new text is tokenized, not the whole history again
            prompts[len(candidate)] = self.encode(candidate, last)
            return len(prompts[len(candidate)].ids) + extra

        window_, cut = window(
            history + [{"role": "user", "content": text}],
            self.task.max_history_turns,
            self.task.max_history_tokens,
            count,
        )
        p = prompts.get(len(window_)) or self.encode(window_, last)
        turn = self._with_sources(p, sources, parts, text) if sources is not None and parts else None
        if turn is None:  # no sources, or a template that does not end as expected: they are left out
            return ChatTurn(text, window_, cut, p.rendered, p.ids, p.public_tokens, sources)
        return dataclasses.replace(turn, history=window_, cut=cut)

    # -- rendering --------------------------------------------------------------------------------
    def _messages(self, history: list[Message], system: bool = True) -> tuple[list[Message], int]:
        """(messages to render, how many of them lead as the server's own). The task's system prompt goes
        first. Not if the history brings one, or if `system` is False.
        """
        messages = list(history)
        if system and self.task.system_prompt and not (messages and messages[0].get("role") == "system"):
            return [{"role": "system", "content": self.task.system_prompt}, *messages], 1
        return messages, 0

    def encode(
        self, history: list[Message], last: LastTurn | None = None, *, system: bool = True
    ) -> ChatPrompt:
        """The prompt of a history, its contents as plain text. It reuses the last turn's own ids. With
        `system` False the messages are rendered as given. That serves the OpenAI door's own system
        messages.
        """
        messages, public = self._messages(history, system)
        return encode_chat(self.tokenizer, messages, last, public)

    def render(self, history: list[Message]) -> list[int]:
        """Token ids of the history as a prompt. The task's system prompt goes first unless it has one."""
        return self.encode(history).ids

    def render_text(self, history: list[Message]) -> str:
        """The prompt as text (what `render` tokenizes, piece by piece)."""
        return "".join(text for text, _ in template_segments(self.tokenizer, self._messages(history)[0]))

    def continued(self, conversation: Conversation, instruction: str) -> ChatPrompt | None:
        """The conversation's prompt as its next reply would see it. `instruction`, if any, follows it as a
        system message. None where the template cannot render that (roles must alternate).
        """
        extra = [{"role": "system", "content": instruction}] if instruction else []
        try:
            return self.encode([*conversation.history, *extra], conversation.last)
        except (TaskError, TemplateError):  # e.g. "Conversation roles must alternate"
            return None

    def prompt(self, history: list[Message], last: LastTurn | None) -> tuple[str, list[int]]:
        """(rendered text, token ids) of a session's prompt. It reuses the last turn's own ids."""
        p = self.encode(history, last)
        return p.rendered, p.ids

    def finished_turn(
        self, rendered: str, prompt_ids: list[int], reply: str, generated_ids: list[int]
    ) -> LastTurn | None:
        return finished_turn(self.tokenizer, rendered, prompt_ids, reply, generated_ids)

    def next_turn_prefix(self, history: list[Message], last: LastTurn | None) -> list[int] | None:
        """The token ids the next turn's prompt will start with. They run up to where the next user message
        goes. None where that cannot be known safely. `history` ends with the reply just given.

        Safe means two things. The window would not be cut by a message of the stand-in's size. And the
        prompt continues the last turn's own ids: the template renders the finished turn the same once
        another follows. Each content is tokenized on its own. So the ids before the next one's content do
        not change with it. The ids are computed exactly as `prepare_turn` will.
        """
        if last is None or not history or history[-1].get("role") != "assistant":
            return None
        probe = history + [{"role": "user", "content": NEXT_MESSAGE_SENTINEL}]
        prompts: list[ChatPrompt] = []

        def count(h: list[Message]) -> int:  # counted as `prepare_turn` will count
            prompts.append(self.encode(h, last))
            return len(prompts[-1].ids)

        try:
            _, cut = window(probe, self.task.max_history_turns, self.task.max_history_tokens, count)
            if cut:
                return None  # the next prompt starts elsewhere: nothing of this prefix would be reused
            p = prompts[-1] if prompts else self.encode(probe, last)
            segments = template_segments(self.tokenizer, self._messages(probe)[0])
        except TaskError:
            return None
        if p.ids[: len(last.ids)] != last.ids:
            return None  # the template renders the finished turn differently once another follows
        after = len(_encode(self.tokenizer, segments[-2:]))  # the message and the generation prompt
        return p.ids[: len(p.ids) - after]

    def parse(self, text: str) -> dict[str, object]:
        return self.task.parser(text) if self.task.parser else {"reply": text}
