"""Typed settings: config.toml → `Settings`, with `RTSERVER_<SECTION>_<KEY>` environment overrides.

Each field holds its default and its allowed values or range; what a key does is documented once, in
config.toml. An invalid value raises `ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

# rtserver.engine.model maps each dtype to a storage
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "gguf")
# rtserver.engine.kv_memory maps each to the KV pool's element type
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0")
BACKENDS = ("local", "openai")

# RTSERVER_* variables that are not settings, so they are not reported as typos
NOT_SETTINGS = {
    "RTSERVER_CONFIG",
    "RTSERVER_SLOW_TESTS",
    "RTSERVER_REPORT_DIR",
    "RTSERVER_BENCH_REMOTE_PLACEMENTS",
    "RTSERVER_BENCH_REMOTE_REPS",
}


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key, the value and what is allowed."""


T = TypeVar("T")


def _setting(
    default: T, *, choices: tuple | None = None, min: float | None = None, max: float | None = None
) -> T:
    meta = {"choices": choices, "min": min, "max": max}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ServerSettings:
    host: str = _setting("127.0.0.1")
    port: int = _setting(8000, min=0, max=65535)
    log_level: str = _setting("info", choices=("debug", "info", "warning", "error"))
    max_frame_bytes: int = _setting(65536, min=1024, max=16 << 20)
    max_in_flight: int = _setting(8, min=1, max=1024)
    send_queue_size: int = _setting(256, min=8, max=100_000)
    slow_client_timeout_s: float = _setting(10.0, min=0.1, max=3600.0)
    shutdown_grace_s: float = _setting(10.0, min=0.0, max=3600.0)
    forwarded_allow_ips: list[str] = _setting(["127.0.0.1"])
    hello_timeout_s: float = _setting(10.0, min=0.1, max=3600.0)
    max_connections_per_ip: int = _setting(64, min=0, max=1_000_000)
    max_websockets: int = _setting(5000, min=1, max=1_000_000)
    request_timeout_s: float = _setting(10.0, min=0.1, max=3600.0)
    allowed_hosts: list[str] = _setting([])


@dataclass
class ModelSettings:
    model: str = _setting("embedded")
    dtype: str = _setting("auto", choices=DTYPES)
    threads: int = _setting(0, min=0, max=1024)
    cache_dir: str = _setting("~/.cache/rtserver")
    backend: str = _setting("local", choices=BACKENDS)


@dataclass
class BackendSettings:
    """Remote OpenAI-compatible inference servers, used by model.backend or a task's backend = "openai"."""

    urls: list[str] = _setting([])
    api_key: str = _setting("")
    model: str = _setting("")
    timeout_s: float = _setting(60.0, min=0.1, max=3600.0)
    max_in_flight_per_url: int = _setting(64, min=1, max=100_000)
    health_interval_s: float = _setting(5.0, min=0.1, max=3600.0)
    failures_to_open: int = _setting(3, min=1, max=1000)
    retry_after_s: float = _setting(10.0, min=0.1, max=3600.0)
    # A few ms covers the gap between a burst's requests as the hub reads them; a lone request pays it.
    send_window_ms: float = _setting(3.0, min=0.0, max=1000.0)
    prefetch_next_turn: bool = _setting(True)


@dataclass
class EngineSettings:
    max_running: int = _setting(64, min=1, max=4096)
    max_waiting: int = _setting(256, min=0, max=100_000)
    prefill_chunk_tokens: int = _setting(2048, min=16, max=65536)
    kv_budget_mb: int = _setting(0, min=0, max=1_000_000)
    kv_dtype: str = _setting("auto", choices=KV_DTYPES)
    kv_block_tokens: int = _setting(16, min=1, max=1024)
    kept_panels_mb: int = _setting(160, min=0, max=1_000_000)
    activation_bits: int = _setting(0, choices=(0, 8, 16))  # 0: auto (quant.activation_bits_for)
    max_sequence_tokens: int = _setting(4096, min=32, max=1_000_000)
    skip_ahead_s: float = _setting(10.0, min=0.0, max=3600.0)
    speculate_max_live: int = _setting(2, min=0, max=64)
    draft_tokens: int = _setting(3, min=1, max=16)


@dataclass
class SessionSettings:
    """Session lifetime and resume, and the agent console's view of them."""

    idle_timeout_s: float = _setting(600.0, min=1.0, max=86400.0)
    max_sessions: int = _setting(10000, min=1, max=10_000_000)
    console_mood_window: int = _setting(5, min=1, max=1000)
    console_max_messages: int = _setting(200, min=10, max=100_000)
    console_takeover_grace_s: float = _setting(30.0, min=0.0, max=86400.0)


