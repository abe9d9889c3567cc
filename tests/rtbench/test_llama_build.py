"""The llama.cpp build's options per CPU: AMX off where the CPU has it, and a key that follows them."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from rtbench import llama_build

AVX512 = ["avx2", "avx512f", "avx512_vnni", "fma"]
AMX = [*AVX512, "amx_bf16", "amx_int8", "amx_tile"]


def test_a_cpu_with_amx_builds_without_it_and_others_as_before():
    assert llama_build.cmake_options(AVX512) == llama_build.CMAKE_OPTIONS
    extra = set(llama_build.cmake_options(AMX)) - set(llama_build.CMAKE_OPTIONS)
    assert extra == {f"-DCMAKE_C_FLAGS={llama_build.NO_AMX}", f"-DCMAKE_CXX_FLAGS={llama_build.NO_AMX}"}


def test_the_no_amx_flags_outlast_march_native_as_ggml_passes_it_later():
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build llama.cpp (./run test installs it)")
    args = ["gcc", *llama_build.NO_AMX.split(), "-march=sapphirerapids", "-dM", "-E", "-"]
    macros = subprocess.run(args, input="", capture_output=True, text=True, check=True).stdout
    assert "__AVX512VNNI__" in macros and "__AMX" not in macros


def test_the_cache_key_follows_the_build_options(monkeypatch):
    monkeypatch.setattr(llama_build, "cpu_flags", lambda: AVX512)
    plain = llama_build.cpu_key()
    monkeypatch.setattr(llama_build, "CMAKE_OPTIONS", [*llama_build.CMAKE_OPTIONS, "-DGGML_OTHER=ON"])
    assert llama_build.cpu_key() != plain
