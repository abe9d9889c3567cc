"""The inference seam and the types that cross it. It says what the front doors (web) and the tasks ask of
whatever runs the model. The local `Engine` (rtserver.engine.core) implements `InferenceBackend`. A remote
one (an OpenAI-compatible server) can implement the same protocol.

This module imports no model code (no torch). Plugins and the web layer can depend on it cheaply.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict, runtime_checkable

# re-exported: every type that crosses the seam is importable from here
from .output_format import TEXT as TEXT
from .output_format import OutputFormat as OutputFormat
from .output_format import OutputFormatError as OutputFormatError

if TYPE_CHECKING:
    from .kv import KVStats


class Tokenizer(Protocol):
    """What rtserver uses of a Hugging Face tokenizer. That is token ids in and out, and the chat template."""

    all_special_ids: list[int]
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str: ...

    def __len__(self) -> int:
        """The vocabulary size, added tokens included."""
        ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """The rendered prompt: text with `tokenize=False`, token ids with `tokenize=True`."""
        ...


class Overloaded(Exception):
    """The backend's waiting queue is full; the caller should retry later."""


class RequestTooLarge(ValueError):
    """The request needs more tokens than one sequence may hold."""


class SamplingError(ValueError):
    """A decoding parameter out of its allowed range. The message names the parameter."""


MAX_SEED = 2**63 - 1  # what every door accepts and torch.Generator.manual_seed takes
MAX_TOKEN_ID = 2**31 - 1


