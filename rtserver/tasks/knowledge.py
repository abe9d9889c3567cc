"""The knowledge folder: its articles (Markdown, HTML or text, each with an optional header) and their chunks.

An article may start with a header: `key: value` lines between two `---` lines. `title` and `url` are read;
other keys are ignored. Without a title, a Markdown article's first `#` heading or an HTML `<title>` names
it, else its file name. Without a url, `base_url` + its path is used. Only http(s) URLs are kept.

The folder is anyone's: files past the size bounds are skipped, too many or too much is an error, links
that point out of the folder are not followed, undecodable bytes are replaced.
"""

from __future__ import annotations

import html
import logging
import os
import re
import stat
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

log = logging.getLogger("rtserver.knowledge")

SUFFIXES = (".md", ".markdown", ".html", ".htm", ".txt")
MAX_HEADER_CHARS = 2048  # a longer header is read as text
MAX_TITLE_CHARS = 200
MAX_URL_CHARS = 2048


class KnowledgeError(ValueError):
    """A folder that cannot be indexed; the message says why."""


@dataclass(frozen=True)
class Article:
    """One article: its id (the path in the folder), title, url ("" = none) and plain text."""

    id: str
    title: str
    url: str
    text: str


@dataclass(frozen=True)
class Chunk:
    """A piece of an article as the index holds it."""

    article: Article
    section: str  # the heading it sits under ("" at the top)
    text: str


@dataclass(frozen=True)
class FileSig:
    """What says a file changed: its path, size and modification time."""

    path: str
    size: int
    mtime_ns: int


def safe_url(url: str) -> str:
    """The URL if it is a plain http(s) URL, else ""."""
    url = url.strip()
    if len(url) > MAX_URL_CHARS or not re.fullmatch(r"https?://[^\s<>\"'`\\]+", url):
        return ""
    return url


