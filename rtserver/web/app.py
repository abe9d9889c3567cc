"""The Starlette app: routes, lifespan (listen first, load the model in a thread, start the engine),
health/readiness/metrics, and static/ at /.

`create_app(settings)` returns an app whose lifespan returns at once, so the server listens while the
model loads; `GET /health` reports `loading` with the stage and a progress fraction, `GET /ready` is 200
only once requests can be served. `uvicorn_options(settings)` gives the uvicorn keyword arguments the
hub relies on (the transport frame limit) and the HTTP protocol with its request deadline (`transport`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from ..config import Settings
from ..engine.backend import InferenceBackend, Tokenizer
from ..engine.model import LoadedModel
from ..engine.openmp import pool_released
from ..tasks.chat import CHAT
from ..tasks.fitting import background_pace
from ..tasks.registry import PluginError, TaskRegistry
from ..tasks.source_kv import SourceWarmer
from . import http_api
from .admission import Admission, Refused, SocketGate, Surface, bearer
from .cluster.topology import Clustered
from .connection import client_ip
from .console import ConsoleHub
from .headers import SecurityHeaders, TrustedHosts
from .hub import FULL_RETRY_S, Hub
from .metrics import CONTENT_TYPE
from .protocol import transport_max_bytes
from .schema import console_schema, http_schema, protocol_schema
from .seams import Alone
from .state import AppState
from .transport import protocol_class

log = logging.getLogger("rtserver.app")

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"


class _ClientFaultFilter(logging.Filter):
    """uvicorn logs a client's text frame of invalid UTF-8 as an ERROR with a traceback (and rightly
    closes with 1007): a client's fault, not the server's. Keep it as one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Invalid UTF-8 sequence received from client.":
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


CLIENT_FAULTS = _ClientFaultFilter()


ModelFactory = Callable[[], LoadedModel]
TokenizerFactory = Callable[[], tuple[str, Tokenizer]]
EngineFactory = Callable[[LoadedModel, Settings], InferenceBackend]
RegistryFactory = Callable[[Settings, Tokenizer], tuple[TaskRegistry, list[PluginError]]]


def _default_model_factory(settings: Settings) -> ModelFactory:
    def load() -> LoadedModel:
        from ..engine.model import load_model

        m = settings.model
        return load_model(m.model, dtype=m.dtype, threads=m.threads, cache_dir=m.cache_dir)

    return load


def _default_tokenizer_factory(settings: Settings) -> TokenizerFactory:
    def load() -> tuple[str, Tokenizer]:
        from ..engine.model import load_tokenizer

        return load_tokenizer(settings.model.model, settings.model.cache_dir)

    return load


def _default_engine_factory(loaded: LoadedModel, settings: Settings) -> InferenceBackend:
    from ..engine.core import Engine

    return Engine(loaded, settings.engine)


def _default_registry_factory(
    settings: Settings, tokenizer: Tokenizer
) -> tuple[TaskRegistry, list[PluginError]]:
    from ..tasks.registry import load_registry

    return load_registry(settings, tokenizer)


async def _load(
    state: AppState,
    model_factory: ModelFactory,
    tokenizer_factory: TokenizerFactory,
    engine_factory: EngineFactory,
    registry_factory: RegistryFactory,
    on_failed: Callable[[str], None] | None,
) -> None:
    """Load what the configured backends need: the model and the local engine only when some work
    runs locally, else just the tokenizer; remote servers are checked (what they serve, their
    tokenizer) before the server is ready."""
    try:
        await _load_backends(state, model_factory, tokenizer_factory, engine_factory, registry_factory)
        await _prepare_tasks(state)
        _freeze_startup_objects()
        state.set_stage("ready", 1.0)
        state.mark_ready()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        _load_failed(state, exc, on_failed)
        return
    background = []
    chat = state.tasks.chat
    if chat.knowledge is not None:  # the articles re-indexed when they change, their sources computed ahead
        state.source_warmer = SourceWarmer(chat, _task_backends(state)(CHAT)[1])
        background.append(chat.knowledge.watch(state.source_warmer.warm))
    if state.settings.tasks.learned_heads and state.settings.tasks.fit_heads_in_background:
        background.append(_fit_heads_in_background(state))
    await asyncio.gather(*background)


