"""`rtserver bench`, `rtserver loadtest` and `rtserver eval`: their arguments and what each runs.

pyproject declares each `add_*` in the entry-point group `rtserver.commands`. `rtserver/cli.py` calls it
with the command's name. It also passes the parser of the options every command takes (`--config`).
"""

from __future__ import annotations

import argparse
import sys

from rtserver.cli import Subcommands, load_or_exit, openmp_wait_for_the_scheduler_thread, settings_or_exit
from rtserver.config import DTYPES

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
    "kld",
    "speculation",
]
# "servers": llama-server beside `rtserver serve` (builds llama-server the first time; alone, the quick
# re-run after an engine change); "formats" (the model files matrix, long), "remote" (the hub in front
# of llama-server), "kld" (KL divergence from float32, beside llama-perplexity's) and "speculation"
# (drafts on and off) are asked for by name
BY_NAME = ("formats", "remote", "kld", "speculation")
DEFAULT_WORKLOADS = [w for w in BENCH_WORKLOADS if w not in BY_NAME]
MAX_REPS = 20  # `bench --reps`: each is two server runs per formats row


def _refuse(message: str) -> int:
    print(f"rtserver bench: {message}", file=sys.stderr)
    return 2


def _bench_arguments_refused(args: argparse.Namespace, workloads: list[str]) -> str | None:
    """Why the arguments cannot run, checked before any model loads. None when they can."""
    unknown = set(workloads) - set(BENCH_WORKLOADS)
    if unknown:
        return f"unknown workloads {', '.join(sorted(unknown))} (known: {', '.join(BENCH_WORKLOADS)})"
    if not 1 <= args.reps <= MAX_REPS:
        return f"--reps {args.reps}: between 1 and {MAX_REPS}"
    if args.formats:
        from .formats_bench import matrix, pick

        try:
            pick(matrix(), args.formats.split(","))
        except ValueError as exc:
            return str(exc)
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    from rtserver.engine.model import cpu_has_native_bf16

    from .bench import run_bench

    settings = settings_or_exit(args)
    workloads = args.workloads.split(",") if args.workloads else DEFAULT_WORKLOADS
    refused = _bench_arguments_refused(args, workloads)
    if refused:
        return _refuse(refused)
    dtypes = args.dtypes.split(",") if args.dtypes else [settings.model.dtype]
    baseline_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    run_bench(
        lambda dtype: load_or_exit(settings, dtype),
        dtypes,
        baseline_dtype,
        settings.engine,
        workloads,
        not args.no_baselines,
        args.naive_requests,
        args.out,
        args.config,
        settings.model.threads,
        args.formats.split(",") if args.formats else None,
        args.reps,
        settings.model.cache_dir,
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    openmp_wait_for_the_scheduler_thread()
    from .evaluate import run_eval

    settings = settings_or_exit(args)
    loaded = load_or_exit(settings, args.dtype)
    run_eval(loaded, settings, args.split, args.out, tuple(args.task or ("sentiment", "intent")))
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    settings_or_exit(args)  # a bad config stops here with its message, not inside a server process
    if args.nodes > 1:  # many nodes through Redis (rtbench/clusterload.py)
        from .clusterload import run_cluster_loadtest

        idle, chatting = (200, 16) if args.quick else (args.idle, args.chatting)
        cluster = run_cluster_loadtest(
            args.nodes, idle, chatting, config=args.config, out_dir=args.out, dtype=args.dtype
        )
        return 0 if cluster["passed"] else 1
    if args.assist:  # agent assist beside chatting customers (rtbench/assistload.py)
        from .assistload import run_assist_loadtest
        from .loadtest_report import write_assist_report

        chatting = 32 if args.chatting == 64 else args.chatting  # the default run is 32 customers
        report = run_assist_loadtest(chatting, config=args.config, dtype=args.dtype)
        write_assist_report(report, args.out)
        return 0 if report["ttft_p95_ratio"] is not None and not report["draft_errors"] else 1
    from .loadtest import run_loadtest

    idle, chatting, leaving = (200, 16, 20) if args.quick else (args.idle, args.chatting, args.disconnects)
    report = run_loadtest(idle, chatting, leaving, config=args.config, out_dir=args.out, dtype=args.dtype)
    return 0 if report["passed"] else 1


def add_bench(sub: Subcommands, name: str, common: argparse.ArgumentParser) -> None:
    bench = sub.add_parser(name, help="measure the engine and baselines side by side", parents=[common])
    bench.add_argument(
        "--workloads",
        help=f"comma-separated subset of {','.join(BENCH_WORKLOADS)} "
        f"(default: all but {', '.join(BY_NAME)}); "
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
        help="with --workloads formats or kld: comma-separated rows of the formats matrix, e.g. "
        "embedded,q4_k_m (default: all for formats, q4_k_m,gemma3-270m-q4_k_m for kld; an unknown name "
        "lists them)",
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


def add_loadtest(sub: Subcommands, name: str, common: argparse.ArgumentParser) -> None:
    lt = sub.add_parser(
        name,
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


def add_eval(sub: Subcommands, name: str, common: argparse.ArgumentParser) -> None:
    ev = sub.add_parser(
        name, help="sentiment and intent accuracy table on the shipped labeled data", parents=[common]
    )
    ev.add_argument("--split", default="test", choices=["dev", "test"])
    ev.add_argument(
        "--task", action="append", choices=["sentiment", "intent"], help="only this task (repeatable)"
    )
    ev.add_argument("--dtype", choices=DTYPES)
    ev.add_argument("--out", default="bench-results")
    ev.set_defaults(func=cmd_eval)