@dataclass
class SecuritySettings:
    """Each door's credential, origins and the limits per connection and client."""

    console_token: str = _setting("")
    ws_token: str = _setting("")
    api_token: str = _setting("")
    api_enabled: bool = _setting(False)
    ops_token: str = _setting("")
    allowed_origins: list[str] = _setting([])
    console_origins: list[str] = _setting([])
    ip_tokens_in_flight: int = _setting(16384, min=0, max=100_000_000)
    ip_tokens_per_s: float = _setting(1000.0, min=0.0, max=1e9)
    ip_tokens_burst: int = _setting(32768, min=1, max=100_000_000)
    api_kv_share: float = _setting(0.5, min=0.0, max=1.0)
    ip_kv_share: float = _setting(0.25, min=0.0, max=1.0)
    api_queue_s: float = _setting(30.0, min=0.0, max=3600.0)
    api_queue_max: int = _setting(256, min=0, max=100_000)
    rate_limit_per_s: float = _setting(5.0, min=0.0, max=1e6)
    rate_limit_burst: int = _setting(20, min=1, max=1_000_000)
    ip_rate_limit_per_s: float = _setting(20.0, min=0.0, max=1e6)
    ip_rate_limit_burst: int = _setting(60, min=1, max=1_000_000)
    max_sessions_per_ip: int = _setting(50, min=0, max=10_000_000)
    console_login_timeout_s: float = _setting(10.0, min=0.1, max=3600.0)
    console_login_failures_per_min: int = _setting(10, min=0, max=1_000_000)
    api_max_tokens: int = _setting(2048, min=1, max=1_000_000)


@dataclass
class TaskSettings:
    """Task plugins: where they come from, which run, and per-task overrides."""

    plugin_dirs: list[str] = _setting(["plugins"])
    enabled: list[str] = _setting([])
    disabled: list[str] = _setting([])
    auto_tasks: list[str] = _setting(["sentiment"])
    learned_heads: bool = _setting(True)
    fit_heads_in_background: bool = _setting(False)


