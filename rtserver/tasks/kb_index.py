"""The knowledge index: the folder's chunks in an SQLite FTS5 table on disk, ranked by BM25.

One index file per folder in `model.cache_dir/knowledge`. It is built in a temporary file and renamed over
the old one, so nodes sharing a folder and a cache read whole indexes only. Readers open it read-only. The
customer's text never reaches FTS5's query syntax: only its words do, each quoted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import sqlite3
import tempfile
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import KnowledgeSettings
from .knowledge import Article, FileSig, KnowledgeError, chunks, read_article, scan

log = logging.getLogger("rtserver.knowledge")

VERSION = 1  # of the file's layout; another one is rebuilt
MAX_QUERY_TERMS = 32
MAX_TERM_CHARS = 40
CANDIDATES = 64  # chunks ranked before they are grouped by article
# common words carry no topic: without them "how do I ..." does not rank every how-to first
STOPWORDS = frozenset(
    "a an and are as at be by can could do does for from had has have how i if in is it its me my of on or"
    " our please should so that the their then there this to was we what when where which who why will"
    " with would you your hi hello thanks thank".split()
)


@dataclass(frozen=True)
class Hit:
    """One article found: its id, title, url, best chunk's text and BM25 relevance (higher is better)."""

    article_id: str
    title: str
    url: str
    text: str
    score: float


def index_path(cache_dir: str, folder: str) -> Path:
    """Where a folder's index lives: one file per folder, named by its absolute path."""
    key = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "knowledge" / f"{key}.sqlite3"


def signature(files: list[FileSig], chunk_chars: int, base_url: str) -> str:
    """A digest of the files' paths, sizes and times, and the settings the index depends on."""
    digest = hashlib.sha256(json.dumps([VERSION, chunk_chars, base_url]).encode())
    for f in files:
        digest.update(f"{f.path}\0{f.size}\0{f.mtime_ns}\n".encode())
    return digest.hexdigest()


def match_query(text: str) -> str:
    """An FTS5 query of the text's words, any of them. Each is quoted, so no operator, column filter,
    prefix or NEAR of the text's is read as one. "" when no word is left.
    """
    seen: list[str] = []
    for word in re.findall(r"\w+", text.lower()):
        word = word[:MAX_TERM_CHARS]
        if word in STOPWORDS or word in seen or len(word) < 2 and not word.isalpha():
            continue
        seen.append(word)
        if len(seen) >= MAX_QUERY_TERMS:
            break
    return " OR ".join('"' + w.replace('"', '""') + '"' for w in seen)


def build(folder: str, path: Path, chunk_chars: int, base_url: str, limits: tuple[int, int, int]) -> int:
    """Index the folder into `path` (a temporary file renamed over it). Returns the articles indexed.
    `limits`: max articles, max bytes of one, max total MB. Raises KnowledgeError.
    """
    root = Path(folder)
    files = scan(root, *limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        db = sqlite3.connect(tmp)
        try:
            db.executescript(
                "PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"
                "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);"
                "CREATE TABLE articles(id INTEGER PRIMARY KEY, path TEXT, title TEXT, url TEXT);"
                "CREATE VIRTUAL TABLE chunks USING fts5(title, section, body, article UNINDEXED,"
                " tokenize='porter unicode61 remove_diacritics 2');"
            )
            n = 0
            for sig in files:
                article = read_article(root.resolve(), sig, base_url, limits[1])
                if article is None:
                    continue
                n += 1
                db.execute(
                    "INSERT INTO articles VALUES (?, ?, ?, ?)", (n, article.id, article.title, article.url)
                )
                db.executemany(
                    "INSERT INTO chunks VALUES (?, ?, ?, ?)",
                    [(article.title, c.section, c.text, n) for c in chunks(article, chunk_chars)],
                )
            db.execute("INSERT INTO chunks(chunks) VALUES ('optimize')")
            # titles weigh most, then headings: `ORDER BY rank` is FTS5's fast path for this ranking
            db.execute("INSERT INTO chunks(chunks, rank) VALUES ('rank', 'bm25(2.0, 1.5, 1.0)')")
            db.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [("signature", signature(files, chunk_chars, base_url)), ("articles", str(n))],
            )
            db.commit()
        finally:
            db.close()
        os.replace(tmp, path)  # readers see the old file or the new one, whole
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


