"""Knowledge without a model: articles and headers, hostile folders, the FTS5 index and its queries, the
labeled question sets, the citation grammars and their parse."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from llguidance import LLMatcher

from rtserver.config import KnowledgeSettings
from rtserver.engine.backend import OutputFormat
from rtserver.tasks import citations
from rtserver.tasks.kb_index import Index, KnowledgeBase, build, index_path, match_query
from rtserver.tasks.knowledge import KnowledgeError, chunks, read_article, safe_url, scan, split_header

DATA = Path(__file__).resolve().parents[1] / "data"
ROOT = Path(__file__).resolve().parents[2]
LIMITS = (20_000, 1 << 20, 256)


def built(folder: Path | str, tmp_path: Path, chunk_chars: int = 700, base_url: str = "") -> Index:
    path = tmp_path / "index.sqlite3"
    build(str(folder), path, chunk_chars, base_url, LIMITS)
    return Index(path)


def top3_rate(index: Index, questions: Path) -> tuple[float, list[str]]:
    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    misses = [
        r["question"]
        for r in rows
        if r["article"] not in [h.article_id for h in index.search(r["question"], 3)]
    ]
    return 1 - len(misses) / len(rows), misses


@pytest.mark.parametrize(
    ("folder", "questions", "at_least"),
    [
        (ROOT / "docs", DATA / "docs_questions.jsonl", 40),
        (DATA / "shop_kb", DATA / "shop_questions.jsonl", 40),
    ],
    ids=["docs", "shop"],
)
def test_the_right_article_is_in_the_top_3_for_90_percent_of_each_labeled_set(
    folder, questions, at_least, tmp_path
):
    assert len(questions.read_text().splitlines()) >= at_least
    rate, misses = top3_rate(built(folder, tmp_path), questions)
    assert rate >= 0.9, misses


def test_the_shop_kb_has_30_articles_each_with_a_title_and_url(tmp_path):
    index = built(DATA / "shop_kb", tmp_path)
    assert index.articles >= 30
    a = index.article("return-policy.md")
    assert a is not None and a.title == "Return policy" and a.url == "https://shop.example/help/return-policy"


def test_headers_titles_and_urls(tmp_path):
    (tmp_path / "kb").mkdir()
    kb = tmp_path / "kb"
    (kb / "a.md").write_text("---\ntitle: Alpha\nurl: javascript:alert(1)\nother: x\n---\nBody of alpha.\n")
    (kb / "b.md").write_text("# Beta heading\n\nBeta text.")
    (kb / "c.html").write_text(
        "<html><head><title>Gamma page</title><script>var secret=1</script></head>"
        "<body><h1>Gamma</h1><p>Visible &amp; clear.</p><style>p{}</style></body></html>"
    )
    (kb / "d.txt").write_text("---\ntitle: never closed\nplain text")
    sigs = {s.path: s for s in scan(kb, *LIMITS)}
    a = read_article(kb, sigs["a.md"], "https://help.example/")
    assert a is not None and (a.title, a.url) == (
        "Alpha",
        "https://help.example/a.md",
    )  # a bad url is dropped
    b = read_article(kb, sigs["b.md"])
    assert b is not None and (b.title, b.url) == ("Beta heading", "")
    c = read_article(kb, sigs["c.html"])
    assert (
        c is not None and c.title == "Gamma page" and "Visible & clear." in c.text and "secret" not in c.text
    )
    d = read_article(kb, sigs["d.txt"])
    assert d is not None and d.title == "d" and d.text.startswith("---")  # an unclosed header is text
    assert split_header("---\ntitle: T\n---") == ({"title": "T"}, "")
    assert safe_url('https://x.example/a"onmouseover=1') == "" and safe_url("http://x.example/a?b=1") != ""


def test_hostile_folders_are_bounded_and_never_escape(tmp_path):
    kb = tmp_path / "kb"
    kb.mkdir()
    outside = tmp_path / "secret.md"
    outside.write_text("TOPSECRET password hunter2")
    (kb / "out.md").symlink_to(outside)  # a link out of the folder
    (kb / "loop.md").symlink_to(kb / "loop.md")  # a link to itself
    (kb / "sub").mkdir()
    (kb / "sub" / "up").symlink_to(tmp_path, target_is_directory=True)  # a folder link out
    (kb / "huge.md").write_bytes(b"a " * (1 << 20))  # over max_article_bytes
    (kb / "binary.txt").write_bytes(os.urandom(2048) + b"\x00" * 64)
    (kb / "badheader.md").write_bytes(b"---\n\xff\xfe title: \x07\n---\nStill text about refunds.")
    (kb / "ok.md").write_text("Refunds take five days.")
    index = built(kb, tmp_path)
    ids = {h.article_id for h in index.search("refunds TOPSECRET hunter2 password", 8)}
    assert ids == {"ok.md", "badheader.md"}
    assert index.search("TOPSECRET", 8) == []
    # too many files, too many bytes: a clear error, not a crash
    many = tmp_path / "many"
    many.mkdir()
    for i in range(3000):
        (many / f"{i}.txt").write_text(f"article {i}")
    with pytest.raises(KnowledgeError, match="max_articles"):
        scan(many, 2000, 1 << 20, 256)
    assert len(scan(many, 3000, 1 << 20, 256)) == 3000
    with pytest.raises(KnowledgeError, match="max_total_mb"):
        scan(kb, 100, 2 << 20, 1)  # huge.md now fits one file's bound, not the total's
    with pytest.raises(KnowledgeError, match="not a folder"):
        scan(tmp_path / "missing", *LIMITS)


HOSTILE = [
    '"',
    '"""',
    "NEAR(refund return, 2)",
    "refund*",
    "*",
    "title:refund",
    "body: returns OR title:x AND NOT y",
    "^refund",
    "refund + return - (shipping)",
    "{title body}: refund",
    "'; DROP TABLE chunks; --",
    "\x00\x01 refund \u202e",
    "a" * 5000,
    " ".join(["refund"] * 500),
    "🙂 retour remboursement",
    "",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_customer_text_is_only_words_to_fts5(text, tmp_path):
    index = built(DATA / "shop_kb", tmp_path)
    hits = index.search(text, 3)  # never raises
    assert len(hits) <= 3
    query = match_query(text)
    assert query.count('"') % 2 == 0
    for term in filter(None, query.split(" OR ")):
        assert term.startswith('"') and term.endswith('"') and '"' not in term[1:-1]


