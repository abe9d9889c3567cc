"""The hand-off policy: which signals send a conversation to people, business hours, the customer's e-mail.

Pure rules, no state: `HandoffPolicy.reason` reads one `TurnSignals` and names why a person should
answer, or None. `BusinessHours.open_at` says whether people answer at a moment (IANA zone, zoneinfo).
`check_email` accepts what the HTML form's e-mail field accepts, within the bounds table. The console's
queue (console/queue.py) applies what this decides.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, time
from typing import Literal
from zoneinfo import ZoneInfo

from ..config import WEEKDAYS, HandoffSettings
from ..tasks.bounds import SIZES
from .display import clean_text

ReasonCode = Literal["asked", "mood", "intent", "unknown"]
REASON_CODES: tuple[ReasonCode, ...] = ("asked", "mood", "intent", "unknown")
MAX_EMAIL_CHARS = SIZES["email_chars"]
# The WHATWG "valid e-mail address": what <input type=email> accepts. ASCII only, so no control,
# bidi or markup characters get through.
EMAIL = re.compile(
    r"[a-zA-Z0-9.!#$%&'*+/=?^_`{|}~-]+@[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
    r"(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*"
)
EMAIL_RULE = f"an e-mail address like name@example.com (at most {MAX_EMAIL_CHARS} characters)"


@dataclass(frozen=True)
class TurnSignals:
    """What the policy reads about a conversation after a customer message or a bot reply."""

    text: str = ""  # the customer's newest message
    moods: tuple[float, ...] = ()  # mood scores of the customer's newest rated messages, newest first
    intent: str | None = None  # the intent auto-task's label of the newest message
    bot_unknown: bool = False  # the bot's reply said it does not know


@dataclass(frozen=True)
class Reason:
    """Why a person should answer: a stable code and a line for agents."""

    code: ReasonCode
    text: str


@dataclass
class Waiting:
    """A conversation waiting for a person: why, since when (wall clock), and what the customer left."""

    reason: ReasonCode
    text: str  # the reason, for agents
    since: float
    out_of_hours: bool  # nobody answers now: the customer gets the e-mail form
    email: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "reason": self.reason,
            "text": self.text,
            "since": self.since,
            "out_of_hours": self.out_of_hours,
            "email": self.email,
        }

    @classmethod
    def from_json(cls, raw: object) -> Waiting | None:
        """The state a stored record holds, checked (another node wrote it); None when it is not one."""
        if not isinstance(raw, dict):
            return None
        reason, text, since, email = raw.get("reason"), raw.get("text"), raw.get("since"), raw.get("email")
        if reason not in REASON_CODES or not isinstance(text, str) or not isinstance(since, int | float):
            return None
        try:
            email = check_email(email) if isinstance(email, str) else None
        except ValueError:
            email = None
        code = next(c for c in REASON_CODES if c == reason)
        return cls(code, clean_text(text, 200), float(since), raw.get("out_of_hours") is True, email)


class BusinessHours:
    """The days and local hours people answer, in one IANA time zone."""

    def __init__(self, zone: str, days: Iterable[str], opens: str, closes: str):
        self.zone = ZoneInfo(zone)
        self.days = {WEEKDAYS.index(d) for d in days}
        self.opens = _clock(opens)
        self.closes = None if closes == "24:00" else _clock(closes)  # None: until midnight

    def open_at(self, when: datetime) -> bool:
        """Whether people answer at `when` (an aware datetime, any zone)."""
        local = when.astimezone(self.zone)
        now = local.time()
        return (
            local.weekday() in self.days and now >= self.opens and (self.closes is None or now < self.closes)
        )


class HandoffPolicy:
    """The `[handoff]` rules: the first signal that holds names the reason."""

    def __init__(self, settings: HandoffSettings):
        self.enabled = settings.enabled
        self.settings = settings
        phrases = sorted({" ".join(p.lower().split()) for p in settings.ask_phrases}, key=len, reverse=True)
        # whole words only: "humane" does not ask for a human
        self.asking = re.compile(r"\b(?:" + "|".join(map(re.escape, phrases)) + r")\b") if phrases else None
        self.hours = BusinessHours(settings.timezone, settings.days, settings.opens, settings.closes)

    def asks_for_person(self, text: str) -> bool:
        return self.asking is not None and self.asking.search(" ".join(text.lower().split())) is not None

    def mood_reason(self, moods: Sequence[float]) -> Reason | None:
        s = self.settings
        rated = moods[: s.mood_window]
        if len(rated) < s.mood_min_messages:
            return None
        mean = sum(rated) / len(rated)
        if mean > s.mood_at_most:
            return None
        return Reason("mood", f"The customer is upset (mood {mean:+.2f} over {len(rated)} messages).")

    def reason(self, signals: TurnSignals) -> Reason | None:
        """Why a person should answer now, or None; None always when the policy is off."""
        if not self.enabled:
            return None
        if signals.text and self.asks_for_person(signals.text):
            return Reason("asked", "The customer asked for a person.")
        if signals.intent is not None and signals.intent in self.settings.intents:
            return Reason("intent", f"The customer's intent is {signals.intent!r}.")
        if signals.bot_unknown and self.settings.bot_unknown:
            return Reason("unknown", "The bot did not know the answer.")
        return self.mood_reason(signals.moods)


def check_email(value: str) -> str:
    """The e-mail address a customer left, stripped; ValueError when it is not one."""
    email = value.strip()
    if len(email) > MAX_EMAIL_CHARS or not EMAIL.fullmatch(email):
        raise ValueError(f"expected {EMAIL_RULE}")
    return email


def _clock(text: str) -> time:
    hours, minutes = text.split(":")
    return time(int(hours), int(minutes))