def scan(folder: Path, max_articles: int, max_article_bytes: int, max_total_mb: int) -> list[FileSig]:
    """The article files under `folder`, sorted. Raises KnowledgeError when there are too many or too much.

    Files larger than `max_article_bytes` are skipped with a warning. Links are followed only when they
    stay inside the folder.
    """
    root = folder.resolve()
    if not root.is_dir():
        raise KnowledgeError(f"knowledge.folder {str(folder)!r}: not a folder")
    found: list[FileSig] = []
    total = seen = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        seen += len(filenames) + len(dirnames)
        if seen > 10 * max_articles + 1000:  # other files count too: each poll walks them all
            raise KnowledgeError(f"knowledge.folder holds over {10 * max_articles + 1000} files and folders")
        for name in sorted(filenames):
            if name.startswith(".") or not name.lower().endswith(SUFFIXES):
                continue
            path = Path(dirpath) / name
            try:
                real = path.resolve(strict=True)
                st = real.stat()
            except (OSError, RuntimeError):
                continue  # a dangling or looping link
            if not real.is_relative_to(root) or not stat.S_ISREG(st.st_mode):
                log.warning("knowledge: %s points out of the folder or is no file; skipped", path)
                continue
            if st.st_size > max_article_bytes:
                log.warning("knowledge: %s is over %d bytes; skipped", path, max_article_bytes)
                continue
            if len(found) >= max_articles:
                raise KnowledgeError(
                    f"knowledge.folder holds more than {max_articles} articles (max_articles)"
                )
            total += st.st_size
            if total > max_total_mb << 20:
                raise KnowledgeError(f"knowledge.folder holds more than {max_total_mb} MB (max_total_mb)")
            found.append(FileSig(str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    return found


def read_article(folder: Path, sig: FileSig, base_url: str = "", max_bytes: int = 1 << 20) -> Article | None:
    """The article of one file, or None when it holds no text (binary, empty)."""
    try:
        with open(folder / sig.path, "rb") as fh:
            data = fh.read(max_bytes + 1)[:max_bytes]
    except OSError as exc:
        log.warning("knowledge: cannot read %s (%s)", sig.path, exc.strerror)
        return None
    if b"\x00" in data[:8192]:
        log.warning("knowledge: %s looks binary; skipped", sig.path)
        return None
    raw = data.decode("utf-8", errors="replace")
    header, body = split_header(raw)
    is_html = sig.path.lower().endswith((".html", ".htm"))
    page_title, text = html_text(body) if is_html else ("", body)
    text = clean(text)
    if not text.strip():
        return None
    title = header.get("title") or page_title or first_heading(text) or Path(sig.path).stem
    url = safe_url(header.get("url", "")) or (safe_url(base_url + sig.path) if base_url else "")
    return Article(sig.path, clean(title)[:MAX_TITLE_CHARS].strip(), url, text)


def split_header(raw: str) -> tuple[dict[str, str], str]:
    """(header keys, the rest). A text without a well-formed header has none."""
    if not raw.startswith("---"):
        return {}, raw
    end = raw.find("\n---", 3, MAX_HEADER_CHARS)
    if end < 0:
        return {}, raw
    header: dict[str, str] = {}
    for line in raw[3:end].splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("title", "url"):
            header[key.strip().lower()] = value.strip().strip("\"'")
    rest = raw[end + 4 :]
    return header, rest.split("\n", 1)[1] if "\n" in rest else ""


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean(text: str) -> str:
    """Control characters dropped, line ends made plain."""
    return _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def first_heading(text: str) -> str:
    m = re.search(r"^#{1,6}[ \t]+(.+)$", text[:4096], re.M)
    return m.group(1).strip() if m else ""


class _Text(HTMLParser):
    """An HTML page's title and visible text, paragraphs on their own lines."""

    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "pre"}
    HIDDEN = {"script", "style", "template", "noscript", "head"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title: list[str] = []
        self.hidden = 0
        self.in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.HIDDEN:
            self.hidden += 1
        elif tag == "title":
            self.in_title = True
        elif tag in self.BLOCKS:
            self.parts.append("\n\n" if tag.startswith("h") or tag == "p" else "\n")
            if tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
                self.parts.append("#" * int(tag[1]) + " ")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag == "title":
            self.in_title = False
        elif tag in self.BLOCKS:
            self.parts.append("\n\n" if tag.startswith("h") or tag == "p" else "\n")

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title.append(data)
        elif not self.hidden:
            self.parts.append(data)


def html_text(page: str) -> tuple[str, str]:
    """(title, text) of an HTML page."""
    parser = _Text()
    try:
        parser.feed(page)
        parser.close()
    except Exception:  # the parser is lenient; a page it still refuses is read as text
        return "", html.unescape(re.sub(r"<[^>]*>", " ", page))
    text = re.sub(r"[ \t]+", " ", "".join(parser.parts))
    return " ".join("".join(parser.title).split()), re.sub(r"\n\s*\n\s*", "\n\n", text)


def chunks(article: Article, chunk_chars: int) -> list[Chunk]:
    """An article cut at blank lines into pieces of about `chunk_chars`, each under its heading. A paragraph
    longer than that is cut at a word.
    """
    out: list[Chunk] = []
    section, piece = "", ""

    def flush() -> None:
        nonlocal piece
        if piece.strip():
            out.append(Chunk(article, section, piece.strip()))
        piece = ""

    for para in re.split(r"\n\s*\n", article.text):
        heading = re.match(r"#{1,6}[ \t]+(.+)", para.strip())
        if heading and "\n" not in para.strip():
            flush()
            section = heading.group(1).strip()[:MAX_TITLE_CHARS]
            continue
        while len(para) > chunk_chars:
            cut = para.rfind(" ", chunk_chars // 2, chunk_chars)
            cut = cut if cut > 0 else chunk_chars
            flush()
            piece = para[:cut]
            flush()
            para = para[cut:]
        if len(piece) + len(para) > chunk_chars:
            flush()
        piece = f"{piece}\n\n{para}" if piece else para
    flush()
    return out
