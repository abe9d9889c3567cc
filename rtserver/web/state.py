"""What the front doors share (`AppState`): settings, the load status and its readiness
(`readiness.py`), the inference backends and the task registry once loaded (and which backend runs which
task), metrics, the per-client-IP rate limiter, the topology (alone or clustered: `seams.py`), and the
shutdown flag. The app builds it; the hub, the console and the HTTP API read it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from ..config import Settings
from ..engine.backend import InferenceBackend
from ..tasks.registry import PluginError, TaskRegistry
from ..tasks.source_kv import SourceWarmer
from .metrics import Counts, LiveFigures, Metrics
from .readiness import RETRY, Readiness, Status, assess
from .seams import Alone, Topology

if TYPE_CHECKING:
    from ..remote.backend import RemoteStats

log = logging.getLogger("rtserver.app")


class NotReady(Exception):
    """The backend or the tasks are not loaded (yet, or start-up failed)."""

    code = "not_ready"

    def __init__(self, status: Status):
        self.message = f"the model is {status}; {RETRY}"
        super().__init__(self.message)


class AppState:
    def __init__(self, settings: Settings, topology: Topology | None = None):
        self.settings = settings
        self.status: Status = "loading"  # set by mark_ready, mark_failed and mark_stopping
        self.stage = "starting"
        self.progress = 0.0
        self.error: str | None = None
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.ready_after_s: float | None = None
        self.model_name: str | None = None
        # "local" (the in-process engine) and/or "openai" (remote servers), as the settings need them
        self.backends: dict[str, InferenceBackend] = {}
        self.registry: TaskRegistry | None = None
        self.load_errors: list[PluginError] = []
        self.source_warmer: SourceWarmer | None = None  # with knowledge on: sources computed ahead
        self.shutting_down = False  # set by the hub's drain: new requests are refused
        # alone (everything in memory) or many nodes as one (rtserver/web/cluster/), chosen by the app
        self.topology: Topology = topology or Alone(settings)
        self.ip_limiter = self.topology.limits.ip_limiter
        # connection and session counts for /metrics, supplied by the hub once it exists
        self.counts: Callable[[], Counts] = lambda: {"connections": 0, "sessions": 0}
        self.metrics = Metrics(self.live_metrics)

    async def ip_take(self, ip: str) -> float:
        """A token from the client IP's bucket (WebSocket messages and HTTP requests), one bucket across
        the nodes when clustered. 0.0 = allowed, else seconds to wait."""
        return await self.topology.limits.take_ip(ip)

    def readiness(self) -> Readiness:
        """Whether requests can be served now and why not: what every front door reads."""
        return assess(self.status, self.error, self.backends, self.topology.down_reason(), self.shutting_down)

    def mark_ready(self) -> None:
        self.ready_after_s = time.monotonic() - self.started
        self.status = "ready"

    def mark_failed(self, error: str) -> None:
        self.error, self.status = error, "failed"

    def mark_stopping(self) -> None:
        """A ready server stops; one still loading or failed keeps saying so."""
        if self.status == "ready":
            self.status = "stopping"

    def backends_needed(self) -> set[str]:
        """The backends the settings place work on: the chat's, and each task's `backend`."""
        needed = {self.settings.model.backend, self.settings.chat.backend or self.settings.model.backend}
        for table in self.settings.task.values():
            if isinstance(table, dict) and isinstance(table.get("backend"), str):
                needed.add(table["backend"])
        return needed

    def backend_for(self, task: str) -> InferenceBackend:
        """The backend that runs `task` (its `[task.<name>] backend`, else `model.backend`)."""
        if self.status != "ready":
            raise NotReady(self.status)
        name = self.tasks.placement(task) or self.settings.model.backend
        return self.backends[name]

    @property
    def backend(self) -> InferenceBackend:
        """The backend of chat replies and the OpenAI endpoints (`chat.backend`, else `model.backend`)."""
        if self.status != "ready":
            raise NotReady(self.status)
        return self.backends[self.settings.chat.backend or self.settings.model.backend]

    def backends_health(self) -> dict[str, Any]:
        return {name: backend.health() for name, backend in self.backends.items()}

    @property
    def tasks(self) -> TaskRegistry:
        if self.registry is None:
            raise NotReady(self.status)
        return self.registry

    @property
    def model_id(self) -> str:
        return self.model_name or self.settings.model.model

    def set_stage(self, stage: str, progress: float) -> None:
        self.stage, self.progress = stage, progress
        log.info("startup: %s (%.0f%%)", stage, progress * 100)

    def head_states(self) -> dict[str, dict[str, str]]:
        """Per task with a learned head: whether it scores with it or by labels, and why."""
        return self.registry.head_states() if self.registry is not None else {}

    def live_metrics(self) -> LiveFigures:
        counts = self.counts()
        out: LiveFigures = {
            "connections": counts["connections"],
            "sessions": counts["sessions"],
            "ready": self.readiness().ready,
        }
        for name, backend in self.backends.items():
            try:
                stats = backend.stats()
            except Exception:
                log.exception("%s backend stats failed", name)
                continue
            if name == "local":
                out["engine"] = stats
            else:  # the "openai" backend is a RemoteBackend
                out["openai"] = cast("RemoteStats", stats)
        if self.registry is not None:
            out["task_cache"] = self.registry.cache_stats()
        cluster = self.topology.figures()
        if cluster is not None:
            out["cluster"] = cluster
        return out
