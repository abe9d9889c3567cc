"""A real llama.cpp `llama-server` on the embedded GGUF for tests: built once per CPU kind by
rtbench/llama_build.py (cached), started on a free 127.0.0.1 port, stopped after."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from rtbench.llama_build import llama_server_path
from rtbench.serverproc import LlamaServerProcess
from rtserver.engine.model import embedded_model_path

from .components import missing


def llama_server_binary() -> Path | None:
    """The cached build for this CPU, or None (`./run test` builds it when RTSERVER_SLOW_TESTS=1)."""
    path = llama_server_path()
    return path if path.is_file() else None


def built_llama_server() -> Path:
    """The cached build; when there is none, a skip locally and a failure in CI."""
    path = llama_server_binary()
    if path is None:
        missing("the llama-server build", "python scripts/build_llama_server.py (./run test builds it in CI)")
    return path


class LlamaServer(LlamaServerProcess):
    """llama-server on the embedded GGUF, with what the tests read of it."""

    def __init__(self, binary: Path, log_path: Path, slots: int = 4, ctx: int = 8192, threads: int = 2):
        super().__init__(binary, embedded_model_path(), log_path, slots, ctx, threads)
        self.url = self.base

    def start(self, timeout_s: float = 120.0) -> LlamaServer:  # type: ignore[override]
        super().start(timeout_s)
        return self

    def get(self, path: str) -> object:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            body = resp.read().decode()
        return json.loads(body) if body.lstrip().startswith(("{", "[")) else body

    def processing(self) -> int:
        """Slots generating right now."""
        slots = self.get("/slots")
        assert isinstance(slots, list)
        return sum(1 for s in slots if s.get("is_processing"))
