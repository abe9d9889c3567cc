"""Settings: TOML + environment overrides, and errors that name key, value and what is allowed."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from rtserver.config import ConfigError, Settings, load_settings, settings_from_mapping


def _settings_sections():
    """(section name, its dataclass of defaults) for every settings section; [task.<name>] is not one."""
    defaults = Settings()
    for section in dataclasses.fields(Settings):
        value = getattr(defaults, section.name)
        if dataclasses.is_dataclass(value):
            yield section.name, value


def _commented_keys(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment on that key's line in a TOML file of `key = value  # comment` lines."""
    found: dict[tuple[str, str], str] = {}
    section = ""
    for line in text.splitlines():
        if header := re.fullmatch(r"\[([\w.]+)\]\s*", line):
            section = header.group(1)
        elif key := re.match(r"(\w+)\s*=", line):
            found[(section, key.group(1))] = _comment_after_value(line[key.end() :])
    return found


def _comment_after_value(rest: str) -> str:
    """The comment after a TOML value: from the first `#` that is not inside the value."""
    for at in (i for i, ch in enumerate(rest) if ch == "#"):
        try:
            tomllib.loads(f"v = {rest[:at]}")
        except tomllib.TOMLDecodeError:
            continue
        return rest[at + 1 :].strip()
    return ""


def test_repository_config_toml_loads_with_defaults_documented():
    s = load_settings("config.toml", env={})
    assert s.model.model == "embedded" and s.engine.max_running == 64
    assert s.chat.max_new_tokens == 128 and s.chat.overridable["max_new_tokens"] == [1, 512]
    # every setting is in the file (the one place settings are documented), with its default value
    data = tomllib.loads(Path("config.toml").read_text())
    for name, defaults in _settings_sections():
        for key in dataclasses.fields(defaults):
            assert key.name in data.get(name, {}), f"{name}.{key.name} is not in config.toml"
            assert getattr(getattr(s, name), key.name) == getattr(defaults, key.name), key.name


def test_every_setting_in_config_toml_has_a_comment():
    comments = _commented_keys(Path("config.toml").read_text(encoding="utf-8"))
    sections = dict(_settings_sections())
    expected = {(name, f.name) for name, defaults in sections.items() for f in dataclasses.fields(defaults)}
    missing = sorted(f"{s}.{k}" for s, k in expected if len(comments.get((s, k), "")) < 8)
    assert missing == [], f"keys in config.toml without a comment saying what they do: {missing}"
    # and the file holds nothing else in the settings sections
    assert {(s, k) for s, k in comments if s in sections} == expected


def test_commented_keys_reads_what_the_test_relies_on():
    text = '[a]\nx = 1  # one\ny = "p # q"\nw = "#" # three\n[b]\nz = [1, 2]  # two'
    expected = {("a", "x"): "one", ("a", "y"): "", ("a", "w"): "three", ("b", "z"): "two"}
    assert _commented_keys(text) == expected


def test_environment_overrides_win():
    s = settings_from_mapping(
        {"engine": {"max_running": 8}},
        env={"RTSERVER_ENGINE_MAX_RUNNING": "16", "RTSERVER_MODEL_DTYPE": "float32"},
    )
    assert s.engine.max_running == 16 and s.model.dtype == "float32"


def test_chat_settings_take_overrides_and_keep_the_default_ranges():
    s = settings_from_mapping(
        {"chat": {"overridable": {"max_new_tokens": [1, 256]}}},
        env={"RTSERVER_CHAT_MAX_NEW_TOKENS": "64", "RTSERVER_CHAT_STOP": "END,STOP"},
    )
    assert s.chat.max_new_tokens == 64 and s.chat.stop == ["END", "STOP"]
    assert s.chat.overridable["max_new_tokens"] == [1, 256]  # the table's key replaces the default's
    assert s.chat.overridable["temperature"] == [0.0, 2.0]  # the others stay


@pytest.mark.parametrize(
    "data, env, message",
    [
        ({"model": {"dtype": "fp16"}}, {}, "model.dtype = 'fp16': allowed values are 'auto', 'float32'"),
        ({"engine": {"max_running": 0}}, {}, "engine.max_running = 0: allowed range is 1..4096"),
        ({"engine": {"max_running": "many"}}, {}, "engine.max_running = 'many': expected an integer"),
        ({"engine": {"bogus": 1}}, {}, "engine.bogus: unknown setting"),
        ({"nope": {}}, {}, "[nope]: unknown section"),
        ({}, {"RTSERVER_ENGINE_KV_BUDGET_MB": "lots"}, "engine.kv_budget_mb = 'lots': expected an integer"),
        ({}, {"RTSERVER_WHATEVER": "1"}, "RTSERVER_WHATEVER: no such setting"),
    ],
)
def test_invalid_values_are_named(data, env, message):
    with pytest.raises(ConfigError, match=None) as err:
        settings_from_mapping(data, env=env)
    assert message in str(err.value)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "missing.toml", env={})


def test_test_switches_are_not_settings_but_typos_are_errors():
    from rtserver.config import ConfigError, settings_from_mapping

    settings_from_mapping(
        {}, {"RTSERVER_SLOW_TESTS": "1", "RTSERVER_REPORT_DIR": "/tmp", "RTSERVER_CONFIG": "x"}
    )
    with pytest.raises(ConfigError, match="RTSERVER_SLOW_TEST: no such setting"):
        settings_from_mapping({}, {"RTSERVER_SLOW_TEST": "1"})


def test_every_dtype_setting_maps_to_a_storage_and_the_cli_offers_the_same_list():
    import torch

    from rtserver.cli import build_parser
    from rtserver.config import DTYPES
    from rtserver.engine.model import resolve_dtype

    for name in DTYPES:
        dtype, storage = resolve_dtype(name)
        assert dtype in (torch.float32, torch.bfloat16) and storage in (None, "float16", "int8"), name
    eval_args = build_parser().parse_args(["eval", "--dtype", DTYPES[-1]])
    assert eval_args.dtype == DTYPES[-1]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--dtype", "fp16"])


@pytest.mark.parametrize(
    "argv, config",
    [
        (["serve", "--config", "a.toml"], "a.toml"),  # the README's form
        (["--config", "b.toml", "serve"], "b.toml"),
        (["--config", "b.toml", "loadtest", "--config", "c.toml"], "c.toml"),  # the nearer one wins
        (["serve"], None),
    ],
)
def test_config_option_before_or_after_the_command(argv, config):
    from rtserver.cli import build_parser

    assert build_parser().parse_args(argv).config == config
