"""Property-based fuzzing (hypothesis) of the HTTP API on one real server (tests/fuzzutil.py):
requests with random bodies (mutated valid bodies, any JSON, binary, invalid UTF-8, UTF-16, deep nesting,
odd numbers), content types, methods and Authorization headers to every route of `http_api.ROUTES` and
the open routes; bodies over the transport limit, with a length and chunked.

Checked: every response is < 500, has no internals in its body, is strict JSON (error bodies with a
documented code and exactly `code`, `message`, `type`, `param`; SSE chunks without errors); a body not
declared as JSON on a POST route gets 415 `unsupported_media_type`, one that is not a JSON object the
400 `bad_json` (or 413) the documentation promises; a wrong or missing token gets 401 `unauthorized`
while the open routes stay open; the server logs no error; and afterwards a normal chat works.
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

from .. import fuzzutil
from ..fuzzutil import (
    API_TOKEN,
    MAX_DEPTH,
    OPTION_KEYS,
    TASK_NAMES,
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
    ctype = draw(st.one_of(st.sampled_from(CONTENT_TYPES), header_text))
    # the client declares JSON unless told otherwise: an empty value stands for no Content-Type
    headers = {"content-type": ctype.encode("latin-1")} if ctype is not None else {}
    return method, path, body, headers


def request(client: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """Send; an input a conforming HTTP client refuses to put on the wire (h11: e.g. a header value with
    trailing whitespace) is not an input: hypothesis drops it."""
    try:
        return client.request(method, url, **kwargs)
    except httpx.LocalProtocolError:
        reject()


def expected_http(method: str, path: str, body: bytes, headers: dict) -> int | None:
    """The status the documentation promises on a POST route for a body not declared as JSON (415) or
    that is not a JSON object."""
    posts = {p for p, m in API_ROUTES if "POST" in m and "{name}" not in p}
    simple_task = re.fullmatch(r"/v1/tasks/[A-Za-z0-9_-]+", path)
    if method != "POST" or not (path in posts or simple_task):
        return None
    ctype = headers.get("content-type", b"application/json").decode("latin-1")
    if ctype.partition(";")[0].strip().lower() != "application/json":
        return 415
    if len(body) > fuzzutil.HTTP_MAX:
        return 413
    try:
        obj = ref_loads(body.decode(json.detect_encoding(body)))
    except (BadJSON, UnicodeDecodeError):
        return 400
    return None if isinstance(obj, dict) else 400


@fuzz(550)
@given(req=http_request())
def test_http_api_random_requests(server, http, req):
    method, path, body, headers = req
    r = request(http, method, path, content=body, headers=headers)
    check_response(r, (method, path, body[:300], headers))
    status = expected_http(method, path, body, headers)
    if status is not None:
        assert r.status_code == status, (method, path, body[:300], r.status_code, r.text[:500])
        if status in (400, 415):
            code = "bad_json" if status == 400 else "unsupported_media_type"
            assert r.json()["error"]["code"] == code, r.text[:500]


def test_http_huge_bodies_and_wrong_methods(server, http):
    for path, methods in API_ROUTES:
        url = _fill(path, "sentiment")
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
            r = http.request(method, url, content=b"{}")
            check_response(r, (method, url))
            if method not in methods:  # 404 where the static files' mount at / answers the method
                assert r.status_code in (404, 405), (method, url, r.status_code)
        if "POST" in methods:  # over the limit, with a Content-Length and chunked (no length given)
            over = fuzzutil.HTTP_MAX + 1
            for body in (b'{"text":"' + b"x" * over + b'"}', iter([b" " * 65536] * (over // 65536 + 1))):
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


# -- every number of every route at its extremes; huge and deep bodies on every route ------------

HISTORY = [{"role": "user", "content": "hi"}]
# route -> (a valid body, where its numbers go: the body itself or its "options", the numeric fields)
NUMERIC = {
    "/v1/completions": (
        {"prompt": [1, 2, 3], "max_tokens": 2},
        None,
        [
            "max_tokens",
            "min_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "repeat_penalty",
            "seed",
            "logprobs",
            "n",
        ],
    ),
    "/v1/chat/completions": (
        {"model": "x", "messages": HISTORY, "max_tokens": 2},
        None,
        [
            "max_tokens",
            "max_completion_tokens",
            "min_tokens",
            "temperature",
            "top_p",
            "top_k",
            "repetition_penalty",
            "seed",
            "n",
            "top_logprobs",
            "presence_penalty",
            "frequency_penalty",
        ],
    ),
    "/chat": ({"history": HISTORY}, "options", OPTION_KEYS[:7]),
    "/v1/tasks/chat": ({"input": {"history": HISTORY}}, "options", OPTION_KEYS[:7]),
    "/v1/tasks/sentiment": ({"input": {"text": "good"}}, "options", ["temperature", "seed"]),
}
# (value, always refused): out of every range, or not a number at all
EXTREMES = [
    (2**64, True),
    (-(2**70), True),
    (10**300, True),
    (1e308, True),
    (-1e308, True),
    ("7", True),
    (True, True),
    ([1], True),
    ({"x": 1}, True),
    (-1, False),
    (0, False),
    (0.0, False),
    (-0.0, False),
    (1.5, False),
    (0.5, False),
    (2**63, False),
    (2**63 - 1, False),
    (1e-300, False),
    (False, False),
]


def _error(r: httpx.Response) -> dict:
    assert r.headers.get("content-type", "").startswith("application/json"), r.text[:300]
    return r.json()["error"]


def test_numeric_extremes_on_every_field_of_every_route(server, http):
    """Each numeric field of each route at 2**64, -1, 1e308, huge negatives, floats where integers go,
    strings, booleans...: a 200, or a 4xx naming that field; a value out of every range is a 4xx."""
    for path, (base, where, fields) in NUMERIC.items():
        for field in fields:
            for value, bad in EXTREMES:
                body = json.loads(json.dumps(base))
                (body.setdefault("options", {}) if where else body)[field] = value
                r = http.post(path, json=body)
                what = (path, field, value, r.status_code, r.text[:300])
                check_response(r, what)
                if bad or r.status_code != 200:
                    assert 400 <= r.status_code < 500, what
                    err = _error(r)
                    assert err["param"] == field and field in err["message"], what
    for body, param in [
        ({"prompt": [2**64]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": [1e308]}, "prompt"),
        ({"prompt": [1], "score_candidates": [[2**64]]}, "score_candidates"),
        ({"prompt": [1], "score_candidates": [[-1]]}, "score_candidates"),
        ({"prompt": [1], "score_candidates": [[1]] * 33}, "score_candidates"),
        ({"prompt": [1], "score_candidates": [[1] * 65]}, "score_candidates"),
        ({"prompt": [1], "score_candidates": [[1] * 64] * 17}, "score_candidates"),
        ({"prompt": [1], "score_candidates": [[1]], "seed": 2**64}, "seed"),
        ({"prompt": [1], "stop": ["x"] * 17}, "stop"),
        ({"prompt": [1], "stop": ["x" * 257]}, "stop"),
        ({"prompt": [1], "stop": [""]}, "stop"),
        ({"prompt": [1], "stream": "yes"}, "stream"),
        ({"prompt": [1], "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": [1], "max_tokens": 2049}, "max_tokens"),  # security.api_max_tokens
        ({"prompt": [1], "max_tokens": 8, "min_tokens": 9}, "min_tokens"),
        ({"prompt": [1] * 2047, "max_tokens": 2}, "prompt"),  # engine.max_sequence_tokens
        ({"prompt": [1] * 2048, "score_candidates": [[1]]}, "prompt"),
    ]:
        r = http.post("/v1/completions", json=body)
        check_response(r, body)
        assert 400 <= r.status_code < 500 and _error(r)["param"] == param, (body, r.text[:300])
    for body, param in [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream": 1}, "stream"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"logprobs": 1}, "logprobs"),
        ({"user": "x" * 257}, "user"),
        ({"messages": [{"role": "user", "content": "x"}] * 257}, "messages"),
    ]:
        r = http.post("/v1/chat/completions", json={**NUMERIC["/v1/chat/completions"][0], **body})
        check_response(r, body)
        assert 400 <= r.status_code < 500 and _error(r)["param"] == param, (body, r.text[:300])


def test_api_max_tokens_caps_both_openai_routes(server, http):
    """`security.api_max_tokens`: more is a 400 naming the field; up to it is served."""
    security = server.state.settings.security
    security.api_max_tokens = 8
    try:
        chat = {"model": "x", "messages": HISTORY}
        for path, base, key in [
            ("/v1/completions", {"prompt": [1]}, "max_tokens"),
            ("/v1/chat/completions", chat, "max_tokens"),
            ("/v1/chat/completions", chat, "max_completion_tokens"),
        ]:
            r = http.post(path, json={**base, key: 9})
            check_response(r, (path, key))
            assert r.status_code == 400 and _error(r)["param"] == key, r.text[:300]
            assert "1..8" in _error(r)["message"], r.text[:300]
            r = http.post(path, json={**base, key: 8})
            assert r.status_code == 200, r.text[:300]
    finally:
        security.api_max_tokens = 2048


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_huge_and_deep_bodies_on_every_route(server, http):
    """Every POST route: nesting over the limit in each field is `bad_json`; a body near the size
    limit filled with small numbers, tiny arrays, messages or one long string gets a 4xx naming the
    field (or a 200 where the route cuts it), never a 5xx, and the server stays fast enough to answer."""
    limit = fuzzutil.HTTP_MAX
    for path, methods in API_ROUTES:
        if "POST" not in methods:
            continue
        url = _fill(path, "chat" if path == "/v1/tasks/{name}" else "sentiment")
        base = BODIES.get(path, {"prompt": [1, 2, 3]} if path == "/v1/completions" else {"content": "x"})
        for field in [*base, "options", "extra"]:
            for depth in (MAX_DEPTH + 1, 1000, 5000):
                text = json.dumps({**base, field: "<deep>"}).replace('"<deep>"', _deep(depth))
                r = http.post(url, content=text.encode())
                check_response(r, (url, field, depth))
                assert r.status_code == 400 and _error(r)["code"] == "bad_json", (url, field, r.text[:300])
        fillers = {
            "numbers": [1] * (limit // 2 - 500),
            "arrays": [[]] * (limit // 3 - 500),
            "string": "x" * (limit - 1000),
        }
        for field in base:
            for kind, filler in fillers.items():
                body = json.dumps({**base, field: filler}, separators=(",", ":")).encode()
                assert len(body) <= limit, (url, field, kind, len(body))
                r = http.post(url, content=body)
                what = (url, field, kind, r.status_code, r.text[:300])
                check_response(r, what)
                assert r.status_code == 200 or 400 <= r.status_code < 500, what
        r = http.post(url, content=b'{"x":"' + b"y" * limit + b'"}')
        check_response(r, url)
        assert r.status_code == 413 and _error(r)["code"] == "body_too_large", (url, r.text[:300])
    for url, body, param in [
        ("/v1/completions", {"prompt": [1] * (limit // 3)}, "prompt"),
        ("/v1/completions", {"prompt": "x" * (limit - 100)}, "prompt"),
        ("/v1/completions", {"prompt": [1], "score_candidates": [[1]] * (limit // 6)}, "score_candidates"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 6000}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 70000}]}, "messages"),
        ("/chat", {"history": [{"role": "user", "content": "x"}] * 6000}, "history"),
        ("/chat", {"history": [{"role": "user", "content": "x" * 70000}]}, "history"),
        ("/v1/tasks/chat", {"input": {"history": [{"role": "user", "content": "x" * 70000}]}}, "history"),
        ("/v1/tasks/sentiment", {"input": {"text": [1] * 1000}}, "input"),
        ("/sentiment", {"text": [1] * 1000}, "text"),
        ("/tokenize", {"content": "x" * 70000}, "content"),
        ("/tokenize", {"content": [1] * 1000}, "content"),
    ]:
        r = http.post(url, json=body)
        check_response(r, (url, param))
        assert 400 <= r.status_code < 500 and _error(r)["param"] == param, (url, param, r.text[:300])


# -- afterwards: the server is fine ---------------------------------------------------------------


def test_zz_normal_chat_afterwards(server, http):
    """Runs last in this module: a normal chat works, and the server logged no error since it started."""
    fuzzutil.server_fine_afterwards(server, http)
