"""The stateful chat task: how one chat turn becomes a prompt, for every front door (WebSocket sessions,
the agent console, the HTTP API).

`ChatTask.prepare_turn` cleans the user's message (control characters stripped, the newest part kept
within the task's token limit), windows the history and renders the window through the tokenizer's
chat template, continuing from the model's own reply tokens of the last turn (`continue_prompt`): only
the text after the last turn is tokenized, so a turn's cost does not grow with the history.

History window (chunked cut): the history is a list of `{"role", "content"}` messages. Before a new
user turn is rendered, if the history plus that turn has more than `max_history_turns` user turns or
its rendered prompt has more than `max_history_tokens` tokens, the oldest whole turns are dropped until
the window is at most HALF of those limits. Cutting in big chunks instead of one turn per message keeps
the rendered prompt's beginning identical for many turns in a row, so the backend (which reuses a
session's KV by longest common token prefix) recomputes only the new tokens on most turns and the whole
window only once per cut.

Next-turn prefix (`ChatTask.next_turn_prefix`): when a reply ends, the tokens that will come before the
next user message are known already (the history, the end of the assistant turn and the next user
turn's header), so a backend can compute them before that message arrives. They are found from the
chat template itself: the history is rendered with a sentinel user message and the text before the
sentinel is kept, only where that split is safe (see the method).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.backend import Tokenizer
from .declare import Task

# a stand-in for the next user message: letters only (templates may trim or escape other characters)
NEXT_MESSAGE_SENTINEL = "QzxNextUserMessageSentinelQzx"
# messages whose tokens must not merge with the header before them (cleaned messages start with a
# non-space character): a word, a capital, a digit, punctuation, CJK and an emoji
BOUNDARY_PROBES = ("hello", "Hello", "1", "?", "你好", "🙂")


@dataclass
class LastTurn:
    """A finished chat turn as the model saw it, so that the next prompt can reuse its exact tokens."""

    text: str  # the rendered prompt followed by the reply text
    ids: list[int]  # the prompt's ids followed by the generated ids (end-of-turn token excluded)


@dataclass
class ChatTurn:
    """A user message made ready for the model: `history` is the window to render, ending with it."""

    text: str  # the cleaned message
    history: list[dict]
    cut: bool  # whether older turns were dropped to fit the window
    rendered: str  # the window rendered by the chat template
    prompt_ids: list[int]  # its token ids, the last turn's own ids kept (`continue_prompt`)


def window(
    history: list[dict], max_turns: int, max_tokens: int, count_tokens: Callable[[list[dict]], int]
) -> tuple[list[dict], bool]:
    """(history to render, whether it was cut). `history` ends with the new user message.

    When over `max_turns` user turns or `max_tokens` rendered tokens, drop the oldest whole turns until
    at most half of each limit remains (the newest user message is always kept).
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


def continue_prompt(tokenizer: Tokenizer, rendered: str, last: LastTurn | None) -> list[int]:
    """Token ids of a rendered chat prompt.

    Re-tokenizing a reply does not always give back the tokens the model generated (BPE spells one
    text in several ways), and every token after the first difference would be prefilled again
    although the session's KV holds it. So when `rendered` continues the last turn's text at a special
    token (a hard token boundary, e.g. `<|im_end|>`), the last turn's own ids are kept and only the
    rest is tokenized; otherwise (a cut window, an agent's reply, a new system prompt) all of it is.
    """
    kept, _, rest = _split_prompt(tokenizer, rendered, last)
    return kept + rest


def _split_prompt(
    tokenizer: Tokenizer, rendered: str, last: LastTurn | None
) -> tuple[list[int], str, list[int]]:
    """`continue_prompt` in parts: (the last turn's ids kept, the text tokenized after them, its ids)."""
    if last is not None and rendered.startswith(last.text):
        text = rendered[len(last.text) :]
        rest = tokenizer.encode(text, add_special_tokens=False)
        if rest and rest[0] in tokenizer.all_special_ids:
            return last.ids, text, rest
    return [], rendered, tokenizer.encode(rendered, add_special_tokens=False)


def finished_turn(
    tokenizer: Tokenizer,
    rendered: str,
    prompt_ids: list[int],
    reply: str,
    generated_ids: list[int],
) -> LastTurn | None:
    """The LastTurn of a reply, or None when its generated ids do not spell the reply kept in the
    history (a stop string cut it)."""
    ids = list(generated_ids)
    while ids and ids[-1] in tokenizer.all_special_ids:
        ids.pop()
    if tokenizer.decode(ids) != reply:
        return None
    return LastTurn(rendered + reply, prompt_ids + ids)


