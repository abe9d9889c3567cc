"""Sessions: unguessable ids/tokens, resume, expiry, and the chunked history window."""

from __future__ import annotations

import pytest

from rtserver.tasks.chat import LastTurn, encode_chat, finished_turn, window
from rtserver.web.session import SessionExpired, SessionRegistry, SessionsFull, TooManySessions
from rtserver.web.session_events import SessionEvents, Token, TurnFinished


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def turns(n: int) -> list[dict]:
    out = []
    for i in range(n):
        out += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return out


def test_ids_and_tokens_are_unique_and_long():
    reg = SessionRegistry(60, 1000)
    sessions = [reg.create() for _ in range(200)]
    assert len({s.id for s in sessions}) == 200 and len({s.resume_token for s in sessions}) == 200
    assert all(len(s.id) >= 24 and len(s.resume_token) >= 43 for s in sessions)


def test_resume_needs_the_sessions_own_token():
    reg = SessionRegistry(60, 1000)
    a, b = reg.create(), reg.create()
    assert reg.resume(a.id, a.resume_token) is a
    with pytest.raises(SessionExpired):
        reg.resume(a.id, b.resume_token)
    with pytest.raises(SessionExpired):
        reg.resume("nope", a.resume_token)
    with pytest.raises(SessionExpired):
        reg.resume(a.id, "")


def test_detached_sessions_expire_and_are_dropped():
    clock = Clock()
    dropped = []
    reg = SessionRegistry(10, 1000, on_drop=lambda s: dropped.append(s.id), clock=clock)
    attached, detached = reg.create(), reg.create()
    attached.connection = object()
    conn = object()
    detached.connection = conn
    reg.detach(detached, conn)
    clock.t += 9
    assert reg.sweep() == 0
    clock.t += 2
    assert reg.sweep() == 1 and dropped == [detached.id]
    with pytest.raises(SessionExpired):
        reg.resume(detached.id, detached.resume_token)
    assert attached.id in reg.sessions  # an attached session never idles out


def test_expired_on_resume_even_before_the_sweep():
    clock = Clock()
    reg = SessionRegistry(10, 1000, clock=clock)
    s = reg.create()
    clock.t += 11
    with pytest.raises(SessionExpired):
        reg.resume(s.id, s.resume_token)
    assert s.id not in reg.sessions


def test_max_sessions_sheds_the_newest_empty_detached_never_a_conversation():
    clock = Clock()
    reg = SessionRegistry(600, 3, clock=clock)
    chatted, early = reg.create(), reg.create()
    chatted.history = turns(1)
    clock.t += 1
    late = reg.create()
    fresh = reg.create()  # full: the newest empty one makes room
    assert late.id not in reg.sessions and {chatted.id, early.id, fresh.id} == set(reg.sessions)
    early.history, fresh.history = turns(1), turns(1)
    with pytest.raises(SessionsFull) as info:  # only conversations left: refused, none dropped
        reg.create()
    assert {chatted.id, early.id, fresh.id} == set(reg.sessions)
    assert info.value.code == "sessions_full" and info.value.retry_after_s == 599
    clock.t += 600  # the first conversation's time is up: it expires, the newcomer gets its place
    assert reg.create().id in reg.sessions and chatted.id not in reg.sessions


def count(history):
    return 10 + sum(len(m["content"]) for m in history)


def test_sessions_per_ip_cap_counts_held_sessions_connected_or_not():
    dropped = []
    reg = SessionRegistry(60, 100, on_drop=dropped.append, clock=Clock(), max_per_ip=2)
    a, b = reg.create("10.0.0.1"), reg.create("10.0.0.1")
    a.connection = b.connection = object()
    with pytest.raises(TooManySessions):
        reg.create("10.0.0.1")
    other = reg.create("10.0.0.2")  # the cap is per address
    reg.detach(a, a.connection)
    c = reg.create("10.0.0.1")  # the IP's detached empty session makes room
    assert dropped == [a] and set(reg.sessions) == {b.id, c.id, other.id}
    c.history = turns(1)
    reg.detach(c, c.connection)
    with pytest.raises(TooManySessions) as info:  # detached with a conversation: still held
        reg.create("10.0.0.1")
    assert info.value.retry_after_s == 60 and c.id in reg.sessions
    reg.drop(b)
    assert reg.per_ip == {"10.0.0.1": 1, "10.0.0.2": 1}


def test_resume_rotates_the_token():
    reg = SessionRegistry(60, 10)
    s = reg.create()
    first = s.resume_token
    assert reg.resume(s.id, first) is s and s.resume_token != first
    with pytest.raises(SessionExpired):
        reg.resume(s.id, first)
    assert reg.resume(s.id, s.resume_token) is s


def test_window_keeps_everything_under_the_limits():
    h = turns(3) + [{"role": "user", "content": "new"}]
    assert window(h, 10, 1000, count) == (h, False)


def test_window_cuts_to_half_the_turns_in_one_chunk():
    h = turns(10) + [{"role": "user", "content": "new"}]  # 11 user turns > 10
    out, cut = window(h, 10, 0, count)
    assert cut and sum(m["role"] == "user" for m in out) == 5
    assert out[0] == {"role": "user", "content": "u6"} and out[-1]["content"] == "new"
    # the next turns keep the same beginning: no cut until the limit is exceeded again
    grown = out + [{"role": "assistant", "content": "r"}]
    for i in range(5):
        grown = grown + [{"role": "user", "content": f"n{i}"}]
        again, cut = window(grown, 10, 0, count)
        assert not cut and again[0] == out[0]
        grown = again + [{"role": "assistant", "content": "r"}]


