"""Command line: `rtserver serve`, `rtserver bench`, `rtserver loadtest`, `rtserver eval`,
`rtserver fit-heads`, `rtserver kb index`.

`serve` and `fit-heads` are the server's own. The measuring tools (the rtbench package) add the
others through the entry-point group `rtserver.commands`; nothing here imports them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol, TypeAlias

from .config import DTYPES, ConfigError, Settings, load_settings

if TYPE_CHECKING:
    from .engine.model import LoadedModel

COMMANDS = ("serve", "bench", "loadtest", "eval", "fit-heads", "kb index")
DESCRIPTION = "Command line: " + ", ".join(f"`rtserver {c}`" for c in COMMANDS) + "."
COMMAND_GROUP = "rtserver.commands"
# The commands this project's pyproject declares in the group: one missing means a stale install.
TOOL_COMMANDS = ("bench", "loadtest", "eval")
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # from `add_subparsers`


class AddCommand(Protocol):
    """What an entry point of `rtserver.commands` loads: it adds the command `name`."""

    def __call__(self, sub: Subcommands, name: str, common: argparse.ArgumentParser) -> None: ...


# The model runs on the scheduler thread, where libgomp lets idle workers sleep almost at once, so each
# parallel region of a step waits for a wake-up. A bounded active spin keeps them hot within a step;
# libgomp reads it once, so it is set before torch is imported.
OPENMP_WAIT = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"}


def openmp_wait_for_the_scheduler_thread() -> None:
    """For the commands whose model runs on the scheduler thread (serve, eval); the bench leaves the
    environment alone, so the llama-server it starts runs as it would anywhere."""
    if "torch" not in sys.modules:
        for key, value in OPENMP_WAIT.items():
            os.environ.setdefault(key, value)


def settings_or_exit(args: argparse.Namespace) -> Settings:
    """The configured settings; a bad config file ends the command with its message."""
    try:
        return load_settings(args.config or os.environ.get("RTSERVER_CONFIG"))
    except ConfigError as exc:
        print(f"rtserver: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def load_or_exit(settings: Settings, dtype: str | None = None) -> LoadedModel:
    """The configured model, in `dtype` when given; a load failure ends the command."""
    from .engine.model import ModelLoadError, load_model

    m = settings.model
    try:
        return load_model(m.model, dtype or m.dtype, m.threads, m.cache_dir)
    except ModelLoadError as exc:
        print(f"rtserver: cannot load the model: {exc}", file=sys.stderr)
        raise SystemExit(3) from None


def cmd_serve(args: argparse.Namespace) -> int:
    openmp_wait_for_the_scheduler_thread()
    from .web.server import serve

    settings = settings_or_exit(args)
    if args.host:
        settings.server.host = args.host
    if args.port is not None:
        settings.server.port = args.port
    return serve(settings)


def cmd_fit_heads(args: argparse.Namespace) -> int:
    from .tasks.fit_heads import lower_priority, run_fit_heads

    settings = settings_or_exit(args)
    if args.background:
        lower_priority()  # before the model loads: torch's threads inherit it
    run_fit_heads(load_or_exit(settings, args.dtype), settings, args.task, ship=args.ship)
    return 0


def cmd_kb_index(args: argparse.Namespace) -> int:
    """Rebuild the knowledge folder's index whole, where the server reads it."""
    from .tasks.kb_index import build, index_path
    from .tasks.knowledge import KnowledgeError

    settings = settings_or_exit(args)
    kb = settings.knowledge
    folder = args.folder or kb.folder
    path = index_path(settings.model.cache_dir, folder)
    try:
        n = build(
            folder,
            path,
            kb.chunk_chars,
            kb.base_url,
            (kb.max_articles, kb.max_article_bytes, kb.max_total_mb),
        )
    except (KnowledgeError, OSError) as exc:
        print(f"rtserver kb index: {exc}", file=sys.stderr)
        return 1
    print(f"{n} articles of {folder} indexed in {path}")
    return 0


def _add_kb(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    kb = sub.add_parser("kb", help="the knowledge folder the chat answers from", parents=[common])
    kb_sub = kb.add_subparsers(dest="kb_command", required=True)
    index = kb_sub.add_parser(
        "index", help="rebuild the folder's index (servers also re-index by themselves)", parents=[common]
    )
    index.add_argument("--folder", help="the articles' folder (default: knowledge.folder)")
    index.set_defaults(func=cmd_kb_index)


def _add_serve(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    serve = sub.add_parser("serve", help="run the server", parents=[common])
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=cmd_serve)


def _add_fit_heads(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    fh = sub.add_parser(
        "fit-heads",
        help="fit the tasks' learned heads for the configured model and store them in the cache, "
        "where the next start loads them",
        parents=[common],
    )
    fh.add_argument("--task", action="append", help="only this task (repeatable)")
    fh.add_argument("--dtype", choices=DTYPES)
    fh.add_argument("--background", action="store_true", help="run at low priority, beside a serving server")
    fh.add_argument(
        "--ship", action="store_true", help="also write the fitted-heads file the plugin ships (maintainers)"
    )
    fh.set_defaults(func=cmd_fit_heads)


def _not_installed(name: str, reason: str) -> Callable[[argparse.Namespace], int]:
    def refuse(args: argparse.Namespace) -> int:
        print(
            f"rtserver {name}: not installed ({reason}). The measuring tools declare it in the "
            f"entry-point group {COMMAND_GROUP}; reinstall the project: pip install -e .",
            file=sys.stderr,
        )
        return 2

    return refuse


def _add_tool_commands(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    """The commands other packages declare; one of ours that is missing still answers, with why."""
    found = {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}
    for name in [*TOOL_COMMANDS, *sorted(set(found) - set(TOOL_COMMANDS))]:
        try:
            if name not in found:
                raise LookupError(f"no entry point named {name}")
            add: AddCommand = found[name].load()
        except (ImportError, AttributeError, LookupError) as exc:
            stub = sub.add_parser(name, add_help=False, help="(not installed)")
            stub.set_defaults(func=_not_installed(name, str(exc)), installed=False)
            continue
        add(sub, name, common)


def build_parser() -> argparse.ArgumentParser:
    config_help = "config file (default: ./config.toml, or $RTSERVER_CONFIG)"
    parser = argparse.ArgumentParser(prog="rtserver", description=DESCRIPTION)
    parser.add_argument("--config", help=config_help)
    # `--config` is taken before or after the command (`rtserver serve --config PATH`); SUPPRESS keeps a
    # value given before the command when the command's own copy is not used
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help=config_help)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub, common)
    _add_tool_commands(sub, common)
    _add_fit_heads(sub, common)
    _add_kb(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # a command that is not installed takes any arguments, so that it can say why it cannot run
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "installed", True):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
