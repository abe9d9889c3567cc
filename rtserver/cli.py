"""Command line: `rtserver serve`, `rtserver bench`, `rtserver loadtest`, `rtserver eval`,
`rtserver fit-heads`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from .config import DTYPES, ConfigError, load_settings

BENCH_WORKLOADS = [
    "burst",
    "single",
    "arrival",
    "multi-turn",
    "sentiment",
    "structured",
    "e2e",
    "servers",
    "formats",
    "remote",
]
# "servers": llama-server beside `rtserver serve` (builds llama-server the first time; alone, the quick
# re-run after an engine change); "formats" (the model files matrix, long) and "remote" (the hub in
# front of llama-server) are asked for by name
DEFAULT_WORKLOADS = BENCH_WORKLOADS[:-2]
MAX_REPS = 20  # `bench --reps`: each is two server runs per formats row


# The model runs on the scheduler thread, where libgomp lets idle workers sleep almost at once, so each
# parallel region of a step waits for a wake-up. A bounded active spin keeps them hot within a step;
# libgomp reads it once, so it is set before torch is imported.
OPENMP_WAIT = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"}


def _openmp_wait_for_the_scheduler_thread() -> None:
    """For the commands whose model runs on the scheduler thread (serve, eval); the bench leaves the
    environment alone, so the llama-server it starts runs as it would anywhere."""
    if "torch" not in sys.modules:
        for key, value in OPENMP_WAIT.items():
            os.environ.setdefault(key, value)


def _settings(args: argparse.Namespace):
    try:
        return load_settings(args.config or os.environ.get("RTSERVER_CONFIG"))
    except ConfigError as exc:
        print(f"rtserver: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _load(settings, dtype: str | None = None):
    from .engine.model import ModelLoadError, load_model

    m = settings.model
    try:
        return load_model(m.model, dtype or m.dtype, m.threads, m.cache_dir)
    except ModelLoadError as exc:
        print(f"rtserver: cannot load the model: {exc}", file=sys.stderr)
        raise SystemExit(3) from None


def cmd_serve(args: argparse.Namespace) -> int:
    _openmp_wait_for_the_scheduler_thread()
    from .web.server import serve

    settings = _settings(args)
    if args.host:
        settings.server.host = args.host
    if args.port is not None:
        settings.server.port = args.port
    return serve(settings)


def cmd_bench(args: argparse.Namespace) -> int:
    from .engine.model import cpu_has_native_bf16
    from .tools.bench import run_bench

    settings = _settings(args)
    workloads = args.workloads.split(",") if args.workloads else DEFAULT_WORKLOADS
    unknown = set(workloads) - set(BENCH_WORKLOADS)
    if unknown:
        print(
            f"rtserver bench: unknown workloads {', '.join(sorted(unknown))} "
            f"(known: {', '.join(BENCH_WORKLOADS)})",
            file=sys.stderr,
        )
        return 2
    if not 1 <= args.reps <= MAX_REPS:
        print(f"rtserver bench: --reps {args.reps}: between 1 and {MAX_REPS}", file=sys.stderr)
        return 2
    formats = args.formats.split(",") if args.formats else None
    if formats:
        from .tools.formats_bench import matrix, pick

        try:
            pick(matrix(), formats)
        except ValueError as exc:
            print(f"rtserver bench: {exc}", file=sys.stderr)
            return 2
    native_bf16 = cpu_has_native_bf16()
    dtypes = args.dtypes.split(",") if args.dtypes else [settings.model.dtype]
    baseline_dtype = "bfloat16" if native_bf16 else "float32"
    run_bench(
        lambda dtype: _load(settings, dtype),
        dtypes,
        baseline_dtype,
        settings.engine,
        workloads,
        not args.no_baselines,
        args.naive_requests,
        args.out,
        args.config,
        settings.model.threads,
        formats,
        args.reps,
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    _openmp_wait_for_the_scheduler_thread()
    from .tools.evaluate import run_eval

    settings = _settings(args)
    loaded = _load(settings, args.dtype)
    run_eval(loaded, settings, args.split, args.out, tuple(args.task or ("sentiment", "intent")))
    return 0


def cmd_fit_heads(args: argparse.Namespace) -> int:
    from .tools.fit_heads import lower_priority, run_fit_heads

    settings = _settings(args)
    if args.background:
        lower_priority()  # before the model loads: torch's threads inherit it
    run_fit_heads(_load(settings, args.dtype), settings, args.task, ship=args.ship)
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    from .tools.loadtest import run_loadtest

    _settings(args)  # a bad config stops here with its message, not inside a server process
    if args.nodes > 1:  # many nodes through Redis (rtserver/tools/clusterload.py)
        from .tools.clusterload import run_cluster_loadtest

        idle, chatting = (200, 16) if args.quick else (args.idle, args.chatting)
        cluster = run_cluster_loadtest(
            args.nodes, idle, chatting, config=args.config, out_dir=args.out, dtype=args.dtype
        )
        return 0 if cluster["passed"] else 1
    if args.assist:  # agent assist beside chatting customers (rtserver/tools/assistload.py)
        from .tools.assistload import run_assist_loadtest

        chatting = 32 if args.chatting == 64 else args.chatting  # the default run is 32 customers
        report = run_assist_loadtest(chatting, config=args.config, dtype=args.dtype)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"loadtest-assist-{time.strftime('%Y-%m-%dT%H%M%S%z')}.json"
        path.write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        print(f"written to {path}")
        return 0 if report["ttft_p95_ratio"] is not None and not report["draft_errors"] else 1
    sizes = (200, 16, 20) if args.quick else (args.idle, args.chatting, args.disconnects)
    report = run_loadtest(*sizes, config=args.config, out_dir=args.out, dtype=args.dtype)
    return 0 if report["passed"] else 1


def build_parser() -> argparse.ArgumentParser:
    config_help = "config file (default: ./config.toml, or $RTSERVER_CONFIG)"
    parser = argparse.ArgumentParser(prog="rtserver", description=__doc__)
    parser.add_argument("--config", help=config_help)
    # `--config` is taken before or after the command (`rtserver serve --config PATH`); SUPPRESS keeps a
    # value given before the command when the command's own copy is not used
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help=config_help)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server", parents=[common])
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="measure the engine and baselines side by side", parents=[common])
    bench.add_argument(
        "--workloads",
        help=f"comma-separated subset of {','.join(BENCH_WORKLOADS)} (default: all but remote); "
        "`--workloads servers` runs only llama-server beside `rtserver serve` (each --dtypes)",
    )
    bench.add_argument(
        "--dtypes",
        help="comma-separated engine dtypes; all workloads run on the first, the "
        "burst and sentiment (speed + agreement with float32) on the others (default: the configured one); "
        "DTYPE:kv=KV_DTYPE sets the KV element type too, e.g. gguf:kv=float32,gguf:kv=q8_0",
    )
    bench.add_argument(
        "--formats",
        help="with --workloads formats: comma-separated rows of its matrix, e.g. embedded,q4_k_m "
        "(default: all; an unknown name lists them)",
    )
    bench.add_argument(
        "--reps",
        type=int,
        default=1,
        help="with --workloads formats: runs of each row, the servers alternating (A B A B); every "
        "pair is reported (default 1)",
    )
    bench.add_argument("--no-baselines", action="store_true", help="engine figures only")
    bench.add_argument(
        "--naive-requests",
        type=int,
        default=4,
        help="burst requests run by the sequential naive baseline (its tokens/s does not "
        "depend on the count)",
    )
    bench.add_argument("--out", default="bench-results", help="folder for the JSON report")
    bench.set_defaults(func=cmd_bench)
    lt = sub.add_parser(
        "loadtest",
        help="reliability figures: load, overload, slow and leaving clients, faults, "
        "shutdown, load failure (real servers on 127.0.0.1)",
        parents=[common],
    )
    lt.add_argument("--idle", type=int, default=1000, help="idle WebSocket connections held open")
    lt.add_argument("--chatting", type=int, default=64, help="sessions chatting beside them")
    lt.add_argument("--disconnects", type=int, default=100, help="clients leaving mid-stream, per pattern")
    lt.add_argument("--quick", action="store_true", help="200 idle, 16 chatting, 20 disconnects (the CI run)")
    lt.add_argument(
        "--assist",
        action="store_true",
        help="only agent assist: 32 chatting customers alone, then beside 4 agents asking drafts every 5 s",
    )
    lt.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="2 or more: that many nodes sharing a redis-server (idle and chatting per node), "
        "cross-node resume, and the TTFT cost of redis_url",
    )
    lt.add_argument("--dtype", choices=DTYPES)
    lt.add_argument("--out", default="bench-results", help="folder for the JSON report")
    lt.set_defaults(func=cmd_loadtest)
    ev = sub.add_parser(
        "eval", help="sentiment and intent accuracy table on the shipped labeled data", parents=[common]
    )
    ev.add_argument("--split", default="test", choices=["dev", "test"])
    ev.add_argument(
        "--task", action="append", choices=["sentiment", "intent"], help="only this task (repeatable)"
    )
    ev.add_argument("--dtype", choices=DTYPES)
    ev.add_argument("--out", default="bench-results")
    ev.set_defaults(func=cmd_eval)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
