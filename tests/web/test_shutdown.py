"""SIGTERM on a real `rtserver serve` process (the embedded model, float32) while two replies stream: the
graceful drain as docs/protocol.md describes it ("Limits and shutdown")."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import websockets

from rtbench.serverproc import ServerProcess

GRACE_S = 4.0
COUNT = "Count from 1 to 500, separated by commas, and say nothing else."
# The long reply may not end at EOS before its grace period is over, wherever greedy decoding stops on
# this CPU: the test's config lets a client ask for a minimum length.
CONFIG = """
[chat]
overridable = { min_new_tokens = [0, 512] }
"""


async def _recv(ws, timeout: float = 60.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def _events_until_closed(ws, timeout: float = 60.0) -> tuple[list[dict], int | None]:
    """Every event until the server closes the connection, and the close code."""
    events = []
    try:
        while True:
            events.append(await _recv(ws, timeout))
    except websockets.ConnectionClosed as exc:
        return events, exc.rcvd.code if exc.rcvd is not None else None


async def _chat(ws, rid: str, max_new_tokens: int) -> None:
    await ws.send(json.dumps({"type": "hello", "client": "shutdown test"}))
    assert (await _recv(ws))["type"] == "ready"
    options = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "temperature": 0}
    await ws.send(json.dumps({"type": "chat", "id": rid, "text": COUNT, "options": options}))
    while (ev := await _recv(ws))["type"] != "token":
        assert ev["type"] != "error", ev


def _end(events: list[dict], rid: str) -> dict:
    ends = [e for e in events if e.get("id") == rid and e["type"] in ("done", "error")]
    assert len(ends) == 1, events
    return ends[0]


async def test_sigterm_drains_short_reply_ends_long_one_and_exits_0(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    server = ServerProcess(
        {
            "RTSERVER_MODEL_DTYPE": "float32",
            "RTSERVER_TASKS_LEARNED_HEADS": "false",
            "RTSERVER_SERVER_SHUTDOWN_GRACE_S": str(GRACE_S),
            "RTSERVER_SERVER_LOG_LEVEL": "warning",
            "RTSERVER_SECURITY_IP_RATE_LIMIT_PER_S": "0",
            "RTSERVER_TASKS_AUTO_TASKS": "",
        },
        tmp_path / "server.log",
        config=str(config),
    )
    await asyncio.to_thread(server.start, 180)
    try:
        async with (
            websockets.connect(server.ws_url, open_timeout=60) as long_ws,
            websockets.connect(server.ws_url, open_timeout=60) as short_ws,
        ):
            # long: 512 new tokens (EOS held off), far beyond what the grace period allows; short: 16 tokens,
            # still streaming when the signal comes, done well within it
            await _chat(long_ws, "long", 512)
            await _chat(short_ws, "short", 16)
            sigterm_at = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            (long_events, long_code), (short_events, short_code) = await asyncio.gather(
                _events_until_closed(long_ws), _events_until_closed(short_ws)
            )
        rc = await asyncio.to_thread(server.proc.wait, 60)
        exit_s = time.monotonic() - sigterm_at
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()

    for events in (long_events, short_events):
        notices = [e for e in events if e["type"] == "shutting_down"]
        assert notices == [{"type": "shutting_down", "deadline_s": GRACE_S}], events
    # the short reply was still streaming when the notice came, and finished within the grace period
    short_types = [e["type"] for e in short_events]
    short_done = _end(short_events, "short")
    assert short_done["type"] == "done" and short_done["finish_reason"] == "length", short_done
    assert short_types.index("shutting_down") < short_events.index(short_done), short_types
    # the long one could not: it ends with error shutting_down, after streaming for the grace period
    long_end = _end(long_events, "long")
    assert long_end["type"] == "error" and long_end["code"] == "shutting_down", long_end
    assert any(e["type"] == "token" for e in long_events)
    assert (long_code, short_code) == (1001, 1001)
    assert rc == 0, server.log_path.read_text()
    assert GRACE_S <= exit_s < GRACE_S + 30, exit_s
    assert not server.log_errors(), server.log_errors()