def _integer(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _number(value: object, lo: float, hi: float) -> bool:
    # NaN compares false, so it is out of every range
    return isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi


def _shown(value: object) -> str:
    """A field's value for an error message, cut short. A client may send a huge one."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Priority(enum.IntEnum):
    """Who waits for a piece of model work, most urgent first. First a customer's reply. Then an agent's
    assist (drafts, summaries). Last, background work (prefetch, head fitting).
    """

    CUSTOMER = 0
    ASSIST = 1
    BACKGROUND = 2


@dataclass
class SamplingParams:
    """Per-request decoding. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    output: OutputFormat = TEXT  # what the text must match (a JSON Schema, a regex...), while decoding
    priority: Priority = Priority.CUSTOMER  # the engine admits and prefills the more urgent first
    speculate: bool = True  # the engine may draft tokens from the text's own n-grams (same output)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingError naming the first field out of its range. Types count too: a bool is no
        number. `vocab_size` bounds `stop_token_ids` where the caller knows it.
        """
        top_id = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
        checks = [
            ("temperature", _number(self.temperature, 0.0, 5.0), "0..5"),
            ("top_p", _number(self.top_p, 0.0, 1.0) and self.top_p > 0, "greater than 0 and at most 1"),
            ("top_k", _integer(self.top_k, 0, 100_000), "0 (off) ..100000"),
            ("repetition_penalty", _number(self.repetition_penalty, 0.05, 10.0), "0.05..10"),
            ("max_new_tokens", _integer(self.max_new_tokens, 1, 1_000_000), "1..1000000"),
            ("min_new_tokens", _integer(self.min_new_tokens, 0, self.max_new_tokens), "0..max_new_tokens"),
            (
                "stop",
                isinstance(self.stop, (list, tuple))
                and len(self.stop) <= 16
                and all(isinstance(s, str) and 0 < len(s) <= 256 for s in self.stop),
                "up to 16 non-empty strings of at most 256 characters",
            ),
            (
                "stop_token_ids",
                isinstance(self.stop_token_ids, (list, tuple))
                and len(self.stop_token_ids) <= 64
                and all(_integer(t, 0, top_id) for t in self.stop_token_ids),
                f"up to 64 token ids 0..{top_id}",
            ),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            ("speculate", isinstance(self.speculate, bool), "true or false"),
            ("seed", self.seed is None or _integer(self.seed, 0, MAX_SEED), f"none or 0..{MAX_SEED}"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise SamplingError(f"{name} = {_shown(getattr(self, name))}: allowed {allowed}")
        if not isinstance(self.priority, Priority):
            raise SamplingError(
                f"priority = {_shown(self.priority)}: allowed {', '.join(p.name for p in Priority)}"
            )
        why = self.output.problem() if isinstance(self.output, OutputFormat) else "expected an OutputFormat"
        if why is not None:
            raise SamplingError(f"output: {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class Inserted:
    """A block of server-written text a prompt holds for one turn only (a knowledge turn's sources):
    positions [start, end). The session's next turn may leave it out and keep the KV after it, moved back.

    Each of its `segments` ([start, end) ranges in it) is computed once, as if it followed the prompt's
    public tokens directly, then copied into every prompt that holds it (block attention). Tokens between
    segments see everything before them. A backend without KV of its own ignores all of it.
    """

    start: int
    end: int
    segments: tuple[tuple[int, int], ...] = ()

    def problem(self, prompt_tokens: int, public_tokens: int) -> str | None:
        """Why it does not fit a prompt, or None."""
        if not public_tokens <= self.start <= self.end < prompt_tokens:
            return f"inserted block {self.start}..{self.end}: not between the public tokens and the end"
        at = self.start
        for s, e in self.segments:
            if not at <= s < e <= self.end:
                return f"segment {s}..{e} is not inside the block, in order"
            at = e
        return None


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    EOS = "stop"
    STOP_STRING = "stop_string"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefilled_tokens: int = 0


@dataclass
class SequenceResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    queued_ms: float
    ttft_ms: float | None
    total_ms: float
    error: str | None = None
    error_code: str | None = None  # a stable client-facing code for the error (None: "internal")
    priority: Priority = Priority.CUSTOMER
    scores: list[float] | None = None
    features: list[float] | None = None  # hidden-state features of a scoring prompt (score_features)


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the safe-to-show text delta; may be "" while a character or stop string is incomplete


class PriorityStats(TypedDict):
    """One priority's sequences now. Also the totals of those that produced a first token."""

    running: int
    waiting: int
    started: int
    queued_s: float  # summed: submission to admission
    ttft_s: float  # summed: submission to first token


class BackendStats(TypedDict):
    """A backend's counters, read by /metrics at each scrape (`InferenceBackend.stats`)."""

    running: int
    waiting: int
    steps: int
    tokens_generated: int
    tokens_prefilled: int
    kv: KVStats | None  # the local engine's KV cache; None where the model runs elsewhere
    priorities: NotRequired[dict[str, PriorityStats]]  # the local engine's, by priority name
    draft_tokens: NotRequired[int]  # the local engine's drafts checked (speculation), and those kept
    draft_tokens_accepted: NotRequired[int]


class UpstreamStats(TypedDict):
    """One inference server behind a remote backend, in /health and /metrics."""

    url: str
    state: str  # up | probing | down
    in_flight: int
    requests: int
    errors: int
    last_error: str | None
    ttfb_p50_ms: float | None


class ServerHealth(UpstreamStats):
    """One inference server in /health: its figures and what it is."""

    kind: str | None  # what the server is (llama.cpp, vLLM, rtserver), once checked


class BackendHealth(TypedDict):
    """What /health shows of a backend (`InferenceBackend.health`). For the local engine, its state and
    kernels. For a remote backend, its model and servers.
    """

    kind: str
    state: NotRequired[str]
    running: NotRequired[int]
    kernels: NotRequired[dict[str, object]]
    kv: NotRequired[dict[str, object]]  # the local KV pool: element type, bytes a token, budget, tokens, why
    speculation: NotRequired[
        dict[str, float]
    ]  # the local engine's drafting: sequences, drafts, rows, row cost
    model: NotRequired[str]
    servers: NotRequired[list[ServerHealth]]


class Generation(Protocol):
    """One generation in flight. Iterate its token events; `result()` is the final outcome."""

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    async def result(self) -> SequenceResult: ...

    def cancel(self) -> None:
        """Stop it at the backend's next step; `result()` then ends with FinishReason.CANCELLED."""


class InferenceBackend(Protocol):
    """What web and tasks use of the model. `generate` and `score` raise `SamplingError`, `RequestTooLarge`
    or `Overloaded` at once, before anything is queued.

    `public_tokens`: how many leading prompt tokens the server itself wrote. These are a system prompt, the
    template's header, or a task's fixed instruction. Only those are matched against the prefix cache that
    all sessions share, and added to it. The rest is the session's own. The default 0 shares nothing. So a
    caller that forgets it never lets one customer's text speed up another's. Nor does that text show in
    another's usage.
    """

    tokenizer: Tokenizer

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_key: Hashable | None = None,
        public_tokens: int = 0,
        prefix_scope: int | None = None,
        fork_session: Hashable | None = None,
        inserted: Inserted | None = None,
    ) -> Generation:
        """Queue a generation. `session_key` keeps the prompt's KV for that session's next turn.
        `prefix_scope` is a random number per call, shared by one call's samples. Generations given one
        scope may share their whole prompt's KV with each other, and with nothing else. `fork_session` is a
        session this prompt is about (an agent's assist call on that conversation). The prompt may start
        from that session's KV, which the session keeps. `inserted`: see `Inserted`.
        """
        ...

    async def score(
        self,
        prompt_ids: list[int],
        candidates: list[list[int]],
        *,
        normalize: bool = True,
        public_tokens: int = 0,
    ) -> list[float]:
        """Log-probability of each candidate continuation after the prompt. With `normalize=False` it is off
        by one constant shared by all candidates of this prompt. That is cheaper; differences stay.
        """
        ...

    def drop_session(self, session_key: Hashable) -> None:
        """Free what the backend keeps for a session (it closed or expired)."""

    def stats(self) -> BackendStats: ...

    def health(self) -> BackendHealth:
        """What /health shows of this backend (a remote one: each server's state)."""
        ...

    @property
    def available(self) -> bool:
        """Whether requests can be served now. For a remote one, some server is up."""
        ...


@runtime_checkable
class FeatureScorer(Protocol):
    """A backend that can also return hidden-state features from the scoring forward. The local engine can;
    OpenAI-compatible servers expose no hidden states. A task's learned head needs one.
    """

    feature_model_id: str  # what the features depend on (model, dtype, weight storage): a cache key

    async def score_features(
        self,
        prompt_ids: list[int],
        candidates: list[list[int]],
        *,
        features_from: int,
        public_tokens: int = 0,
    ) -> tuple[list[float], list[float]]:
        """`score(..., normalize=False)` plus a feature vector from the same forward. It joins three parts.
        First, the final hidden state at the prompt's last token. Second, every second layer's hidden states
        averaged over positions `features_from`.. of the prompt. That is the part after a task's fixed
        prefix. Third, an early layer's hidden state at the last token. Zero extra tokens.
        """
        ...


@runtime_checkable
class StructuredOutput(Protocol):
    """A backend that constrains generation to an `OutputFormat` (the local engine). Without it a
    generation whose params name a format is refused."""

    async def prepare_output(self, fmt: OutputFormat, *, pin: bool = False) -> None:
        """Compile `fmt` for this model off the event loop, so `generate` with it starts at once. Raises
        OutputFormatError naming what is wrong. `pin` keeps it compiled for good (a task's format).
        """
        ...


@runtime_checkable
class NextTurnPrefetcher(Protocol):
    """A backend that can compute a session's next prompt prefix ahead of its next turn. The remote one can:
    it sends a prefill-only request to the session's server. Best effort: it never raises. It never delays a
    turn beyond a short bound. Failures are only logged.
    """

    def prefetch(self, prefix: Callable[[], list[int] | None], *, session_key: Hashable) -> None:
        """Start computing the start of the session's next prompt into its cache. `prefix` gives its ids
        (None: none to compute). It is called only when the prefetch is about to be sent. So a next turn
        that comes first never waited for it. Rendering the history costs milliseconds.
        """

    def cancel_prefetch(self, session_key: Hashable) -> None:
        """Drop the session's prefetch if one is in flight (its client left)."""
