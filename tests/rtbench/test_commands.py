"""How `rtserver` finds the measuring tools' commands: the entry-point group `rtserver.commands` that
pyproject declares, and a clear answer when one is missing."""

from __future__ import annotations

import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from rtserver import cli

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared() -> list[EntryPoint]:
    group = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"][cli.COMMAND_GROUP]
    return [EntryPoint(name, value, cli.COMMAND_GROUP) for name, value in group.items()]


def test_pyproject_declares_every_tool_command_in_rtbench():
    points = declared()
    assert sorted(p.name for p in points) == sorted(cli.TOOL_COMMANDS)
    for point in points:
        assert point.value.startswith("rtbench.commands:") and callable(point.load())


def test_the_declared_commands_parse_as_before(monkeypatch):
    monkeypatch.setattr(cli, "entry_points", lambda group: declared())
    args = cli.build_parser().parse_args(["bench", "--workloads", "servers", "--reps", "2"])
    assert (args.workloads, args.reps, args.out) == ("servers", 2, "bench-results")
    args = cli.build_parser().parse_args(["--config", "a.toml", "loadtest", "--quick", "--nodes", "2"])
    assert (args.config, args.quick, args.nodes, args.idle) == ("a.toml", True, 2, 1000)
    args = cli.build_parser().parse_args(["eval", "--split", "dev", "--task", "intent"])
    assert (args.split, args.task) == ("dev", ["intent"])
    assert "{serve,bench,loadtest,eval,fit-heads,kb}" in cli.build_parser().format_help()  # kb is new


def test_a_missing_entry_point_says_why_and_how_to_reinstall(monkeypatch, capsys):
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    assert cli.main(["bench", "--workloads", "servers", "--help"]) == 2
    err = capsys.readouterr().err
    assert "rtserver bench: not installed (no entry point named bench)" in err
    assert "entry-point group rtserver.commands" in err and "pip install -e ." in err


def test_an_entry_point_that_cannot_load_says_why(monkeypatch, capsys):
    broken = [EntryPoint("eval", "rtbench.no_such_module:add_eval", cli.COMMAND_GROUP)]
    monkeypatch.setattr(cli, "entry_points", lambda group: broken)
    assert cli.main(["eval"]) == 2
    err = capsys.readouterr().err
    assert "rtserver eval: not installed (No module named 'rtbench.no_such_module')" in err


def test_the_servers_own_commands_still_refuse_unknown_arguments(monkeypatch, capsys):
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--bogus"])
    assert exc.value.code == 2
    assert "rtserver: error: unrecognized arguments: --bogus" in capsys.readouterr().err