@dataclass
class ChatSettings:
    """The bot's chat: its prompt, limits, decoding and history window."""

    system_prompt: str = _setting("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    max_input_chars: int = _setting(4000, min=1, max=1_000_000)
    max_input_tokens: int = _setting(1024, min=1, max=1_000_000)
    truncate: str = _setting("tail", choices=("reject", "head", "tail"))
    max_new_tokens: int = _setting(128, min=1, max=1_000_000)
    stop: list[str] = _setting([])
    decoding: dict[str, float] = _setting({"temperature": 0.7, "top_p": 0.9})
    overridable: dict[str, list[float]] = _setting(
        {
            "temperature": [0.0, 2.0],
            "top_p": [0.05, 1.0],
            "top_k": [0, 200],
            "repetition_penalty": [0.8, 2.0],
            "max_new_tokens": [1, 512],
            "seed": [0, 2**31 - 1],
            "stop": [0, 4],
        }
    )
    max_history_turns: int = _setting(20, min=0, max=1_000_000)
    max_history_tokens: int = _setting(1500, min=0, max=100_000_000)
    backend: str = _setting("", choices=("", *BACKENDS))


@dataclass
class KnowledgeSettings:
    """The articles the chat answers from, with citations (`rtserver.tasks.knowledge`)."""

    enabled: bool = _setting(True)
    folder: str = _setting("docs")
    top_k: int = _setting(3, min=1, max=8)
    chunk_chars: int = _setting(700, min=100, max=20_000)
    source_tokens: int = _setting(240, min=16, max=4096)
    min_score: float = _setting(0.0, min=0.0, max=1000.0)
    max_articles: int = _setting(20_000, min=1, max=1_000_000)
    max_article_bytes: int = _setting(1 << 20, min=1024, max=1 << 30)
    max_total_mb: int = _setting(256, min=1, max=1_000_000)
    poll_s: float = _setting(5.0, min=0.0, max=86400.0)
    base_url: str = _setting("")
    warm_sources: int = _setting(1000, min=0, max=100_000)


@dataclass
class ClusterSettings:
    """Many nodes as one through Redis; an empty `redis_url` keeps everything in this process."""

    redis_url: str = _setting("")
    node_id: str = _setting("")
    key_prefix: str = _setting("rtserver")
    heartbeat_s: float = _setting(2.0, min=0.1, max=600.0)
    op_timeout_s: float = _setting(2.0, min=0.05, max=60.0)
    max_connections: int = _setting(32, min=2, max=10_000)


@dataclass
class HandoffSettings:
    """When the bot hands a conversation to a person, and the hours people answer."""

    enabled: bool = _setting(False)
    ask_phrases: list[str] = _setting(
        [
            "human",
            "a person",
            "real person",
            "an agent",
            "representative",
            "talk to someone",
            "speak to someone",
        ]
    )
    mood_window: int = _setting(3, min=1, max=100)
    mood_min_messages: int = _setting(2, min=1, max=100)
    mood_at_most: float = _setting(-0.5, min=-1.0, max=1.0)
    intent_task: str = _setting("intent")
    intents: list[str] = _setting([])
    bot_unknown: bool = _setting(True)
    timezone: str = _setting("UTC")
    days: list[str] = _setting(["mon", "tue", "wed", "thu", "fri", "sat", "sun"])
    opens: str = _setting("00:00")
    closes: str = _setting("24:00")


@dataclass
class ActionSettings:
    """The bot's actions (plugins' `Action`s): whether they run and how often a client may call them."""

    enabled: bool = _setting(True)
    intent_task: str = _setting("intent")
    model_calls: bool = _setting(True)
    max_calls_per_session: int = _setting(20, min=0, max=100_000)
    calls_per_min_per_ip: float = _setting(30.0, min=0.0, max=1_000_000.0)


@dataclass
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    backend: BackendSettings = field(default_factory=BackendSettings)
    sessions: SessionSettings = field(default_factory=SessionSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    tasks: TaskSettings = field(default_factory=TaskSettings)
    chat: ChatSettings = field(default_factory=ChatSettings)
    knowledge: KnowledgeSettings = field(default_factory=KnowledgeSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    handoff: HandoffSettings = field(default_factory=HandoffSettings)
    actions: ActionSettings = field(default_factory=ActionSettings)
    # [task.<name>] tables; the task registry checks them against each plugin's declaration
    task: dict = field(default_factory=dict)


def _check(key: str, value: object, f: dataclasses.Field, expected: type) -> object:
    if expected is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            value = value.lower() in ("1", "true", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: expected true or false")
    elif expected is int:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"{key} = {value!r}: expected an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r}: expected an integer")
    elif expected is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key} = {value!r}: expected a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {value!r}: expected a number")
        value = float(value)
    elif expected is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: expected a string")
    elif typing.get_origin(expected) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: expected a list")
        if typing.get_args(expected) == (str,) and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} = {value!r}: expected a list of strings")
    elif typing.get_origin(expected) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r}: expected a table")
    choices, lo, hi = f.metadata.get("choices"), f.metadata.get("min"), f.metadata.get("max")
    if choices is not None and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{key} = {value!r}: allowed values are {allowed}")
    if isinstance(value, (int, float)) and (lo is not None and value < lo or hi is not None and value > hi):
        raise ConfigError(f"{key} = {value!r}: allowed range is {lo}..{hi}")
    return value


def _build_section(cls: type, name: str, table: Mapping[str, object]) -> object:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"{name}.{key}: unknown setting (known in [{name}]: {allowed})")
        values[key] = _check(f"{name}.{key}", value, fields[key], hints[key])
        factory = fields[key].default_factory
        checked = values[key]
        if factory is not dataclasses.MISSING and isinstance(default := factory(), dict):
            assert isinstance(checked, dict)  # _check gave the table's own type
            values[key] = {**default, **checked}  # a table's keys replace the default's, the others stay
    return cls(**values)