def _freeze_startup_objects() -> None:
    """What start-up built (the model's modules, tokenizer, tasks) lives as long as the server: the
    garbage collector stops traversing it. Its collections over those objects took a share of every
    decode step."""
    gc.collect()
    gc.freeze()


async def _load_backends(
    state: AppState,
    model_factory: ModelFactory,
    tokenizer_factory: TokenizerFactory,
    engine_factory: EngineFactory,
    registry_factory: RegistryFactory,
) -> None:
    """The model or its tokenizer, the task registry, then each backend started (a remote one checked)."""
    settings = state.settings
    needed = state.backends_needed()
    if "local" in needed:
        state.set_stage("loading model", 0.05)
        loaded = await asyncio.to_thread(pool_released(model_factory))
        state.model_name, tokenizer = loaded.name, loaded.tokenizer
    else:
        state.set_stage("loading tokenizer", 0.05)
        state.model_name, tokenizer = await asyncio.to_thread(pool_released(tokenizer_factory))
    state.set_stage("loading tasks", 0.7)
    state.registry, state.load_errors = await asyncio.to_thread(
        pool_released(registry_factory), settings, tokenizer
    )
    if "openai" in needed:
        from ..remote.backend import RemoteBackend

        state.set_stage("checking inference servers", 0.8)
        remote = RemoteBackend(tokenizer, settings.backend)
        remote.start()
        state.backends["openai"] = remote
        await remote.check()
    if "local" in needed:
        state.set_stage("starting engine", 0.9)
        # Built off the event loop: its start-up probes take seconds.
        engine = await asyncio.to_thread(pool_released(engine_factory), loaded, settings)
        engine.start()
        state.backends["local"] = engine


def _task_backends(state: AppState) -> Callable[[str], tuple[str, InferenceBackend]]:
    """`task -> (backend name, backend)`: where each task runs, for the registry's start-up work."""

    def backend_for(task: str) -> tuple[str, InferenceBackend]:
        name = state.tasks.placement(task) or state.settings.model.backend
        return name, state.backends[name]

    return backend_for


def _heads_dir(settings: Settings) -> Path:
    """Where the heads' features and the fits of `rtserver fit-heads` are kept."""
    return Path(settings.model.cache_dir).expanduser() / "heads"


async def _prepare_tasks(state: AppState) -> None:
    """The tasks' output formats compiled, their learned heads loaded (never fitted: a task without a fit
    for this model scores labels) and their calibration computed, each on its task's backend."""
    settings, registry = state.settings, state.tasks
    state.set_stage("compiling output formats", 0.94)
    state.load_errors += await registry.prepare_outputs(_task_backends(state))
    await registry.prepare_knowledge(_task_backends(state))
    if settings.tasks.learned_heads:
        state.set_stage("loading task heads", 0.95)
        state.load_errors += await registry.prepare(_task_backends(state), _heads_dir(settings), fit=False)
    else:
        registry.heads_off("learned heads are off (tasks.learned_heads = false)")
    state.set_stage("calibrating tasks", 0.97)
    await registry.calibrate(_task_backends(state))


async def _fit_heads_in_background(state: AppState) -> None:
    """After /ready: the heads without a fit for this model, fitted at low priority and stored; each
    task switches to its head when done."""
    with background_pace() as pace:
        await state.tasks.fit_missing(_task_backends(state), _heads_dir(state.settings), pace)


