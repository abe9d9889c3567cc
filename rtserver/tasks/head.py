"""A task's learned head: a logistic regression on hidden-state features, read from the scoring forward.

It owns reading the examples file, the classifier, the feature cache and the fitted-heads files: the one
a plugin ships and the one `rtserver fit-heads` stores in the cache. Both are keyed by a hash of
everything the fit depends on, so only a new combination computes features. `run.py` decides when the
head is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from .declare import Task

log = logging.getLogger("rtserver.tasks")

FEATURES_VERSION = 3  # bump when what score_features returns changes
HEAD_VERSION = 1  # bump when LogisticHead's fit changes (a shipped fit is then refitted, not trusted)


def load_examples(path: Path, label_map: dict[str, str], labels: list[str]) -> list[tuple[str, str]]:
    """(text, task label) pairs from a JSONL file; `label_map` renames the file's labels to the task's.
    Raises ValueError naming the file and line for anything malformed or a label the task lacks."""
    out: list[tuple[str, str]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text, label = row["text"], row["label"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f'{path}:{n}: expected {{"text": ..., "label": ...}} ({exc})') from None
        label = label_map.get(label, label)
        if not isinstance(text, str) or not text.strip() or label not in labels:
            raise ValueError(f"{path}:{n}: label {row.get('label')!r} is not one of {labels} (or empty text)")
        out.append((text, label))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def features_key(*parts: object) -> str:
    """A cache key: SHA-256 over the parts' JSON (model id, prompt, verbalizer ids, examples...)."""
    blob = json.dumps([FEATURES_VERSION, *parts], ensure_ascii=False, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def head_key(features: str, labels: list[str], y: list[str], head: LogisticHead, use_scores: bool) -> str:
    """The hash a fitted head is stored under: its features' key plus the examples' labels and every
    setting of the fit."""
    return features_key("head", HEAD_VERSION, features, labels, y, head.l2, head.iterations, use_scores)


def stored_path(cache_dir: Path | None, task: str) -> Path | None:
    """Where `rtserver fit-heads` stores a task's heads: beside the features in the cache."""
    return None if cache_dir is None else cache_dir / f"{task}.head.npz"


def load_fitted(path: Path) -> dict[str, LogisticHead]:
    """The heads in a fitted-heads file, by key. A missing or unreadable file is no heads (a warning)."""
    try:
        arrays = _read(path)
    except (OSError, ValueError) as exc:
        log.warning("cannot read the fitted heads %s (%s): none of its heads is used", path, exc)
        return {}
    out: dict[str, LogisticHead] = {}
    for key in {name.split("/")[0] for name in arrays}:
        try:
            head = LogisticHead([str(v) for v in arrays[f"{key}/labels"]])
            head.l2 = float(arrays[f"{key}/l2"])
            head.iterations = int(arrays[f"{key}/iterations"])
            head.mean, head.scale = arrays[f"{key}/mean"], arrays[f"{key}/scale"]
            head.w, head.b = arrays[f"{key}/w"], arrays[f"{key}/b"]
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("fitted heads %s: entry %s is incomplete (%s): ignored", path, key[:12], exc)
            continue
        if head.w.shape != (head.mean.shape[0], len(head.labels)):
            log.warning("fitted heads %s: entry %s has inconsistent shapes: ignored", path, key[:12])
            continue
        out[key] = head
    return out


def load_stored(path: Path | None) -> dict[str, LogisticHead]:
    """The heads `rtserver fit-heads` stored; none yet is no heads, quietly."""
    return load_fitted(path) if path is not None and path.exists() else {}


def _read(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def store_fitted(path: Path, heads: dict[str, tuple[str, LogisticHead]]) -> None:
    """Add heads to a stored fitted-heads file, keeping the entries of other models and prompts (an
    unreadable file is replaced)."""
    try:
        kept = _read(path)
    except (OSError, ValueError):
        kept = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, {**kept, **_arrays(heads)})  # a key's arrays all replace its old ones


def save_fitted(path: Path, heads: dict[str, tuple[str, LogisticHead]]) -> None:
    """Write {key: (model id it was fitted for, head)} as a fitted-heads file (numpy .npz, no pickles)."""
    _write(path, _arrays(heads))


def _arrays(heads: dict[str, tuple[str, LogisticHead]]) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for key, (model_id, head) in heads.items():
        assert head.w is not None and head.b is not None and head.mean is not None and head.scale is not None
        arrays.update(
            {
                f"{key}/model": np.array(model_id),
                f"{key}/labels": np.array(head.labels),
                f"{key}/l2": np.array(head.l2),
                f"{key}/iterations": np.array(head.iterations),
                f"{key}/mean": head.mean,
                f"{key}/scale": head.scale,
                f"{key}/w": head.w,
                f"{key}/b": head.b,
            }
        )
    return arrays


def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)  # type: ignore[arg-type]
    tmp.replace(path)


