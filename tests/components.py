"""Outside programs some tests drive (redis-server, a llama-server build, chromium): when one is
missing, the test skips locally and fails in CI (RTSERVER_SLOW_TESTS=1), where all must be present."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def slow_tests_on() -> bool:
    """CI's setting: slow tests run, and every component they need must be installed."""
    return os.environ.get("RTSERVER_SLOW_TESTS") == "1"


def missing(what: str, install: str) -> NoReturn:
    """Stop the test: `what` is not here, `install` says how to get it. A skip locally, a failure in CI."""
    message = f"{what} is missing: {install}"
    if slow_tests_on():
        pytest.fail(f"{message} (RTSERVER_SLOW_TESTS=1: CI must run this test)", pytrace=False)
    pytest.skip(message)
