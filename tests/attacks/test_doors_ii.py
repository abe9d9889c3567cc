"""The doors (issue 48, items 8 and 9) against a real uvicorn server with the scripted engine.

Loopback is no credential for a page: a DNS-rebinding page (a foreign Host) reaches no endpoint, and a
foreign page's simple cross-site POST (text/plain, a form) runs nothing on the API. The console opens to
its own page only, and an address's wrong logins slow every login from it but never refuse the right
token. Each test measures the harm (bytes leaked, generations run, a refused agent), not a status only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
import websockets

from ..serverutil import ScriptedEngine, make_settings, recv_json, scripted_app, serve

TOKEN = "s3cret-console-token"
FOREIGN = "rebind.attacker.example"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# a simple request: a browser sends these to any site without asking it first (no CORS preflight)
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz")
API_POSTS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 4},
    "/chat": {"history": [{"role": "user", "content": "hi"}]},
    "/sentiment": {"text": "great"},
    "/v1/tasks/sentiment": {"input": {"text": "great"}},
    "/tokenize": {"content": "hi"},
}


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


async def _handshake(port: int, path: str, host: str, origin: str | None = None) -> tuple[int, bytes]:
    """A raw WebSocket upgrade to 127.0.0.1:`port` naming `host`: the status and what came with it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    )
    if origin:
        head += f"Origin: {origin}\r\n"
    writer.write((head + "\r\n").encode())
    try:
        status = await asyncio.wait_for(reader.readline(), 10)
        rest = b""
        with contextlib.suppress(asyncio.TimeoutError):
            while len(rest) < 65536:
                chunk = await asyncio.wait_for(reader.read(4096), 1)
                if not chunk:
                    break
                rest += chunk
    finally:
        writer.close()
    return int(status.split()[1]), rest


# -- item 9: a foreign Host (DNS rebinding) --------------------------------------------------------


async def test_a_foreign_host_reaches_no_endpoint(smol):
    """A page of rebind.attacker.example whose name now points at 127.0.0.1 asks the node for its
    metrics, its health detail, a generation and a WebSocket: loopback must not vouch for it."""
    settings = make_settings(tasks={"auto_tasks": []}, server={"allowed_hosts": ["chat.shop.example"]})
    engine = ScriptedEngine(smol)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, _):
        port = _port(base)
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            leaked = 0
            rebound = {"Host": f"{FOREIGN}:{port}"}
            for method, path in (("GET", "/metrics"), ("GET", "/health"), ("GET", "/console")):
                r = await http.request(method, path, headers=rebound)
                assert r.status_code == 400, (path, r.status_code, r.text[:200])
                assert r.json()["error"]["code"] == "forbidden_host", r.text[:300]
                leaked += len(r.content) if "rtserver" in r.text or "model" in r.text else 0
            r = await http.post("/v1/chat/completions", json=CHAT, headers=rebound)
            assert r.status_code == 400 and r.json()["error"]["code"] == "forbidden_host", r.text[:300]
            assert leaked == 0 and engine.generated == 0  # nothing read, nothing generated
            status, _ = await _handshake(port, "/ws", f"{FOREIGN}:{port}")
            assert status == 400, status
            # this node's own names: loopback still counts, and the widget door is open
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "chat.shop.example"):
                r = await http.get("/metrics", headers={"Host": host})
                assert r.status_code == 200 and "rtserver" in r.text, (host, r.status_code)
                assert "model" in (await http.get("/health", headers={"Host": host})).json(), host
            r = await http.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and engine.generated > 0, r.text[:300]
            assert (await _handshake(port, "/ws", f"localhost:{port}"))[0] == 101
            # a request without a Host is no browser's (an HTTP/1.0 health check): it is answered
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ready HTTP/1.0\r\n\r\n")
            assert b" 200 " in await asyncio.wait_for(reader.readline(), 10)
            writer.close()


async def test_allowed_hosts_star_turns_the_check_off(smol):
    settings = make_settings(tasks={"auto_tasks": []}, server={"allowed_hosts": ["*"]})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            assert (await http.get("/health", headers={"Host": FOREIGN})).status_code == 200


# -- item 9: a cross-site POST (CSRF) --------------------------------------------------------------


async def test_a_cross_site_simple_post_runs_nothing(smol):
    """A foreign page posts JSON text as text/plain (or a form) to the API on 127.0.0.1: a browser
    sends it without asking, with the loopback address. The API answers 415 and runs no model work."""
    settings = make_settings(tasks={"auto_tasks": []})
    engine = ScriptedEngine(smol)
    async with serve(scripted_app(smol, settings, engine), settings) as (base, _):
        before = engine.scored  # the tasks' calibration at start-up
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for path, body in API_POSTS.items():
                for ctype in (*SIMPLE_TYPES, None):
                    headers = {"Origin": "https://evil.example"}
                    if ctype:
                        headers["Content-Type"] = ctype
                    r = await http.post(path, content=json.dumps(body).encode(), headers=headers)
                    assert r.status_code == 415, (path, ctype, r.status_code, r.text[:300])
                    error = r.json()["error"]
                    assert error["code"] == "unsupported_media_type", error
                    assert "application/json" in error["message"], error
            assert (engine.generated, engine.scored - before, engine.prompts) == (0, 0, [])  # no model work
            # the same bodies as JSON (what a program or a hub sends) are served
            for path, body in API_POSTS.items():
                r = await http.post(path, json=body)
                assert r.status_code == 200, (path, r.status_code, r.text[:300])
            r = await http.post(
                "/chat",
                content=json.dumps(API_POSTS["/chat"]).encode(),
                headers={"Content-Type": "Application/JSON; charset=utf-8"},
            )
            assert r.status_code == 200, r.text[:300]
            assert engine.generated > 0