def load_cached(cache_dir: Path | None, key: str) -> np.ndarray | None:
    if cache_dir is None:
        return None
    path = cache_dir / f"{key}.npy"
    try:
        loaded: np.ndarray = np.load(path)
        return loaded
    except (OSError, ValueError):
        return None


def store_cached(cache_dir: Path | None, key: str, x: np.ndarray) -> None:
    if cache_dir is None:
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f"{key}.tmp.npy"
        np.save(tmp, x)
        tmp.replace(cache_dir / f"{key}.npy")  # atomic: a concurrent start never reads half a file
    except OSError as exc:  # a read-only cache is a slower next start, not a failure
        log.warning("cannot cache head features in %s: %s", cache_dir, exc)


class LogisticHead:
    """Multinomial logistic regression on standardised features with an L2 penalty, fitted by full-batch
    Nesterov gradient descent (convex: the step size from the loss's curvature bound converges without
    tuning). Small and dependency-free: the features are a few thousand rows of ~1,000 numbers."""

    def __init__(self, labels: list[str], l2: float = 1e-2, iterations: int = 1500):
        self.labels = list(labels)
        self.l2 = l2
        self.iterations = iterations
        self.mean: np.ndarray | None = None
        self.scale: np.ndarray | None = None
        self.w: np.ndarray | None = None
        self.b: np.ndarray | None = None

    def fit(self, x: np.ndarray, y: list[str]) -> LogisticHead:
        x = np.asarray(x, dtype=np.float64)
        self.mean = x.mean(0)
        self.scale = x.std(0) + 1e-6
        z = (x - self.mean) / self.scale
        n, d = z.shape
        k = len(self.labels)
        onehot = np.zeros((n, k))
        onehot[np.arange(n), [self.labels.index(t) for t in y]] = 1.0
        # Curvature bound of the mean softmax cross-entropy: 1/2 · largest eigenvalue of zᵀz/n (+ λ).
        v = np.ones(d) / np.sqrt(d)
        for _ in range(30):
            v = z.T @ (z @ v) / n
            v /= np.linalg.norm(v)
        lipschitz = 0.5 * float(v @ (z.T @ (z @ v))) / n + 0.5 + self.l2
        step = 1.0 / lipschitz
        w = np.zeros((d, k))
        b = np.zeros(k)
        w_prev, b_prev = w, b
        for t in range(1, self.iterations + 1):
            mom = (t - 1) / (t + 2)
            wy, by = w + mom * (w - w_prev), b + mom * (b - b_prev)
            p = _softmax(z @ wy + by)
            g = (p - onehot) / n
            w_prev, b_prev = w, b
            w = wy - step * (z.T @ g + self.l2 * wy)
            b = by - step * g.sum(0)
        self.w, self.b = w, b
        return self

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        assert self.w is not None and self.b is not None and self.mean is not None and self.scale is not None
        z = (np.atleast_2d(np.asarray(x, dtype=np.float64)) - self.mean) / self.scale
        return _softmax(z @ self.w + self.b)


def _softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(1, keepdims=True)
    e = np.exp(a)
    out: np.ndarray = e / e.sum(1, keepdims=True)
    return out


def head_input(task: Task, rows: list[float] | np.ndarray, n_labels: int) -> np.ndarray:
    """A learned head's input rows: the features, and the label scores where the head uses them."""
    x = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    assert task.head is not None
    return x if task.head.use_scores else x[:, :-n_labels]