class ChatTask:
    """The chat task bound to a tokenizer: prepares turns and renders a session's history window."""

    def __init__(self, task: Task, tokenizer: Tokenizer):
        self.task = task
        self.tokenizer = tokenizer

    # -- a new user message -----------------------------------------------------------------------
    def clean_message(self, text: Any) -> str:
        """The task's cleaning (control characters stripped, size checked), then its token limit: a
        longer message keeps its newest `max_input_tokens` tokens."""
        text = self.task.clean_text(text)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        limit = self.task.max_input_tokens
        if len(ids) <= limit:
            return text
        return self.tokenizer.decode(ids[-limit:], skip_special_tokens=True).lstrip("\ufffd").strip()

    def prepare_turn(self, history: list[dict], text: Any, last: LastTurn | None = None) -> ChatTurn:
        """The cleaned message, the history window (ending with it) and its prompt, continuing `last`
        (the session's last turn) where the window still starts with it."""
        text = self.clean_message(text)
        prompts: dict[int, tuple[str, list[int]]] = {}  # window size -> its prompt, as counted

        def count(candidate: list[dict]) -> int:
            # the window is measured in the tokens it is sent as; with the last turn's ids kept, only
            # the new text is tokenized, not the whole history again
            prompts[len(candidate)] = self.prompt(candidate, last)
            return len(prompts[len(candidate)][1])

        window_, cut = window(
            history + [{"role": "user", "content": text}],
            self.task.max_history_turns,
            self.task.max_history_tokens,
            count,
        )
        rendered, ids = prompts.get(len(window_)) or self.prompt(window_, last)
        return ChatTurn(text, window_, cut, rendered, ids)

    # -- rendering --------------------------------------------------------------------------------
    def _messages(self, history: list[dict]) -> list[dict]:
        messages = list(history)
        if self.task.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.task.system_prompt})
        return messages

    def render(self, history: list[dict]) -> list[int]:
        """Token ids of the history as a prompt (the task's system prompt first unless it has one)."""
        return self.tokenizer.apply_chat_template(
            self._messages(history), tokenize=True, add_generation_prompt=True, return_dict=False
        )

    def render_text(self, history: list[dict]) -> str:
        """The prompt as text (what `render` tokenizes)."""
        return self.tokenizer.apply_chat_template(
            self._messages(history), tokenize=False, add_generation_prompt=True
        )

    def prompt(self, history: list[dict], last: LastTurn | None) -> tuple[str, list[int]]:
        """(rendered text, token ids) of a session's prompt, reusing the last turn's own ids."""
        rendered = self.render_text(history)
        return rendered, continue_prompt(self.tokenizer, rendered, last)

    def finished_turn(
        self, rendered: str, prompt_ids: list[int], reply: str, generated_ids: list[int]
    ) -> LastTurn | None:
        return finished_turn(self.tokenizer, rendered, prompt_ids, reply, generated_ids)

    def next_turn_prefix(self, history: list[dict], last: LastTurn | None) -> list[int] | None:
        """The token ids the next turn's prompt will start with, up to where the next user message
        goes; None where that cannot be known safely. `history` ends with the reply just given.

        Safe means: the template renders the history with a sentinel message as the history followed
        by some text, the sentinel once (nothing after the message depends on it before it), the
        window would not be cut by a message of that size, and the tokens up to the message do not
        change with the message (tokenized with a few different messages, the prefix's tokens stay a
        prefix). The ids are computed exactly as `prompt` will (the last turn's own ids kept)."""
        if last is None or not history or history[-1].get("role") != "assistant":
            return None
        probe = history + [{"role": "user", "content": NEXT_MESSAGE_SENTINEL}]
        _, cut = window(
            probe,
            self.task.max_history_turns,
            self.task.max_history_tokens,
            lambda h: len(self.prompt(h, last)[1]),  # counted as `prepare_turn` will count
        )
        if cut:
            return None  # the next prompt starts elsewhere: nothing of this prefix would be reused
        rendered = self.render_text(probe)
        at = rendered.find(NEXT_MESSAGE_SENTINEL)
        if at < 0 or rendered.find(NEXT_MESSAGE_SENTINEL, at + 1) >= 0:
            return None
        before = rendered[:at]
        if not before.startswith(last.text):
            return None  # the template renders the finished turn differently once another follows
        # as `prompt` will compute them; the tokenized part must not change with the message after it
        kept, text, head = _split_prompt(self.tokenizer, before, last)
        for message in BOUNDARY_PROBES:
            if self.tokenizer.encode(text + message, add_special_tokens=False)[: len(head)] != head:
                return None  # the header's last token merges with the message: not a safe split
        return kept + head

    def parse(self, text: str) -> dict:
        return self.task.parser(text) if self.task.parser else {"reply": text}
