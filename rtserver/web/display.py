"""Text a customer wrote, as people are shown it: no control, format or line-separator character, bounded.

A customer's name or message reaches agents' screens. Control characters (Cc), format characters (Cf:
the bidi overrides and isolates U+202A-202E and U+2066-2069, the marks U+200E/200F and U+061C, the
zero-widths U+200B-200D, U+2060, U+FEFF), the line and paragraph separators, surrogates, private-use and
unassigned code points can reorder, hide or forge what an agent reads; none of them is shown.
"""

from __future__ import annotations

import unicodedata

MAX_NAME_CHARS = 64
CUT = "…"  # ends a text cut to its bound


def _shown(c: str, keep: str) -> bool:
    return c in keep or unicodedata.category(c)[0] != "C" and unicodedata.category(c) not in ("Zl", "Zp")


def clean_text(text: str, limit: int, keep_lines: bool = True, strip: bool = True) -> str:
    """`text` without the characters above (newlines and tabs kept if `keep_lines`), stripped unless
    `strip` is off, and cut to `limit` characters (the last one then `CUT`)."""
    if not text.isprintable():  # printable text holds none of them (nor newlines): nothing to drop
        keep = "\n\t" if keep_lines else ""
        text = "".join(c if _shown(c, keep) else " " if c in "\n\t\u2028\u2029" else "" for c in text)
    text = text.strip() if strip else text
    return text if len(text) <= limit else text[: limit - 1].rstrip() + CUT


def clean_name(name: str | None) -> str | None:
    """A name on one line, runs of spaces as one, at most `MAX_NAME_CHARS`; None when nothing is left."""
    if not name:
        return None
    cleaned = " ".join(clean_text(name, 4 * MAX_NAME_CHARS, keep_lines=False).split())
    return clean_text(cleaned, MAX_NAME_CHARS) or None
