"""A stateless task's prompts as token ids: `Prompts` renders an input, the fixed prefix tokenized once.

Every call of a template starts with the same prefix tokens, so calls share their KV.
"""

from __future__ import annotations

from typing import NamedTuple

from ..engine.backend import Tokenizer
from .declare import Choices, Task, TaskError, require_chat_template


class Template(NamedTuple):
    """A prompt template split at {text}."""

    prefix: list[int]  # token ids of everything before the input: the task's own text
    glue: str  # text put before the input when it is tokenized
    suffix: str  # the raw text after the input


class Rendered(NamedTuple):
    """One input's prompt, and what it was rendered from."""

    ids: list[int]
    choices: Choices | None
    template: str
    chat: bool


class Prompts:
    """Renders a task's inputs; keeps the token ids of templates, suffixes and label candidates."""

    def __init__(self, task: Task, tokenizer: Tokenizer):
        self.task = task
        self.tokenizer = tokenizer
        self._templates: dict[tuple[str, bool], Template] = {}
        self._suffixes: dict[str, list[int]] = {}
        self._candidates: dict[tuple[tuple[str, str], ...], list[list[int]]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_input(self, text: str) -> list[int]:
        """User text: special-token strings in it (e.g. "<|im_end|>") stay plain text."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        except TypeError:  # a tokenizer without the option
            return self.encode(text)

    def template(self, template: str, chat: bool) -> Template:
        """The template split at {text}, in the chat template where `chat`; computed once."""
        key = (template, chat)
        if key not in self._templates:
            marker = "\x00TEXT\x00"
            rendered = template.replace("{text}", marker)
            if chat:
                require_chat_template(self.tokenizer)
                messages = [{"role": "user", "content": rendered}]
                if self.task.system_prompt:
                    messages.insert(0, {"role": "system", "content": self.task.system_prompt})
                rendered = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            before, after = rendered.split(marker)
            # The prefix keeps its trailing space as its own token ("Message: " + "great"): on the dev
            # split that scored better with the embedded model than letting the space glue onto the
            # text (" great"; docs/sentiment-research.md). `glue` is where that choice would go.
            self._templates[key] = Template(self.encode(before), "", after)
        return self._templates[key]

    def public_tokens(self, template: str, chat: bool) -> int:
        """How many of a prompt's first tokens are the task's own text (shared across callers)."""
        return len(self.template(template, chat).prefix)

    def suffix_ids(self, suffix: str) -> list[int]:
        ids = self._suffixes.get(suffix)
        if ids is None:
            ids = self._suffixes[suffix] = self.encode(suffix)
        return ids

    def candidate_ids(self, choices: Choices) -> list[list[int]]:
        """Each label's verbalizer as token ids, in label order."""
        key = tuple(choices.labels.items())
        ids = self._candidates.get(key)
        if ids is None:
            ids = self._candidates[key] = [self.encode(words) for words in choices.labels.values()]
        return ids

    def render(self, text: str) -> Rendered:
        """A cleaned input's prompt, within the token limit (`truncate` says how)."""
        template, choices, chat = self.task.select(text)
        split = self.template(template, chat)
        body = self.encode_input(split.glue + text)
        if len(body) > self.task.max_input_tokens:
            if self.task.truncate == "reject":
                raise TaskError(
                    "input_too_long",
                    f"{self.task.name}: text has {len(body)} tokens, the limit "
                    f"is {self.task.max_input_tokens}",
                )
            keep = self.task.max_input_tokens
            body = body[:keep] if self.task.truncate == "head" else body[-keep:]
        return Rendered(split.prefix + body + self.suffix_ids(split.suffix), choices, template, chat)

    def filled(self, template: str, chat: bool, text: str) -> list[int]:
        """The template around `text` as is (a calibration input: no limit applies)."""
        split = self.template(template, chat)
        return split.prefix + self.encode_input(split.glue + text) + self.suffix_ids(split.suffix)
