"""The output side: token ids to whole-character deltas, stop strings held back and cut, and a stop
string cancelling its sequence in the engine."""

from __future__ import annotations

import pytest

from rtserver.config import EngineSettings
from rtserver.engine.backend import FinishReason, SamplingParams
from rtserver.engine.core import Engine
from rtserver.engine.detokenizer import Detokenizer

TEXT = "你好，世界！🎉😀 café ≠ naïve 🇫🇷"


def feed(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.update(t, last=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_split_characters_arrive_whole_and_add_up_to_the_text(smol):
    tok = smol.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the ids really split characters
    deltas = feed(Detokenizer(tok, [], set()), ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # a half character was held back


def test_a_stop_string_is_held_back_then_cut_with_everything_after_it(smol):
    tok = smol.tokenizer
    ids = tok.encode("one two three four five", add_special_tokens=False)
    detok = Detokenizer(tok, ["three f"], set())
    deltas = [detok.update(t) for t in ids]
    assert "".join(deltas) == "one two " and detok.text == "one two "
    assert detok.stopped and not any("three" in d for d in deltas)
    assert detok.stop_tokens < len(ids)  # the ids after the one that completed it are not the output
    assert tok.decode(ids[: detok.stop_tokens]).startswith("one two three f")
    assert detok.update(ids[-1]) == ""  # anything sampled after the stop shows nothing


def test_a_prefix_of_a_stop_string_shows_once_it_cannot_grow_into_one(smol):
    tok = smol.tokenizer
    ids = tok.encode("a b c d", add_special_tokens=False)
    detok = Detokenizer(tok, [" c x"], set())
    shown = "".join(detok.update(t) for t in ids[:-1])
    assert not shown.endswith(" c")  # " c" could still become " c x"
    assert shown + detok.update(ids[-1], last=True) == "a b c d" and not detok.stopped


def test_eos_ends_the_text_without_its_own_and_flushes(smol):
    tok = smol.tokenizer
    eos = tok.eos_token_id
    ids = tok.encode("Bye 🎉", add_special_tokens=False)
    detok = Detokenizer(tok, [], {eos})
    text = "".join(detok.update(t) for t in ids) + detok.update(eos)
    assert text == detok.text == "Bye 🎉"
    assert detok.token_ids[-1] == eos


async def test_a_stop_string_cancels_the_sequence_and_its_result_ends_there(smol):
    eng = Engine(smol, EngineSettings(prefill_chunk_tokens=32, kv_budget_mb=64))
    eng.start()
    try:
        prompt = smol.tokenizer.encode("Count: 1 2 3", add_special_tokens=False)
        free = await eng.generate(prompt, SamplingParams(max_new_tokens=48, min_new_tokens=48)).result()
        assert free.finish_reason is FinishReason.LENGTH and len(free.text) > 8
        stop = free.text[4:7]  # a piece of what greedy decoding writes: it must stop there
        stream = eng.generate(prompt, SamplingParams(max_new_tokens=48, min_new_tokens=48, stop=[stop]))
        deltas = [event.text async for event in stream]
        result = await stream.result()
        assert result.finish_reason is FinishReason.STOP_STRING
        assert result.text == "".join(deltas) == free.text[: free.text.index(stop)]
        assert result.token_ids == free.token_ids[: len(result.token_ids)] and len(result.token_ids) < 48
        assert result.usage.generated_tokens == len(result.token_ids)
        assert eng.scheduler.running == [] and not eng.scheduler.waiting  # cancelled, not left decoding
    finally:
        await eng.stop()


@pytest.mark.parametrize("stop", [["\n"], ["never written", "x" * 256]])
def test_stop_strings_of_the_bounded_sizes_work_alone_or_together(smol, stop):
    tok = smol.tokenizer
    ids = tok.encode("first line\nsecond line", add_special_tokens=False)
    detok = Detokenizer(tok, stop, set())
    text = "".join(feed(detok, ids))
    assert text == ("first line" if stop == ["\n"] else "first line\nsecond line")


class BrokenDecode:
    def decode(self, ids, skip_special_tokens=True):
        raise UnicodeError("a broken vocabulary entry")


async def test_a_sequence_whose_detokenizing_raises_ends_alone(smol):
    eng = Engine(smol, EngineSettings(prefill_chunk_tokens=32, kv_budget_mb=64))
    eng.start()
    try:
        prompt = smol.tokenizer.encode("Count: 1 2 3", add_special_tokens=False)
        params = SamplingParams(max_new_tokens=16, min_new_tokens=16)
        broken, fine = eng.generate(prompt, params), eng.generate(prompt, params)
        broken.detokenizer.tokenizer = BrokenDecode()
        bad, good = await broken.result(), await fine.result()
        assert bad.finish_reason is FinishReason.ERROR and "detokenizing (UnicodeError)" in (bad.error or "")
        assert good.finish_reason is FinishReason.LENGTH and len(good.token_ids) == 16 and good.text
        assert eng.scheduler.running == []
    finally:
        await eng.stop()
