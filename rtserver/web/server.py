"""The uvicorn server as `rtserver serve` runs it: a graceful drain on SIGTERM/SIGINT, and an exit with a
clear message when the model cannot be loaded.

uvicorn's own shutdown closes every WebSocket at once (1012). Before it does, `Server.shutdown` stops
listening and lets the hub drain (`Hub.drain`): in-flight replies get `server.shutdown_grace_s` to finish,
the rest end with `shutting_down`, sockets close with 1001. Then uvicorn finishes HTTP requests, runs the
app's lifespan shutdown (engine stop) and `serve` returns 0.

Every client socket is a file: `serve` raises the soft open-file limit to the hard one first, and the
node's WebSocket capacity and socket budget follow from it (`transport`).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from typing import Any

import uvicorn

from ..config import Settings
from ..engine.backend import InferenceBackend
from ..engine.model import LoadedModel
from .app import create_app, uvicorn_options
from .hub import Hub
from .state import AppState
from .transport import raise_fd_limit

log = logging.getLogger("rtserver.server")

EXIT_MODEL_LOAD_FAILED = 3


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: AppState, hub: Hub):
        super().__init__(config)
        self.state = state
        self.hub = hub
        self.exit_code = 0

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting first; uvicorn's shutdown closes them again (no-op)
            server.close()
        if self.state.readiness().serving:
            self.state.mark_stopping()
            grace = self.state.settings.server.shutdown_grace_s
            log.info("shutting down: in-flight replies get %.1f s to finish", grace)
            try:
                await self.hub.drain(grace)
            except Exception:
                log.exception("draining connections failed")
        await super().shutdown(sockets)

    def load_failed(self, message: str) -> None:
        print(f"rtserver: cannot start: {message}", file=sys.stderr, flush=True)
        self.exit_code = EXIT_MODEL_LOAD_FAILED
        self.should_exit = True


def serving_engine(loaded: LoadedModel, settings: Settings) -> InferenceBackend:
    """The engine of a server process: the model is its alone, so the HF module's dense weights are
    freed (and the linears packed for oneDNN) once the engine holds its own copies."""
    from ..engine.core import Engine

    return Engine(loaded, settings.engine, release_dense_weights=True)


def serve(settings: Settings, **app_options: Any) -> int:
    """Run the server until SIGTERM/SIGINT; the process exit code. `app_options` go to `create_app`
    (default engine: `serving_engine`)."""
    app_options.setdefault("engine_factory", serving_engine)
    server: Server | None = None

    def on_load_failed(message: str) -> None:
        if server is not None:
            server.load_failed(message)

    nofile = raise_fd_limit()  # every client socket is a file: the hard limit, where allowed
    app = create_app(settings, on_load_failed=on_load_failed, **app_options)
    capacity = app.state.hub.capacity
    if capacity < settings.server.max_websockets:
        log.warning(
            "this process may open %d files (ulimit -n): at most %d WebSockets, not server.max_websockets"
            " = %d; raise the limit (docs/deploy.md)",
            nofile,
            capacity,
            settings.server.max_websockets,
        )
    server = Server(uvicorn.Config(app, **uvicorn_options(settings)), app.state.rt, app.state.hub)
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers in place that
    # ends here as a normal return (exit code 0) instead of the default "killed by SIGTERM"
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started and server.exit_code == 0:
        return 1  # could not listen (the port is taken, ...): uvicorn has logged why
    return server.exit_code
