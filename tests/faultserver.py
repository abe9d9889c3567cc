"""`rtserver serve` with a scheduler fault hook, for `rtserver loadtest`'s fault phase (its server B):
every step that holds a prompt containing STEP_FAULT_MARKER raises, as a model bug would.

    python tests/faultserver.py [--config PATH]
"""

from __future__ import annotations

import logging
import os
import sys

from rtbench.loadtest import STEP_FAULT_MARKER
from rtserver.config import ConfigError, Settings, load_settings
from rtserver.engine.backend import InferenceBackend
from rtserver.engine.core import Engine
from rtserver.engine.model import LoadedModel
from rtserver.engine.plan import StepItem
from rtserver.engine.sequence import Phase
from rtserver.web.server import serve, serving_engine


def faulty_engine(loaded: LoadedModel, settings: Settings) -> InferenceBackend:
    engine = serving_engine(loaded, settings)
    assert isinstance(engine, Engine)
    decode = loaded.tokenizer.decode

    def hook(items: list[StepItem]) -> None:
        for it in items:
            if it.seq.phase is Phase.PREFILL and STEP_FAULT_MARKER in decode(it.seq.prompt_ids):
                raise RuntimeError("injected step fault")

    engine.scheduler.fault_hook = hook
    return engine


def main(argv: list[str]) -> int:
    config = argv[argv.index("--config") + 1] if "--config" in argv else os.environ.get("RTSERVER_CONFIG")
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        print(f"rtserver: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(settings, engine_factory=faulty_engine)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
