"""The task tests' engine: the embedded model in float32 with a small KV budget, one per test."""

from __future__ import annotations

import pytest

from rtserver.config import EngineSettings
from rtserver.engine.core import Engine


@pytest.fixture
async def engine(smol):
    eng = Engine(smol, EngineSettings(kv_budget_mb=64))
    eng.start()
    yield eng
    await eng.stop()