# -- item 8: the console's Origin ------------------------------------------------------------------


async def test_the_console_opens_to_its_own_page_only(smol):
    """A foreign page (open in an agent's browser) cannot reach /ws/console, the console's own page
    and the pages of `security.console_origins` can; the widget door keeps its own rule (any page)."""
    settings = make_settings(
        tasks={"auto_tasks": []},
        security={"console_token": TOKEN, "console_origins": ["https://agents.shop.example"]},
    )
    login = json.dumps({"type": "login", "token": TOKEN, "agent": "Sam"})
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        port, console = _port(base), url + "/console"
        for origin in (
            "https://evil.example",
            f"http://{FOREIGN}:{port}",
            f"http://127.0.0.1:{port + 1}",  # another site on this host
            "null",
        ):
            async with websockets.connect(console, origin=origin) as ws:  # type: ignore[arg-type]
                err = await recv_json(ws)
                assert err["code"] == "forbidden_origin", (origin, err)
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await ws.send(login)  # the right token is of no use from there
                    await asyncio.wait_for(ws.recv(), 10)
                assert info.value.rcvd is not None and info.value.rcvd.code == 1008, origin
        for origin in (f"http://127.0.0.1:{port}", "https://agents.shop.example", None):
            async with websockets.connect(console, origin=origin) as ws:  # type: ignore[arg-type]
                await ws.send(login)
                ready = await recv_json(ws)
                assert ready["type"] == "console_ready", (origin, ready)
        async with websockets.connect(url, origin="https://evil.example") as ws:  # the widget: any page
            await ws.send(json.dumps({"type": "hello"}))
            assert (await recv_json(ws))["type"] == "ready", "the widget door refused a page"


# -- item 8: wrong logins from the agents' address -------------------------------------------------


async def _login(url: str, token: object, rejoin: str | None = None) -> tuple[dict, float, int | None]:
    """One login: the server's first answer, how long it took, and the close code (None: open)."""
    async with websockets.connect(url + "/console") as ws:
        msg = {"type": "login", "token": token, "agent": "Sam", **({"rejoin": rejoin} if rejoin else {})}
        started = time.monotonic()
        await ws.send(json.dumps(msg))
        answer = await recv_json(ws, timeout=60)
        took = time.monotonic() - started
        code = None
        if answer["type"] == "error":
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 10)
            code = info.value.rcvd.code if info.value.rcvd else None
        return answer, took, code


async def test_wrong_logins_from_an_address_slow_it_but_never_refuse_the_right_token(smol):
    """Someone on the agents' address (a foreign page before, a neighbour behind the same NAT) sends
    wrong tokens. Before: past the limit the right token was refused too (`rate_limited`, 4429), the
    agents were locked out. Now every login from there waits, doubling, and the right token gets in."""
    settings = make_settings(
        tasks={"auto_tasks": []}, security={"console_token": TOKEN, "console_login_failures_per_min": 2}
    )
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        ready, took, _ = await _login(url, TOKEN)
        assert ready["type"] == "console_ready" and took < 1.0
        rejoin = ready["rejoin"]
        waits = []
        for guess in ("guess-1", "guess-2", "guess-3"):
            err, took, code = await _login(url, guess)
            assert (err["code"], code) == ("unauthorized", 4401), err
            waits.append(took)
        assert waits[0] < 1.0 and waits[1] < 1.0 and waits[2] >= 1.0, waits  # the third one waited
        # the right token: it waits as long as a wrong one would (the wait tells nothing) and gets in
        ready, took, code = await _login(url, TOKEN)
        assert ready["type"] == "console_ready" and code is None, ready
        assert 2.0 <= took < 10.0, took
        # an agent who logged in before (its rejoin token) does not wait for the others' failures
        ready, took, _ = await _login(url, TOKEN, rejoin)
        assert ready["type"] == "console_ready" and took < 1.0, took


async def test_a_page_retrying_one_stale_token_counts_once(smol):
    """An agent's console page reconnecting with yesterday's token is one failure, however often."""
    settings = make_settings(
        tasks={"auto_tasks": []}, security={"console_token": TOKEN, "console_login_failures_per_min": 2}
    )
    async with serve(scripted_app(smol, settings, ScriptedEngine(smol)), settings) as (base, url):
        for _ in range(6):
            err, took, code = await _login(url, "yesterdays-token")
            assert (err["code"], code) == ("unauthorized", 4401) and took < 1.0, (err, took)
        ready, took, _ = await _login(url, TOKEN)
        assert ready["type"] == "console_ready" and took < 1.0, (ready, took)
