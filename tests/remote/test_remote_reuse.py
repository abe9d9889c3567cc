"""What each kind of inference server may reuse of its prefix cache (rtserver/remote/reuse.py)."""

from __future__ import annotations

import asyncio

import pytest

from rtserver.remote.pool import BackendUnavailable
from rtserver.remote.reuse import BlindReuse, NodeReuse, SaltedReuse, SlotLedger, Unlearned, reuse_for

PROMPT = list(range(100, 140))
REPLY = list(range(500, 520))


def lease(reuse, session, public: int = 10, timeout_s: float = 1.0):
    return asyncio.run(reuse.lease(session, public, timeout_s))


def turn(ledger: SlotLedger, session: str, prompt: list[int], reply: list[int] = REPLY) -> dict:
    lease = asyncio.run(ledger.lease(session, 10, 1.0))
    fields = lease.fields(prompt)
    lease.wrote(prompt, reply)
    lease.release()
    return fields


def test_a_session_reuses_its_own_slot_and_no_one_elses():
    ledger = SlotLedger(2)
    assert turn(ledger, "a", PROMPT) == {"id_slot": 0, "cache_prompt": False}
    assert turn(ledger, "a", PROMPT + REPLY + [7, 8]) == {"id_slot": 0, "cache_prompt": True}
    assert turn(ledger, "b", PROMPT) == {"id_slot": 1, "cache_prompt": False}  # the free slot first
    assert turn(ledger, "c", PROMPT) == {"id_slot": 0, "cache_prompt": False}  # then the oldest
    assert turn(ledger, "a", PROMPT + REPLY) == {"id_slot": 1, "cache_prompt": False}  # a's is c's now


def test_no_reuse_where_llama_server_would_restore_another_prompt_from_its_host_cache():
    ledger = SlotLedger(1)
    turn(ledger, "a", PROMPT)
    # the history slid: under half the slot's tokens are kept, so the server looks in its host cache
    assert turn(ledger, "a", PROMPT[:20] + [9] * 40) == {"id_slot": 0, "cache_prompt": False}


def test_a_request_that_failed_on_the_way_leaves_its_slot_to_no_one():
    ledger = SlotLedger(1)
    turn(ledger, "a", PROMPT)
    got = lease(ledger, "a")
    assert got.fields(PROMPT + REPLY) == {"id_slot": 0, "cache_prompt": True}
    got.release()  # never answered: the slot may hold part of anything
    assert turn(ledger, "a", PROMPT + REPLY) == {"id_slot": 0, "cache_prompt": False}


async def test_a_request_waits_for_a_free_slot_rather_than_going_without_one():
    ledger = SlotLedger(1)
    held = await ledger.lease("a", 10, 1.0)
    with pytest.raises(BackendUnavailable, match="all 1 llama-server slots stayed busy"):
        await ledger.lease("b", 10, 0.05)
    waiting = asyncio.ensure_future(ledger.lease("b", 10, 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    held.wrote(PROMPT, REPLY)
    held.release()
    got = await asyncio.wait_for(waiting, 1.0)
    assert got.fields(PROMPT + REPLY) == {"id_slot": 0, "cache_prompt": False}  # a's tokens are there
    got.release()


def test_requests_without_a_session_share_nothing_with_each_other():
    ledger = SlotLedger(1)
    turn(ledger, None, PROMPT)  # type: ignore[arg-type]
    assert turn(ledger, None, PROMPT) == {"id_slot": 0, "cache_prompt": False}  # type: ignore[arg-type]


def test_a_scoring_call_reuses_its_own_prompt_between_its_requests():
    ledger = SlotLedger(1)
    call = lease(ledger, None)
    assert call.fields(PROMPT)["cache_prompt"] is False
    call.wrote(PROMPT, [])
    assert call.fields(PROMPT)["cache_prompt"] is True
    call.release()


def test_own_lease_only_on_the_sessions_idle_slot():
    ledger = SlotLedger(2)
    assert ledger.own_lease("a") is None
    turn(ledger, "a", PROMPT)
    own = ledger.own_lease("a")
    assert own is not None and own.fields(PROMPT + REPLY) == {"id_slot": 0, "cache_prompt": True}
    assert ledger.own_lease("a") is None  # busy
    own.release()


def test_vllm_salts_per_session_and_not_a_public_prompt():
    reuse = SaltedReuse()
    a, a_again, b = (lease(reuse, k).fields(PROMPT)["cache_salt"] for k in ("a", "a", "b"))
    assert a == a_again != b
    assert lease(reuse, "a", len(PROMPT)).fields(PROMPT) == {}
    assert lease(reuse, None).fields(PROMPT) != lease(reuse, None).fields(PROMPT)
    assert lease(SaltedReuse(), "a").fields(PROMPT) != lease(reuse, "a").fields(PROMPT)


def test_other_kinds():
    node = lease(NodeReuse(), "s1", 12)
    assert node.fields(PROMPT) == {
        "cache_prompt": True,
        "rtserver_public_tokens": 12,
        "rtserver_session": "s1",
    }
    blind = lease(BlindReuse(), "s1", 12)
    assert blind.cached(30) == 12 and blind.cached(5) == 5
    assert lease(Unlearned(), "s1", 12).fields(PROMPT) == {"cache_prompt": False}
    assert isinstance(reuse_for("llama.cpp", None), Unlearned)
    assert isinstance(reuse_for("llama.cpp", 4), SlotLedger)


def test_an_ended_sessions_slot_goes_to_the_next_new_session_first():
    ledger = SlotLedger(2)
    turn(ledger, "a", PROMPT)
    turn(ledger, "b", PROMPT)
    ledger.forget("b")
    assert turn(ledger, "c", PROMPT)["id_slot"] == 1
    assert turn(ledger, "a", PROMPT + REPLY) == {"id_slot": 0, "cache_prompt": True}


def test_a_slot_cut_back_to_its_public_prefix_is_reused_by_anyone():
    ledger = SlotLedger(1)
    call = lease(ledger, None)
    assert call.public_fields() is None  # nothing written yet: nothing to cut back
    call.wrote(PROMPT, [])
    assert call.public_fields() == {"id_slot": 0, "cache_prompt": True}
    call.wrote_public(PROMPT[:30])
    call.release()
    nxt = lease(ledger, None)
    assert nxt.fields(PROMPT[:30] + [1, 2, 3]) == {"id_slot": 0, "cache_prompt": True}
    nxt.wrote(PROMPT[:30] + [1, 2, 3], [])
    nxt.release()
    assert turn(ledger, "b", PROMPT[:30] + [1, 2, 3]) == {
        "id_slot": 0,
        "cache_prompt": False,
    }  # private again


def test_a_cut_that_was_not_answered_leaves_the_slot_to_no_one():
    ledger = SlotLedger(1)
    call = lease(ledger, None)
    call.wrote(PROMPT, [])
    assert call.public_fields() is not None
    call.release()
    assert turn(ledger, None, PROMPT) == {"id_slot": 0, "cache_prompt": False}  # type: ignore[arg-type]
