"""Citations: the numbered sources a prompt holds, the grammars a knowledge reply is held to, and its parse.

A knowledge reply has two parts. The answer comes first: free text, or the fixed "I don't know" sentence
(`answer_format`). Then, unless it did not know, its ending: `Sources:` and the numbers of the sources it
used, only those given (`ending_format`). Both are Lark grammars the engine enforces while decoding.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.backend import OutputFormat
from .kb_index import Hit

UNKNOWN = "I don't know the answer to that. Would you like me to get a person to help you?"
ENDING = "\n\nSources: "
QUESTION = "\nQuestion: "  # between the sources and the customer's message
INSTRUCTION = (
    "Answer the customer's question using only the sources below. "
    "If they do not answer it, say you don't know."
)


@dataclass(frozen=True)
class Source:
    """A cited article: its number in the prompt, title, url ("" = none) and id (its path)."""

    number: int
    title: str
    url: str
    article_id: str

    def json(self) -> dict[str, object]:
        return {"n": self.number, "title": self.title, "url": self.url, "id": self.article_id}


@dataclass(frozen=True)
class Cited:
    """A knowledge reply read back: the sources it cited and whether it took the "I don't know" path."""

    sources: tuple[Source, ...]
    unknown: bool


@dataclass(frozen=True)
class Retrieved:
    """A turn's sources: as numbered in the prompt, and the block of text that gives them to the model. The
    block comes in parts, each tokenized on its own and each a segment: the engine computes its KV once and
    reuses it (backend.Inserted).
    """

    sources: tuple[Source, ...]
    parts: tuple[str, ...]

    @property
    def block(self) -> str:
        """The text the model reads before the customer's message."""
        return "".join(self.parts)


def retrieved(hits: list[Hit], token_budget: int, cut: Callable[[str, int], str]) -> Retrieved:
    """The hits numbered [1].. in a prompt block. Each hit's text is cut by `cut(text, tokens)` to its share
    of `token_budget`.
    """
    if not hits:
        return Retrieved((), ())
    share = max(8, token_budget // len(hits))
    parts = [INSTRUCTION + "\n"]
    sources = []
    for n, hit in enumerate(hits, 1):
        sources.append(Source(n, hit.title, hit.url, hit.article_id))
        parts += [f"[{n}]", source_text(hit, share, cut)]
    parts.append(QUESTION)
    return Retrieved(tuple(sources), tuple(parts))


def source_text(hit: Hit, tokens: int, cut: Callable[[str, int], str]) -> str:
    """A source as the prompt gives it after its number: title, then its text cut to `tokens`."""
    text = " ".join(cut(hit.text, tokens).split())
    return f" {hit.title}: {text}\n"


def _literal(text: str) -> str:
    """A Lark string literal of the text."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def answer_format(sources: int) -> OutputFormat:
    """The answer: any text, or the "I don't know" sentence; that sentence alone when nothing was found."""
    if sources == 0:
        return OutputFormat.lark(f"start: {_literal(UNKNOWN)}")
    return OutputFormat.lark(f"start: {_literal(UNKNOWN)} | ANSWER\nANSWER: /(?s:.+)/")


def ending_format(sources: int) -> OutputFormat:
    """The ending: `Sources:` and one to `sources` of the numbers given, comma-separated."""
    cites = " | ".join(_literal(f"[{n}]") for n in range(1, sources + 1))
    body = "cite"
    for _ in range(sources - 1):
        body = f'cite ("," " " {body})?'
    return OutputFormat.lark(f"start: {_literal(ENDING)} {body}\ncite: {cites}")


def ending_tokens(sources: int) -> int:
    """The ending's token limit. Its words and numbers take 4 + 4 per source; the rest keeps the engine's
    closing steer (its last 24 tokens) from ending the list at the first number.
    """
    return 32 + 4 * sources


def is_unknown(answer: str, sources: tuple[Source, ...]) -> bool:
    """Whether an answer took the "I don't know" path (the only one when nothing was found)."""
    return not sources or answer.strip() == UNKNOWN


def parse(answer: str, ending: str, sources: tuple[Source, ...]) -> Cited:
    """What the reply cited, each once, in order. Numbers not given are dropped (the grammar allows none).
    `unknown` is the "I don't know" path alone.
    """
    if is_unknown(answer, sources):
        return Cited((), True)
    by_number = {s.number: s for s in sources}
    cited: list[Source] = []
    for m in re.finditer(r"\[(\d{1,2})\]", ending):
        source = by_number.get(int(m.group(1)))
        if source is not None and source not in cited:
            cited.append(source)
    return Cited(tuple(cited), False)  # none only where the ending was cut short (cancelled)