def test_a_column_filter_in_the_text_filters_nothing(tmp_path):
    index = built(DATA / "shop_kb", tmp_path)
    # as FTS5 syntax this would match only titles holding "password"; as words it ranks by both
    assert index.search("title:password", 3)[0].article_id == "reset-password.md"
    assert index.search("NEAR(gift cards)", 1)[0].article_id == "gift-cards.md"


def test_chunks_stay_near_their_size_under_their_heading():
    from rtserver.tasks.knowledge import Article

    text = "# Top\n\nintro\n\n## Part\n\n" + ("word " * 400) + "\n\nlast paragraph"
    pieces = chunks(Article("a.md", "A", "", text), 300)
    assert all(len(c.text) <= 300 for c in pieces)
    assert pieces[0].section == "Top" and pieces[-1].section == "Part" and "last paragraph" in pieces[-1].text


def test_a_rebuild_is_atomic_for_readers_and_writers(tmp_path):
    kb = tmp_path / "kb"
    kb.mkdir()
    for i in range(200):
        (kb / f"{i}.md").write_text(f"# Article {i}\n\nshipping refunds article{i} " * 20)
    path = tmp_path / "index.sqlite3"
    build(str(kb), path, 700, "", LIMITS)
    reader = Index(path)
    errors: list[BaseException] = []

    def rebuild() -> None:
        try:
            build(str(kb), path, 700, "", LIMITS)
        except BaseException as exc:  # reported below
            errors.append(exc)

    builders = [threading.Thread(target=rebuild) for _ in range(3)]
    for t in builders:
        t.start()
    while any(t.is_alive() for t in builders):
        assert len(reader.search("shipping article7", 3)) == 3
        assert len(Index(path).search("refunds", 3)) == 3  # a new reader always opens a whole index
    for t in builders:
        t.join()
    assert not errors
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(sqlite3.OperationalError):
        reader._db.execute("DELETE FROM articles")  # readers are read-only