def _load_failed(state: AppState, exc: Exception, on_failed: Callable[[str], None] | None) -> None:
    """Start-up failed: the cause kept for /health, logged, and `on_failed` told."""
    from ..engine.model import ModelLoadError
    from ..remote.backend import BackendMismatch

    if isinstance(exc, ModelLoadError):  # its message names the file and the cause: no traceback
        error = f"cannot load the model: {exc}"
        log.error("startup failed: %s", error)
    elif isinstance(exc, BackendMismatch):
        error = f"the inference server does not match the local model: {exc}"
        log.error("startup failed: %s", error)
    else:
        error = f"{type(exc).__name__}: {exc}"
        log.exception("startup failed")
    state.mark_failed(error)
    if on_failed is not None:
        on_failed(error)


def _ops_refusal(request: Request) -> Refused | None:
    """Why this client may not see operations detail (None: it may)."""
    admission: Admission = request.app.state.admission
    try:
        admission.authorize(Surface.OPS, bearer(request.headers), client_ip(request))
    except Refused as refused:
        return refused
    return None


async def health(request: Request) -> Response:
    st: AppState = request.app.state.rt
    status = st.readiness().status
    body: dict[str, object] = {"status": status, "stage": st.stage, "progress": round(st.progress, 3)}
    status_code = 503 if status == "failed" else 200
    if _ops_refusal(request) is not None:  # the public view: nothing of what runs where
        return JSONResponse(body, status_code=status_code)
    body["model"] = st.model_id
    body["uptime_s"] = round(time.monotonic() - st.started, 3)
    if st.error:
        body["error"] = st.error
    if st.ready_after_s is not None:
        body["ready_after_s"] = round(st.ready_after_s, 3)
    if st.load_errors:
        body["plugin_errors"] = [str(e) for e in st.load_errors]
    heads = st.head_states()
    if heads:  # per task with a learned head: `head` or `labels`, and why
        body["tasks"] = heads
    body["backends"] = st.backends_health()
    if st.source_warmer is not None:
        warmer = st.source_warmer
        body["knowledge"] = {"sources_ahead": warmer.done, "sources_to_compute": warmer.total}
    await st.topology.add_health(body)
    return JSONResponse(body, status_code=status_code)


async def ready(request: Request) -> Response:
    """200 while requests can be served, `full` or not; 503 when they cannot. `?for=widgets`: also 503
    (with `Retry-After`) while the node is full, for a balancer that routes new WebSockets by status."""
    readiness = request.app.state.rt.readiness()
    hub: Hub = request.app.state.hub
    full = hub.full()
    body: dict[str, object] = {"ready": readiness.ready, "status": readiness.status, "full": full}
    ops = _ops_refusal(request) is None
    if readiness.reason:
        body["reason"] = readiness.reason if ops else readiness.public_reason
    if ops:
        body["websockets"], body["max_websockets"] = len(hub.connections), hub.capacity
    if readiness.ready and full and request.query_params.get("for") == "widgets":
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(FULL_RETRY_S)})
    return JSONResponse(body, status_code=200 if readiness.ready else 503)


async def metrics(request: Request) -> Response:
    st: AppState = request.app.state.rt
    refused = _ops_refusal(request)
    if refused is not None:
        return http_api.refused_response(st, refused)
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


async def index(request: Request) -> Response:
    page = STATIC_DIR / "index.html"
    if page.is_file():
        return FileResponse(page)
    return JSONResponse(
        {"name": "rtserver", "websocket": "/ws", "docs": "docs/protocol.md", "health": "/health"}
    )


async def console_page(request: Request) -> Response:
    page = STATIC_DIR / "console.html"
    if page.is_file():
        return FileResponse(page)
    return JSONResponse(
        {"error": {"code": "not_found", "message": "static/console.html is missing"}}, status_code=404
    )