def settings_from_mapping(data: Mapping[str, object], env: Mapping[str, str] | None = None) -> Settings:
    """Build settings from a parsed TOML mapping, then apply `RTSERVER_<SECTION>_<KEY>` overrides."""
    sections = {f.name: f for f in dataclasses.fields(Settings)}
    hints = typing.get_type_hints(Settings)
    merged: dict[str, dict[str, object]] = {}
    for name, table in data.items():
        if name not in sections:
            raise ConfigError(f"[{name}]: unknown section (known: {', '.join(sorted(sections))})")
        if not isinstance(table, dict):
            raise ConfigError(f"{name} = {table!r}: expected a [{name}] table")
        merged[name] = dict(table)
    for var, value in (os.environ if env is None else env).items():
        if not var.startswith("RTSERVER_") or var in NOT_SETTINGS:
            continue
        rest = var[len("RTSERVER_") :].lower()
        for name in sections:
            if rest.startswith(name + "_"):
                merged.setdefault(name, {})[rest[len(name) + 1 :]] = value
                break
        else:
            raise ConfigError(
                f"{var}: no such setting (expected RTSERVER_<SECTION>_<KEY>, "
                f"sections: {', '.join(sorted(sections))})"
            )
    built: dict[str, Any] = {}  # a section name -> its settings object (a type per name, which ** cannot say)
    for name in sections:
        if hints[name] is dict:
            for task_name, table in merged.get(name, {}).items():
                if not isinstance(table, dict):
                    raise ConfigError(
                        f"{name}.{task_name} = {table!r}: expected a [{name}.{task_name}] table"
                    )
            built[name] = merged.get(name, {})
        else:
            built[name] = _build_section(hints[name], name, merged.get(name, {}))
    settings = Settings(**built)
    _check_backends(settings)
    _check_cluster(settings)
    _check_handoff(settings.handoff)
    _check_knowledge(settings)
    return settings


def _check_knowledge(settings: Settings) -> None:
    base = settings.knowledge.base_url
    if base and not base.startswith(("http://", "https://")):
        raise ConfigError(f"knowledge.base_url: {base!r} is not an http:// or https:// URL")


def _check_cluster(settings: Settings) -> None:
    c = settings.cluster
    if c.redis_url and not c.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"cluster.redis_url: {c.redis_url!r} is not a redis://, rediss:// or unix:// URL")
    if not c.key_prefix or any(ch in c.key_prefix for ch in " {}*?[]"):
        raise ConfigError(
            f"cluster.key_prefix = {c.key_prefix!r}: expected a non-empty name without spaces or {{}}*?[]"
        )
    if any(ch.isspace() for ch in c.node_id):
        raise ConfigError(f"cluster.node_id = {c.node_id!r}: no whitespace allowed")


WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
CLOCK_TIME = re.compile(r"([01][0-9]|2[0-3]):[0-5][0-9]|24:00")


def _check_handoff(h: HandoffSettings) -> None:
    """Business hours name a real time zone, known days and HH:MM times in order."""
    try:
        zoneinfo.ZoneInfo(h.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        zone = h.timezone
        raise ConfigError(f"handoff.timezone = {zone!r}: not an IANA time zone (e.g. Europe/Paris)") from None
    unknown = [d for d in h.days if d not in WEEKDAYS]
    if unknown:
        raise ConfigError(f"handoff.days: {unknown!r} unknown (allowed: {', '.join(WEEKDAYS)})")
    for key in ("opens", "closes"):
        value = getattr(h, key)
        if not CLOCK_TIME.fullmatch(value):
            raise ConfigError(f"handoff.{key} = {value!r}: expected HH:MM from 00:00 to 24:00")
    if h.opens >= h.closes:
        raise ConfigError(f"handoff.opens = {h.opens!r} must come before handoff.closes = {h.closes!r}")
    if any(not p.strip() or len(p) > 100 for p in h.ask_phrases):
        raise ConfigError("handoff.ask_phrases: each phrase must be 1..100 characters")


def _check_backends(settings: Settings) -> None:
    """Remote servers need URLs, and a task's placement names a known backend."""
    placements = {
        f"task.{name}.backend": table["backend"]
        for name, table in settings.task.items()
        if isinstance(table, dict) and "backend" in table
    }
    for key, value in placements.items():
        if value not in BACKENDS:
            allowed = ", ".join(repr(b) for b in BACKENDS)
            raise ConfigError(f"{key} = {value!r}: allowed values are {allowed}")
    if settings.chat.backend:
        placements["chat.backend"] = settings.chat.backend
    uses_remote = settings.model.backend == "openai" or "openai" in placements.values()
    if uses_remote and not settings.backend.urls:
        raise ConfigError('backend.urls is empty: the "openai" backend needs at least one server URL')
    for url in settings.backend.urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"backend.urls: {url!r} is not an http:// or https:// URL")


def load_settings(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Read config.toml (or `path`); a missing default file means all defaults."""
    data: dict[str, object] = {}
    if path is not None or Path("config.toml").exists():
        p = Path(path if path is not None else "config.toml")
        try:
            with p.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {p}: not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p}: invalid TOML ({exc})") from None
    return settings_from_mapping(data, env)