def test_indexing_1000_articles_takes_at_most_15_s_and_retrieval_p95_at_most_10_ms(tmp_path):
    kb = tmp_path / "kb"
    kb.mkdir()
    # 1,000 articles of the shop's sentences mixed with words of their own, about 1 KB each
    sentences = [
        s for f in (DATA / "shop_kb").glob("*.md") for s in f.read_text().split("---")[-1].split(". ")
    ]
    rng = random.Random(0)
    for i in range(1000):
        own = " ".join(f"w{rng.randrange(20000)}" for _ in range(40))
        body = ". ".join(rng.sample(sentences, 6))
        (kb / f"a{i}.md").write_text(f"---\ntitle: Article {i} {own[:30]}\n---\n{body}\n\n{own} topic{i}")
    start = time.perf_counter()
    index = built(kb, tmp_path)
    took = time.perf_counter() - start
    assert index.articles == 1000 and took <= 15.0
    questions = [json.loads(x)["question"] for x in (DATA / "shop_questions.jsonl").read_text().splitlines()]
    assert retrieval_p95(index, questions) <= 0.010  # the best of 3 rounds: the machine is shared


def retrieval_p95(index: Index, questions: list[str], rounds: int = 3) -> float:
    """The p95 of one search per question, seconds; the least of `rounds` rounds."""
    p95s = []
    for _ in range(rounds):
        times = []
        for q in questions:
            start = time.perf_counter()
            index.search(q, 3)
            times.append(time.perf_counter() - start)
        p95s.append(sorted(times)[int(0.95 * len(times))])
    return min(p95s)


def test_the_knowledge_base_reindexes_on_change_and_keeps_its_index_on_failure(tmp_path):
    kb = tmp_path / "kb"
    kb.mkdir()
    (kb / "a.md").write_text("Refunds take five days.")
    settings = KnowledgeSettings(folder=str(kb), max_articles=2)
    base = KnowledgeBase(settings, str(tmp_path / "cache"))
    assert base.path == index_path(str(tmp_path / "cache"), str(kb))
    assert base.load() and not base.load()  # unchanged: nothing to do
    (kb / "b.md").write_text("Shipping takes three days.")
    assert base.load() and base.search("shipping")[0].article_id == "b.md"
    (kb / "c.md").write_text("one too many")
    assert not base.load() and "max_articles" in base.error
    assert base.search("shipping")[0].article_id == "b.md"  # the last good index serves on
    # another node with the same folder and cache reuses the file it finds built
    other = KnowledgeBase(KnowledgeSettings(folder=str(kb), max_articles=3), str(tmp_path / "cache"))
    assert other.load() and other.index is not None and other.index.articles == 3


def test_the_citation_grammars_allow_only_the_numbers_given_or_the_unknown_sentence(smol):
    from rtserver.engine.token_bytes import ll_tokenizer

    tok = ll_tokenizer(smol.tokenizer, len(smol.tokenizer), [smol.tokenizer.eos_token_id])

    def accepts(fmt: OutputFormat, text: str) -> bool:
        m = LLMatcher(tok, fmt.grammar())
        ok = all(m.consume_token(t) for t in tok.tokenize_str(text))
        return ok and m.is_accepting()

    for n in range(4):
        citations.answer_format(n).check()
        if n:
            citations.ending_format(n).check()
    ending = citations.ending_format(2)
    assert accepts(ending, "\n\nSources: [1]") and accepts(ending, "\n\nSources: [2], [1]")
    assert not accepts(ending, "\n\nSources: [3]") and not accepts(ending, "\n\nSources: [1], [2], [1]")
    assert accepts(citations.answer_format(0), citations.UNKNOWN)
    assert not accepts(citations.answer_format(0), "Paris.")
    assert accepts(citations.answer_format(2), "Paris.") and accepts(
        citations.answer_format(2), citations.UNKNOWN
    )


def test_the_parse_keeps_given_numbers_once_in_order():
    sources = (citations.Source(1, "A", "", "a.md"), citations.Source(2, "B", "https://b", "b.md"))
    got = citations.parse("Text.", "\n\nSources: [2], [1], [2], [7]", sources)
    assert [s.article_id for s in got.sources] == ["b.md", "a.md"] and not got.unknown
    assert citations.parse(citations.UNKNOWN, "", sources).unknown
    assert citations.parse("anything", "", ()).unknown
    cut = citations.parse("An answer cancelled before its ending.", "", sources)
    assert cut.sources == () and not cut.unknown  # no hand-off for a reply the customer stopped
    block = citations.retrieved([], 100, lambda t, n: t)
    assert block.sources == () and block.block == ""  # nothing goes before the message


