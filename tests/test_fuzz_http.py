"""Property-based fuzzing (hypothesis) of the HTTP API on one real server (tests/fuzzutil.py):
requests with random bodies (mutated valid bodies, any JSON, binary, invalid UTF-8, UTF-16, deep nesting,
odd numbers), content types, methods and Authorization headers to every route of `http_api.ROUTES` and
the open routes; bodies over the transport limit, with a length and chunked.

Checked: every response is < 500, has no internals in its body, is strict JSON (error bodies with a
documented code and exactly `code`, `message`, `type`, `param`; SSE chunks without errors); a body that
is not a JSON object on a POST route gets the 400 `bad_json` (or 413) the documentation promises; a wrong
or missing token gets 401 `unauthorized` while the open routes stay open; the server logs no error; and
afterwards a normal chat works.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

import httpx
import pytest
from hypothesis import given, reject
from hypothesis import strategies as st

from rtserver.web import http_api

from . import fuzzutil
from .fuzzutil import (
    API_TOKEN,
    TASK_NAMES,
    TRANSPORT_MAX,
    WRONG,
    BadJSON,
    any_char,
    check_response,
    deep_json,
    fuzz,
    json_values,
    odd_numbers,
    ref_loads,
    texts,
)

pytestmark = fuzzutil.RANDOM_WARNING


@pytest.fixture(scope="module")
def server(smol):
    with fuzzutil.running_fuzz_server(smol) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    yield from fuzzutil.http_client(server)


@pytest.fixture(autouse=True)
def no_server_errors(request):
    """Every test: the server logs nothing at ERROR and no exception while it runs."""
    yield from fuzzutil.no_new_server_errors(request)


@pytest.fixture
def api_token(server):
    with fuzzutil.api_token_on(server) as token:
        yield token


# -- HTTP -----------------------------------------------------------------------------------------

API_ROUTES = [(path, methods) for path, _, methods in http_api.ROUTES]
assert any(path == "/v1/chat/completions" for path, _ in API_ROUTES)
OPEN_ROUTES = [("/health", ["GET"]), ("/ready", ["GET"]), ("/metrics", ["GET"])]
BODIES = {
    "/v1/tasks/{name}": {"input": {"text": "good"}, "options": {}},
    "/sentiment": {"text": "good"},
    "/chat": {"history": [{"role": "user", "content": "hi"}], "options": {}},
    "/v1/chat/completions": {
        "model": "x",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0.5,
        "stream": False,
        "stream_options": {"include_usage": True},
        "stop": ["\n\n"],
        "seed": 1,
    },
}
CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-16",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=zz",
    "application/xml",
    "*/*",
    "application/json; charset=latin-1",
]
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
).map(str.strip)


@st.composite
def mutated_body(draw, path: str) -> bytes:
    body = json.loads(json.dumps(BODIES.get(path, {"input": {"text": "x"}})))
    for _ in range(draw(st.integers(1, 3))):
        target = body
        if draw(st.booleans()):  # one level down
            nested = [k for k, v in body.items() if isinstance(v, (dict, list)) and v]
            if nested:
                target = body[draw(st.sampled_from(sorted(nested)))]
                if isinstance(target, list):
                    target = target[-1] if isinstance(target[-1], dict) else body
        keys = sorted(target) + [
            "extra",
            "n",
            "tools",
            "logprobs",
            "response_format",
            "min_tokens",
            "ignore_eos",
            "role",
            "content",
            "history",
            "input",
            "text",
            "options",
            "stream",
            "messages",
        ]
        key = draw(st.sampled_from(keys))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(st.one_of(*WRONG.values(), json_values))
    return json.dumps(body).encode()


def _body_strategy(path: str):
    return st.one_of(
        mutated_body(path),
        mutated_body(path),
        mutated_body(path),
        st.builds(lambda v: json.dumps(v).encode(), json_values),
        st.binary(max_size=80),
        st.text(alphabet=any_char, max_size=30).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.text(alphabet=any_char, max_size=10).map(
            lambda s: json.dumps({"text": s, "input": {"text": s}}).encode()
        ),
        deep_json(wrap=False).map(str.encode),
        deep_json(wrap=False).map(
            lambda d: ('{"input":%s,"text":%s,"history":%s,"messages":%s}' % (d, d, d, d)).encode()
        ),
        odd_numbers().map(lambda f: f.encode()),
        st.sampled_from(
            [
                b"",
                b"null",
                b"{}",
                b"[]",
                b'"x"',
                b"\xef\xbb\xbf{}",
                b"\xff\xfe{\x00}\x00",
                json.dumps({"text": "ok"}).encode("utf-16"),
                b'{"text": "\xed\xa0\x80"}',
                b'{"input": {"text": "\xed\xa0\x80"}}',
                b'{"history": "\xc0\xaf"}',
            ]
        ),
    )


def _fill(path: str, name: str) -> str:
    return path.replace("{name}", urllib.parse.quote(name.encode("utf-8", "surrogatepass"), safe=""))


@st.composite
def http_request(draw) -> tuple[str, str, bytes, dict]:
    path, methods = draw(st.sampled_from(API_ROUTES + OPEN_ROUTES))
    if "{name}" in path:
        path = _fill(path, draw(st.one_of(st.sampled_from(TASK_NAMES[:4]), texts.filter(bool))))
    method = draw(
        st.one_of(
            st.just(methods[0]),
            st.just(methods[0]),
            st.just(methods[0]),
            st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
        )
    )
    template = next(
        (p for p, _ in API_ROUTES if _fill(p, "") == path[: len(_fill(p, ""))] and "{name}" in p), path
    )
    body = (
        draw(_body_strategy(template))
        if method not in ("GET", "HEAD") or draw(st.integers(0, 9)) == 0
        else b""
    )
    headers = {}
    ctype = draw(st.one_of(st.sampled_from(CONTENT_TYPES), header_text))
    if ctype:
        headers["content-type"] = ctype.encode("latin-1")
    return method, path, body, headers


def request(client: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """Send; an input a conforming HTTP client refuses to put on the wire (h11: e.g. a header value with
    trailing whitespace) is not an input: hypothesis drops it."""
    try:
        return client.request(method, url, **kwargs)
    except httpx.LocalProtocolError:
        reject()


def expected_http(method: str, path: str, body: bytes) -> int | None:
    """The status the documentation promises for a body that is not a JSON object on a POST route."""
    posts = {p for p, m in API_ROUTES if "POST" in m and "{name}" not in p}
    simple_task = re.fullmatch(r"/v1/tasks/[A-Za-z0-9_-]+", path)
    if method != "POST" or not (path in posts or simple_task):
        return None
    if len(body) > TRANSPORT_MAX:
        return 413
    try:
        obj = ref_loads(body.decode(json.detect_encoding(body)))
    except (BadJSON, UnicodeDecodeError):
        return 400
    return None if isinstance(obj, dict) else 400


@fuzz(450)
@given(req=http_request())
def test_http_api_random_requests(server, http, req):
    method, path, body, headers = req
    r = request(http, method, path, content=body, headers=headers)
    check_response(r, (method, path, body[:300], headers))
    status = expected_http(method, path, body)
    if status is not None:
        assert r.status_code == status, (method, path, body[:300], r.status_code, r.text[:500])
        if status == 400:
            assert r.json()["error"]["code"] == "bad_json", r.text[:500]


def test_http_huge_bodies_and_wrong_methods(server, http):
    for path, methods in API_ROUTES:
        url = _fill(path, "sentiment")
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
            r = http.request(method, url, content=b"{}")
            check_response(r, (method, url))
            if method not in methods:  # 404 where the static files' mount at / answers the method
                assert r.status_code in (404, 405), (method, url, r.status_code)
        if "POST" in methods:  # over the limit, with a Content-Length and chunked (no length given)
            for body in (b'{"text":"' + b"x" * (TRANSPORT_MAX + 1) + b'"}', iter([b" " * 65536] * 17)):
                r = http.post(url, content=body)
                check_response(r, ("huge", url))
                assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text[:300]


@fuzz(80)
@given(
    route=st.sampled_from(API_ROUTES),
    auth=st.one_of(
        st.none(),
        header_text,
        st.builds(lambda t: "Bearer " + t, header_text),
        st.sampled_from(
            [
                "Bearer",
                "Bearer ",
                "bearer " + API_TOKEN,
                "Bearer  " + API_TOKEN,
                "Bearer " + API_TOKEN + " ",
                "Basic " + API_TOKEN,
                API_TOKEN,
                "Bearer " + API_TOKEN[:-1],
                "Bearer " + API_TOKEN + "x",
                "Bearer " + API_TOKEN.upper(),
                "Bearer " + API_TOKEN,
            ]
        ),
    ),
)
def test_http_auth(server, http, api_token, route, auth):
    path, methods = route
    url = _fill(path, "sentiment")
    headers = {"authorization": auth.encode("latin-1")} if auth is not None else {}
    r = request(http, methods[0], url, content=json.dumps(BODIES.get(path, {})).encode(), headers=headers)
    check_response(r, (url, auth))
    if auth == "Bearer " + API_TOKEN:
        assert r.status_code != 401, r.text[:300]
    else:
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (auth, r.text[:300])
    for open_path, _ in OPEN_ROUTES:  # never behind the token
        check_response(r := http.get(open_path), open_path)
        assert r.status_code == 200


# -- afterwards: the server is fine ---------------------------------------------------------------


def test_zz_normal_chat_afterwards(server, http):
    """Runs last in this module: a normal chat works, and the server logged no error since it started."""
    fuzzutil.server_fine_afterwards(server, http)