class Index:
    """A built index, opened read-only. `search` may be called from any thread."""

    def __init__(self, path: Path):
        self.path = path
        self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self._lock = threading.Lock()
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        self.signature = meta.get("signature", "")
        self.articles = int(meta.get("articles", "0"))

    def close(self) -> None:
        self._db.close()

    def search(self, text: str, k: int, min_score: float = 0.0) -> list[Hit]:
        """The `k` articles most relevant to the text, best first, each with its best chunk."""
        query = match_query(text)
        if not query or k <= 0:
            return []
        with self._lock:
            rows = self._db.execute(
                "SELECT article, body, -rank FROM chunks WHERE chunks MATCH ? ORDER BY rank LIMIT ?",
                (query, CANDIDATES),
            ).fetchall()
            best: dict[int, tuple[str, float]] = {}
            for article, body, score in rows:
                if article not in best and score > min_score:
                    best[article] = (body, float(score))
                    if len(best) >= k:
                        break
            hits = []
            for article, (body, score) in best.items():
                path, title, url = self._db.execute(
                    "SELECT path, title, url FROM articles WHERE id = ?", (article,)
                ).fetchone()
                hits.append(Hit(path, title, url, body, score))
        return hits

    def chunks(self, limit: int) -> list[Hit]:
        """The first `limit` chunks, in the order they were indexed, each as a hit of score 0."""
        with self._lock:
            rows = self._db.execute(
                "SELECT a.path, a.title, a.url, c.body FROM chunks c JOIN articles a ON a.id = c.article"
                " ORDER BY c.rowid LIMIT ?",
                (limit,),
            ).fetchall()
        return [Hit(path, title, url, body, 0.0) for path, title, url, body in rows]

    def article(self, article_id: str) -> Article | None:
        """The title and url of an article by its id (the text is not kept whole)."""
        with self._lock:
            row = self._db.execute(
                "SELECT path, title, url FROM articles WHERE path = ?", (article_id,)
            ).fetchone()
        return None if row is None else Article(row[0], row[1], row[2], "")


def stored_signature(path: Path) -> str | None:
    """The signature an index file was built for, or None when there is no readable one."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            row = db.execute("SELECT value FROM meta WHERE key = 'signature'").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return None if row is None else str(row[0])


class KnowledgeBase:
    """The configured folder's index, kept current: `load` at start-up, `refresh` when files change.

    Searches read the index open now. A rebuild runs beside them and swaps in when whole. A failed build
    keeps the last good index and says why (`error`).
    """

    def __init__(self, settings: KnowledgeSettings, cache_dir: str):
        self.settings = settings
        self.path = index_path(cache_dir, settings.folder)
        self.index: Index | None = None
        self.error = ""
        self._signature = ""
        self._build_lock = threading.Lock()

    @property
    def limits(self) -> tuple[int, int, int]:
        s = self.settings
        return s.max_articles, s.max_article_bytes, s.max_total_mb

    def load(self) -> bool:
        """Open the index, built first where the folder changed since. True when it changed."""
        s = self.settings
        with self._build_lock:
            try:
                files = scan(Path(s.folder), *self.limits)
                sig = signature(files, s.chunk_chars, s.base_url)
                if sig == self._signature and self.index is not None:
                    return False
                if stored_signature(self.path) != sig:  # another node may have built it already
                    build(s.folder, self.path, s.chunk_chars, s.base_url, self.limits)
                old, self.index = self.index, Index(self.path)
                self._signature, self.error = sig, ""
            except (KnowledgeError, OSError, sqlite3.Error) as exc:
                self.error = str(exc)
                log.error("knowledge: %s", exc)
                return False
        if old is not None:
            old.close()
        log.info("knowledge: %d articles indexed from %s", self.index.articles, s.folder)
        return True

    def search(self, text: str) -> list[Hit]:
        """The top articles for a query; none while no index is open."""
        index = self.index
        if index is None:
            return []
        return index.search(text, self.settings.top_k, self.settings.min_score)

    async def watch(self, changed: Callable[[], Awaitable[None]] | None = None) -> None:
        """Re-index when the folder's files change, every `poll_s` (0: never). Runs until cancelled. Awaits
        `changed` at start and after each re-index.
        """
        if changed is not None:
            await changed()
        if self.settings.poll_s <= 0:
            return
        while True:
            await asyncio.sleep(self.settings.poll_s)
            try:
                if await asyncio.to_thread(self.load) and changed is not None:
                    await changed()
            except Exception:  # the next poll tries again; the chat keeps the index it has
                log.exception("knowledge: re-indexing failed")