def test_rtserver_kb_index_rebuilds_where_servers_read(tmp_path, monkeypatch, capsys):
    from rtserver.cli import main

    monkeypatch.setenv("RTSERVER_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["kb", "index", "--folder", str(DATA / "shop_kb")]) == 0
    path = index_path(str(tmp_path / "cache"), str(DATA / "shop_kb"))
    assert Index(path).articles == 32 and "32 articles" in capsys.readouterr().out
    assert main(["kb", "index", "--folder", str(tmp_path / "none")]) == 1
    assert "not a folder" in capsys.readouterr().err


def test_a_knowledge_turn_is_its_plain_prompt_with_the_sources_between(smol, tmp_path):
    """The sources sit as a block between the history and the message, each part tokenized on its own. The
    turn leaves its prompt without them for the next, whose prompt continues those ids."""
    from rtserver.config import ChatSettings
    from rtserver.tasks.chat import ChatTask, chat_task

    kb = KnowledgeBase(KnowledgeSettings(folder=str(DATA / "shop_kb")), str(tmp_path / "cache"))
    assert kb.load()
    tok = smol.tokenizer
    chat = ChatTask(chat_task(ChatSettings()), tok, kb)
    history: list[dict[str, str]] = []
    last = None
    for text in ("Do you take PayPal?", "And can I pay in installments?", "How long is a gift card valid?"):
        turn = chat.prepare_turn(history, text, last, knowledge=True)
        assert turn.sources is not None and turn.sources.sources and turn.history[-1]["content"] == text
        block, plain = turn.inserted, turn.plain
        assert block is not None and plain is not None
        ids = turn.prompt_ids
        # the plain prompt, the block between: before it the same ids, after it the message's own
        assert ids[: block.start] == plain.ids[: block.start] and ids[block.end :] == plain.ids[block.start :]
        assert tok.decode(ids[block.start : block.end]) == turn.sources.block
        segments = [tok.decode(ids[s:e]) for s, e in block.segments]  # every part is one, in order
        n = len(turn.sources.sources)
        assert segments[0] == citations.INSTRUCTION + "\n" and segments[-1] == citations.QUESTION
        assert segments[1:-1:2] == [f"[{k}]" for k in range(1, n + 1)]
        assert all(seg.startswith(" ") and ": " in seg and seg.endswith("\n") for seg in segments[2:-1:2])
        if last is not None:  # the turns before keep their ids: nothing before the message is tokenized anew
            assert ids[: len(last.ids)] == last.ids
        reply = " Yes, we do."
        last = chat.finished(turn, reply, tok.encode(reply, add_special_tokens=False))
        assert last is not None and last.ids[: len(plain.ids)] == plain.ids
        assert citations.INSTRUCTION not in last.text and last.text == plain.rendered + reply
        history = [*turn.history, {"role": "assistant", "content": reply}]


@pytest.mark.asyncio
async def test_sources_computed_ahead_serve_a_turn_that_computes_none(smol, tmp_path):
    """Every chunk's source is computed in the background; a turn then copies its block in whole."""
    from rtserver.config import ChatSettings, EngineSettings
    from rtserver.engine.backend import SamplingParams
    from rtserver.engine.core import Engine
    from rtserver.tasks.chat import ChatTask, chat_task
    from rtserver.tasks.source_kv import SourceWarmer

    kb = KnowledgeBase(KnowledgeSettings(folder=str(DATA / "shop_kb")), str(tmp_path / "cache"))
    assert kb.load() and kb.index is not None
    chat = ChatTask(chat_task(ChatSettings()), smol.tokenizer, kb)
    engine = Engine(smol, EngineSettings(kv_budget_mb=256))
    engine.start()
    try:
        warmer = SourceWarmer(chat, engine)
        await warmer.warm()
        assert warmer.done == warmer.total == len(kb.index.chunks(10_000)) > 30
        submitted = []
        submit = engine.scheduler.submit
        engine.scheduler.submit = lambda seq: submitted.append(seq) or submit(seq)
        turn = chat.prepare_turn([], "Do you take PayPal?", None, knowledge=True)
        assert turn.inserted is not None and len(turn.inserted.segments) == 2 * len(turn.sources.sources) + 2
        before = engine.kv.spliced_hits
        params = SamplingParams(max_new_tokens=4)
        result = await engine.generate(
            turn.prompt_ids, params, public_tokens=turn.public_tokens, inserted=turn.inserted
        ).result()
        assert len(submitted) == 1  # the turn alone: no segment had to be computed
        assert engine.kv.spliced_hits - before == turn.inserted.end - turn.inserted.start
        assert result.usage.prefilled_tokens == len(turn.prompt_ids) - turn.inserted.end
    finally:
        await engine.stop()
