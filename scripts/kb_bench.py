"""Knowledge's bars, measured: indexing 1,000 articles, retrieval p95, and the chat's first-token time with
knowledge on against off at turn 1 and turn 5 (real `rtserver serve` processes, real /ws clients).

    python scripts/kb_bench.py index
    python scripts/kb_bench.py ttft --reps 3 --sessions 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import websockets

from rtbench.serverproc import ONE_ADDRESS_LIMITS_OFF, ServerProcess
from rtserver.tasks.kb_index import Index, build

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def bench_index() -> None:
    """1,000 articles of the shop's sentences and words of their own: build time, search p95."""
    texts = [f.read_text().split("---")[-1] for f in (DATA / "shop_kb").glob("*.md")]
    sentences = [s for t in texts for s in t.split(". ")]
    questions = [json.loads(x)["question"] for x in (DATA / "shop_questions.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        kb = Path(tmp) / "kb"
        kb.mkdir()
        for i in range(1000):
            own = " ".join(f"w{rng.randrange(20000)}" for _ in range(40))
            body = ". ".join(rng.sample(sentences, 6))
            (kb / f"a{i}.md").write_text(f"---\ntitle: Article {i} {own[:30]}\n---\n{body}\n\n{own} topic{i}")
        start = time.perf_counter()
        build(str(kb), Path(tmp) / "i.sqlite3", 700, "", (20_000, 1 << 20, 256))
        took = time.perf_counter() - start
        index = Index(Path(tmp) / "i.sqlite3")
        times = []
        for q in questions * 5:
            t = time.perf_counter()
            index.search(q, 3)
            times.append((time.perf_counter() - t) * 1000)
    times.sort()
    p50, p95 = times[len(times) // 2], times[int(0.95 * len(times))]
    print(f"indexing 1000 articles: {took:.2f} s")
    print(f"retrieval, {len(times)} searches: p50 {p50:.2f} ms, p95 {p95:.2f} ms")


async def session_ttfts(url: str, questions: list[str], max_new_tokens: int) -> list[float]:
    """One session's turns: the client's time from sending each message to its first token, ms."""
    out = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "hello"}))
        json.loads(await ws.recv())
        for i, q in enumerate(questions):
            options = {"temperature": 0, "max_new_tokens": max_new_tokens}
            start = time.perf_counter()
            await ws.send(json.dumps({"type": "chat", "id": f"t{i}", "text": q, "options": options}))
            first = None
            while True:
                event = json.loads(await ws.recv())
                if event.get("type") == "token" and first is None:
                    first = (time.perf_counter() - start) * 1000
                if event.get("id") == f"t{i}" and event["type"] in ("done", "error"):
                    assert event["type"] == "done", event
                    break
            out.append(first if first is not None else float("nan"))
    return out


def run_server(
    knowledge: bool, sessions: list[list[str]], max_new_tokens: int, log: Path
) -> list[list[float]]:
    env = {
        **ONE_ADDRESS_LIMITS_OFF,
        "RTSERVER_KNOWLEDGE_ENABLED": "true" if knowledge else "false",
        "RTSERVER_KNOWLEDGE_FOLDER": str(ROOT / "docs"),
        "RTSERVER_TASKS_AUTO_TASKS": "",
        "RTSERVER_TASKS_PLUGIN_DIRS": "",  # the chat alone, in both arms: a quicker start
    }
    server = ServerProcess(env, log)
    server.start(timeout_s=900)
    try:
        if knowledge:  # as a server that has run a while: its sources computed ahead
            print(f"sources computed ahead in {wait_for_sources(server.base):.0f} s", flush=True)
        asyncio.run(session_ttfts(server.ws_url, ["Hello"], 4))  # warm: first compiles and allocations
        return [asyncio.run(session_ttfts(server.ws_url, qs, max_new_tokens)) for qs in sessions]
    finally:
        server.stop()


def wait_for_sources(base: str, timeout_s: float = 900) -> float:
    """Seconds until /health says every source to compute ahead is."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            k = json.load(r).get("knowledge", {})
        if k.get("sources_to_compute") and k["sources_ahead"] >= k["sources_to_compute"]:
            return time.perf_counter() - start
        time.sleep(1)
    raise RuntimeError("the sources were not computed ahead in time")


def bench_ttft(reps: int, n_sessions: int, max_new_tokens: int) -> None:
    questions = [json.loads(x)["question"] for x in (DATA / "docs_questions.jsonl").read_text().splitlines()]
    rng = random.Random(1)
    ratios: dict[int, list[float]] = {1: [], 5: []}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            sessions = [rng.sample(questions, 5) for _ in range(n_sessions)]
            got = {}
            for knowledge in (rep % 2 == 0, rep % 2 == 1):  # the order alternates between reps
                got[knowledge] = run_server(
                    knowledge, sessions, max_new_tokens, Path(tmp) / f"{rep}{knowledge}.log"
                )
            for turn in (1, 5):
                on = statistics.median(s[turn - 1] for s in got[True])
                off = statistics.median(s[turn - 1] for s in got[False])
                ratios[turn].append(on / off)
                rows.append({"rep": rep, "turn": turn, "off_ms": off, "on_ms": on, "ratio": on / off})
                print(
                    f"rep {rep} turn {turn}: TTFT median {off:.0f} ms off, {on:.0f} ms on: {on / off:.2f}x",
                    flush=True,
                )
    summary = {}
    for turn, rs in ratios.items():
        spread = f"{min(rs):.2f}-{max(rs):.2f}"
        print(f"turn {turn}: median ratio {statistics.median(rs):.2f}x (spread {spread}, {len(rs)} reps)")
        summary[f"turn{turn}_median_ratio"] = statistics.median(rs)
    out = ROOT / "bench-results" / f"kb-ttft-{time.strftime('%Y-%m-%dT%H%M%S%z')}.json"
    out.parent.mkdir(exist_ok=True)
    command = f"python scripts/kb_bench.py ttft --reps {reps} --sessions {n_sessions}"
    out.write_text(
        json.dumps({"command": command, "sessions": n_sessions, **summary, "rows": rows}, indent=1)
    )
    print(f"written to {out.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("index")
    ttft = sub.add_parser("ttft")
    ttft.add_argument("--reps", type=int, default=3)
    ttft.add_argument("--sessions", type=int, default=3)
    ttft.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.what == "index":
        bench_index()
    else:
        bench_ttft(args.reps, args.sessions, args.max_new_tokens)


if __name__ == "__main__":
    main()
