"""Model files made the way users' files are made: the embedded model requantized by the pinned
llama-quantize, and Gemma 3 270M joined from its PyPI chunks and checked."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader

from rtserver.engine.model import embedded_model_path
from rtserver.tools import model_files
from rtserver.tools.llama_build import tool_path

from ..components import missing, slow_tests_on

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _types(path: Path) -> dict[str, str]:
    return {t.name: GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def quantize_built() -> None:
    if not slow_tests_on():
        pytest.skip("needs llama-quantize (RTSERVER_SLOW_TESTS=1)")
    if not tool_path("llama-quantize").is_file():
        missing("the llama-quantize build", "python scripts/build_llama_server.py (./run test builds it)")


@pytest.mark.slow
def test_requantized_files_hold_the_embedded_tensors_in_the_asked_types(quantize_built, tmp_path):
    shipped = _types(embedded_model_path())
    q8 = _types(model_files.requantized("Q8_0", tmp_path))
    assert q8.keys() == shipped.keys()
    assert {q8[n] for n in q8 if n.split(".")[-2] in LINEARS} == {"Q8_0"}
    mixed = _types(model_files.requantized("Q4_K_M", tmp_path))
    assert mixed.keys() == shipped.keys()
    linear_types = {mixed[n] for n in mixed if n.split(".")[-2] in LINEARS}
    assert len(linear_types) > 1 and "Q6_K" in set(mixed.values()), linear_types  # a mix, as Q4_K_M is
    again = model_files.requantized("Q4_K_M", tmp_path)  # cached: not made twice
    assert again.stat().st_mtime_ns == (tmp_path / again.name).stat().st_mtime_ns


@pytest.mark.slow
def test_an_unknown_quant_type_is_refused_by_name(quantize_built, tmp_path):
    with pytest.raises(model_files.ModelFileError, match="llama-quantize to Q9_Z failed"):
        model_files.requantized("Q9_Z", tmp_path)
    assert list(tmp_path.iterdir()) == []


def _gemma_installed() -> None:
    try:
        model_files._package_dir(model_files.GEMMA_PACKAGE)
    except model_files.ModelFileError as exc:
        missing("the Gemma 3 270M packages", str(exc))


def test_gemma_is_joined_from_its_chunks_and_checked(tmp_path):
    _gemma_installed()
    path = model_files.gemma3_270m(tmp_path)
    sums = (model_files._package_dir(model_files.GEMMA_PACKAGE) / "SHA256SUMS").read_text()
    assert hashlib.sha256(path.read_bytes()).hexdigest() in sums
    assert GGUFReader(path).fields["general.architecture"].contents() == "gemma3"


def test_a_gemma_file_that_differs_from_its_checksum_is_refused(tmp_path, monkeypatch):
    _gemma_installed()
    chunks = tmp_path / "chunks"
    for name in model_files.GEMMA_CHUNKS:
        shutil.copytree(model_files._package_dir(name), chunks / name)
    first = next((chunks / model_files.GEMMA_CHUNKS[0]).glob("*.part*"))
    with first.open("r+b") as f:  # one flipped byte
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    real = model_files._package_dir

    def package_dir(name: str) -> Path:
        return chunks / name if name in model_files.GEMMA_CHUNKS else real(name)

    monkeypatch.setattr(model_files, "_package_dir", package_dir)
    with pytest.raises(model_files.ModelFileError, match="has SHA-256 .*, expected"):
        model_files.gemma3_270m(tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