def _lifespan(
    state: AppState, hub: Hub, load: Callable[[], Coroutine[None, None, None]]
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """Start-up (the hub's sessions, the topology, `load` in the background) and the orderly stop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        hub.sessions.start()
        state.topology.start()  # clustered: pings Redis from now on (/ready says why not while down)
        loader = asyncio.create_task(load())
        try:
            yield
        finally:
            state.mark_stopping()
            loader.cancel()
            with contextlib.suppress(BaseException):
                await loader
            await hub.close_all()
            await hub.sessions.stop()
            await state.topology.stop()
            for backend in list(state.backends.values()):
                await backend.stop()

    return lifespan


def _routes(hub: Hub) -> list[BaseRoute]:
    """Every route: operations, the WebSocket doors, the HTTP API, the static pages."""
    routes: list[BaseRoute] = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/protocol.schema.json", lambda request: JSONResponse(protocol_schema())),
        Route("/v1/http.schema.json", lambda request: JSONResponse(http_schema())),
        Route("/v1/console.schema.json", lambda request: JSONResponse(console_schema())),
        WebSocketRoute("/ws", hub.endpoint),
        WebSocketRoute("/ws/console", hub.console.endpoint),
        Route("/console", console_page),
    ]
    routes += [Route(path, http_api.api(fn), methods=methods) for path, fn, methods in http_api.ROUTES]
    routes.append(Route("/", index))
    if STATIC_DIR.is_dir():
        routes.append(Mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static"))
    return routes


def _hub(state: AppState, admission: Admission) -> Hub:
    """The /ws hub and the agents' console it feeds: the console hears every session event."""
    hub = Hub(state, admission)
    hub.console = ConsoleHub(state, hub.sessions, hub.store, state.topology)
    hub.events.subscribe(hub.console.on_event)
    return hub


def create_app(
    settings: Settings,
    loaded_model_factory: ModelFactory | None = None,
    *,
    engine_factory: EngineFactory | None = None,
    registry_factory: RegistryFactory | None = None,
    on_load_failed: Callable[[str], None] | None = None,
) -> Starlette:
    """The app. `loaded_model_factory()` returns a LoadedModel (default: load per settings.model;
    when no work runs locally only its tokenizer is used); `engine_factory(loaded, settings)` and
    `registry_factory(settings, tokenizer)` are for tests; `on_load_failed(message)` is called when
    start-up fails (`rtserver serve` exits then)."""
    state = AppState(settings, Clustered(settings) if settings.cluster.redis_url else Alone(settings))
    admission = Admission(state)
    hub = _hub(state, admission)
    model_factory = loaded_model_factory or _default_model_factory(settings)
    tokenizer_factory = _default_tokenizer_factory(settings)
    if loaded_model_factory is not None:
        given = loaded_model_factory

        def tokenizer_factory() -> tuple[str, Tokenizer]:
            loaded = given()
            return loaded.name, loaded.tokenizer

    load = functools.partial(
        _load,
        state,
        model_factory,
        tokenizer_factory,
        engine_factory or _default_engine_factory,
        registry_factory or _default_registry_factory,
        on_load_failed,
    )
    routes = _routes(hub)
    if CLIENT_FAULTS not in logging.getLogger("uvicorn.error").filters:
        logging.getLogger("uvicorn.error").addFilter(CLIENT_FAULTS)
    middleware = [
        Middleware(SecurityHeaders),
        Middleware(TrustedHosts, server=settings.server, metrics=state.metrics),
        Middleware(SocketGate, admission=admission),
    ]
    app = Starlette(routes=routes, lifespan=_lifespan(state, hub, load), middleware=middleware)
    app.state.rt = state
    app.state.hub = hub
    app.state.admission = admission
    return app


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for uvicorn.run/uvicorn.Config that the hub's limits rely on."""
    return {
        "host": settings.server.host,
        "port": settings.server.port,
        "log_level": settings.server.log_level,
        "ws_max_size": transport_max_bytes(settings.server.max_frame_bytes),
        "lifespan": "on",
        "proxy_headers": True,
        "forwarded_allow_ips": settings.server.forwarded_allow_ips,
        "timeout_graceful_shutdown": settings.server.shutdown_grace_s + 5,
        # no limit_concurrency: it counted WebSockets and idle sockets and refused only HTTP (health
        # checks included); sockets are bounded by the request deadline and the fd budget instead
        "http": protocol_class(settings.server.request_timeout_s),
    }
