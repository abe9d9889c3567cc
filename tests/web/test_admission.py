"""The admission path with a fake clock: client keys, surface credentials, sockets, token budgets."""

from __future__ import annotations

import pytest

from rtserver.config import Settings
from rtserver.web.admission import (
    Admission,
    Refused,
    SocketCount,
    Surface,
    TokenBudget,
    TokenRate,
    client_key,
)
from rtserver.web.state import AppState


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_ipv6_client_is_its_64_and_ipv4_is_itself():
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:10.0.0.7") == client_key("10.0.0.7") == "10.0.0.7"
    assert client_key("10.0.0.8") != client_key("10.0.0.7")
    assert client_key(client_key("2001:db8::1")) == client_key("2001:db8::1")  # a key stays itself


def admission(**security) -> Admission:
    settings = Settings()
    for key, value in security.items():
        setattr(settings.security, key, value)
    return Admission(AppState(settings))


def refusal(fn, *args) -> Refused:
    with pytest.raises(Refused) as info:
        fn(*args)
    return info.value


def test_each_surface_has_its_own_credential():
    adm = admission(ws_token="w", api_token="a", ops_token="o", api_enabled=True)
    adm.authorize(Surface.PUBLIC, "w", "203.0.113.5")
    assert refusal(adm.authorize, Surface.PUBLIC, "a", "203.0.113.5").code == "unauthorized"
    adm.authorize(Surface.API, "a", "203.0.113.5")
    assert refusal(adm.authorize, Surface.API, "w", "203.0.113.5").status == 401
    assert refusal(adm.authorize, Surface.OPS, "a", "127.0.0.1").status == 401
    adm.authorize(Surface.OPS, "o", "203.0.113.5")


def test_without_their_tokens_the_api_and_operations_answer_loopback_only():
    assert refusal(admission().authorize, Surface.API, "", "127.0.0.1").code == "api_disabled"  # default
    adm = admission(api_enabled=True)
    adm.authorize(Surface.PUBLIC, "", "203.0.113.5")  # the widget's door is public
    for surface in (Surface.API, Surface.OPS):
        adm.authorize(surface, "", "127.0.0.1")
        adm.authorize(surface, "", "::1")
        refused = refusal(adm.authorize, surface, "", "203.0.113.5")
        assert refused.status == 403 and refused.code == "forbidden", refused.message
    off = admission(api_enabled=False, api_token="a")
    refused = refusal(off.authorize, Surface.API, "a", "127.0.0.1")
    assert (refused.status, refused.code) == (404, "api_disabled")


def test_sockets_counted_per_client_and_given_back():
    count = SocketCount(2)
    count.open("2001:db8::1")
    count.open("2001:db8::2")  # the same /64
    assert refusal(count.open, "2001:db8::3").code == "too_many_connections"
    count.open("2001:db8:0:1::1")  # another /64
    count.close("2001:db8::2")
    count.open("2001:db8::3")
    assert count.open_by_client == {"2001:db8::/64": 2, "2001:db8:0:1::/64": 1}


def test_tokens_in_flight_per_client_and_per_surface():
    clock = Clock()
    total = [1000]
    budget = TokenBudget(Surface.API, 600, TokenRate(0.0, 1, clock), lambda: total[0])
    a = budget.reserve("10.0.0.1", 500)
    refused = refusal(budget.reserve, "10.0.0.1", 200)
    assert refused.code == "over_budget" and "holds 500 of the 600" in refused.message
    b = budget.reserve("10.0.0.2", 450)
    assert "holds 950 of its 1000" in refusal(budget.reserve, "10.0.0.3", 100).message
    a.release(10)
    a.release(10)  # twice gives back once
    assert budget.held == 450 and budget.held_by_client == {"10.0.0.2": 450}
    b.release()
    assert budget.held == 0 and budget.held_by_client == {}
    too_big = refusal(budget.reserve, "10.0.0.4", 601)  # over what one client may ever hold
    assert (too_big.code, too_big.status) == ("request_too_large", 413), too_big.message


def test_the_token_rate_charges_what_was_used():
    clock = Clock()
    budget = TokenBudget(Surface.PUBLIC, 0, TokenRate(100.0, 1000, clock), lambda: 0)
    budget.reserve("10.0.0.1", 5000).release(1200)  # a reservation may overdraw once
    refused = refusal(budget.reserve, "10.0.0.1", 10)
    assert refused.code == "rate_limited" and refused.retry_after_s == pytest.approx(2.01)
    budget.reserve("10.0.0.2", 10).release()  # other clients are not charged
    clock.now += 2.01
    budget.reserve("10.0.0.1", 10).release(0)