def test_window_cuts_to_half_the_tokens():
    h = turns(20) + [{"role": "user", "content": "new"}]
    out, cut = window(h, 100, 60, count)
    assert cut and count(out) <= 30 and out[-1]["content"] == "new"


def test_window_always_keeps_the_new_message():
    h = [{"role": "user", "content": "x" * 500}]
    out, cut = window(h, 10, 50, count)
    assert out == h and cut


def test_next_prompt_keeps_the_generated_tokens_even_when_retokenizing_differs(smol):
    tok = smol.tokenizer
    history = [{"role": "user", "content": "Say hello."}]
    first = encode_chat(tok, history)
    assert first.ids == tok.apply_chat_template(
        history, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    # the model spelled "Hello there" with other tokens than the tokenizer would, then ended its turn
    generated = [tok.convert_tokens_to_ids(t) for t in ("H", "ello", "Ġthere")] + [tok.eos_token_id]
    assert tok.decode(generated[:-1]) == "Hello there"
    assert generated[:-1] != tok.encode("Hello there", add_special_tokens=False)
    last = finished_turn(tok, first.rendered, first.ids, "Hello there", generated)
    history += [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Again."}]
    second = encode_chat(tok, history, last)
    assert second.ids[: len(first.ids) + 3] == first.ids + generated[:3]  # the session's KV covers these
    assert tok.decode(second.ids) == second.rendered
    assert second.rendered == tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    # a different history (here: a cut window) is tokenized afresh
    cut = encode_chat(tok, history[2:], last)
    assert cut.ids == tok.apply_chat_template(
        history[2:], tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_finished_turn_needs_ids_that_spell_the_reply(smol):
    tok = smol.tokenizer
    ids = tok.encode(" Hi. STOP", add_special_tokens=False)
    assert finished_turn(tok, "p", [1], " Hi.", ids) is None  # a stop string cut the reply text
    assert finished_turn(tok, "p", [1], " Hi. STOP", ids) == LastTurn("p Hi. STOP", [1] + ids)


def _open_turn(session, request_id: str, text: str, now: float = 0.0):
    turn = session.turn(request_id, lambda: now)
    turn.add_message([*session.history, {"role": "user", "content": text}], cut=False)
    return turn


def test_a_committed_turn_keeps_its_message_and_reply():
    session = SessionRegistry(60, 10).create()
    last = LastTurn("x", [1, 2, 3])
    with _open_turn(session, "r1", "hi", now=5.0) as turn:
        assert session.chat_request == "r1"
        turn.add_reply("hello", last)
        turn.commit()
    assert session.history == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert (session.turns, session.last_turn, session.chat_request, session.last_active) == (
        1,
        last,
        None,
        5.0,
    )


def test_a_turn_not_committed_leaves_no_trace_but_what_came_meanwhile():
    session = SessionRegistry(60, 10).create()
    with _open_turn(session, "r0", "first", now=1.0) as turn:
        turn.add_reply("one", None)
        turn.commit()
    before = (list(session.history), session.turns)
    with _open_turn(session, "r1", "second", now=2.0) as turn:
        session.add_agent_reply("an agent said this meanwhile", "Ann")  # after the message, before the reply
        turn.add_reply("two", LastTurn("y", [9]))
        assert session.history[-2]["content"] == "two" and session.last_turn is None  # not the history's end
        # the store failed: never committed
    assert session.history == [
        *before[0],
        {"role": "assistant", "content": "an agent said this meanwhile", "agent": "Ann"},
    ]
    assert (session.turns, session.chat_request, session.last_active) == (before[1], None, 2.0)


def test_a_failed_turn_leaves_no_trace():
    session = SessionRegistry(60, 10).create()
    with pytest.raises(RuntimeError), _open_turn(session, "r1", "hi"):
        raise RuntimeError("the generation failed")
    assert (session.history, session.turns, session.chat_request) == ([], 0, None)


def test_a_reset_or_forward_that_is_not_stored_is_restored():
    session = SessionRegistry(60, 10).create()
    session.history = turns(2)
    kept = session.clear()
    assert session.history == [] and session.turns == 0
    session.restore(kept)
    assert session.history == turns(2)
    kept = session.forward([{"role": "user", "content": "to the agent"}], cut=True)
    assert session.cuts == 1 and session.history[-1]["content"] == "to the agent"
    session.restore(kept)
    assert (session.history, session.cuts) == (turns(2), 0)


def test_session_events_reach_every_subscriber_even_after_one_fails():
    session = SessionRegistry(60, 10).create()
    seen: list = []

    def broken(event):
        raise RuntimeError("a console bug")

    feed = SessionEvents()
    feed.subscribe(broken)
    feed.subscribe(seen.append)
    feed.publish(Token(session, "r1", "hel"))
    feed.publish(TurnFinished(session, "r1", "hello", "stop"))
    assert seen == [Token(session, "r1", "hel"), TurnFinished(session, "r1", "hello", "stop")]
