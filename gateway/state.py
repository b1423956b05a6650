"""The gateway's shared state, typed, with the aiohttp key to reach it. Built once by
`gateway.http.app.create_app`; every component it holds gets its dependencies explicitly, so nothing
but the HTTP layer (its handlers and lifecycle hooks) reads this object: only http/ sits above it
(tests/test_architecture.py keeps the floors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from gateway.admission.keys import KeyStore
from gateway.admission.limits import Limiter
from gateway.admission.usage import UsageStore
from gateway.backends.pool.backend import PoolBackend
from gateway.backends.remote.backend import RemoteBackend
from gateway.messages import WorkerStats
from gateway.observability.dashboard import ModelView
from gateway.observability.metrics import Metrics
from gateway.queue.base import RequestQueue
from gateway.routing.embeddings import EmbeddingRouter
from gateway.routing.router import Router
from gateway.settings import Settings
from gateway.worker.engine_api import ModelFrontend
from gateway.worker.pool import ModelPool
from gateway.worker.worker import EngineWorker


@dataclass
class GatewayState:
    settings: Settings
    keys: KeyStore
    metrics: Metrics
    limiter: Limiter
    usage: UsageStore
    remote: RemoteBackend | None
    engines: PoolBackend | None = None  # the engine replicas ([[engines]])
    pools: list[ModelPool] = field(default_factory=list)  # one per served model, in the config's order
    router: Router | None = None  # remote-only chat models' router; every pool has its own for its model
    embedding_router: EmbeddingRouter | None = None  # remote-only embedding models' router
    no_engine: bool = False  # gateway only: engine workers run elsewhere (`sluice worker`, Redis queue)
    draining: bool = False  # SIGTERM received: new requests get 503 + Retry-After
    idle_queue: RequestQueue | None = None  # with no local model: the never-ready local side's queue
    created: int = field(default_factory=lambda: int(time.time()))

    def pool_for(self, model: str) -> ModelPool | None:
        """The pool serving `model` (its id or an alias), or None."""
        for p in self.pools:
            if model in p.names:
                return p
        return None

    @property
    def chat(self) -> ModelPool | None:
        """The first chat model's pool: what the dashboard and /ready headline, and the default model."""
        return next((p for p in self.pools if p.kind == "chat"), None)

    # ---- the first chat model's pool, by the names the single-model gateway had

    @property
    def queue(self) -> RequestQueue:
        if self.chat is not None:
            return self.chat.queue
        if self.pools:
            return self.pools[0].queue
        assert self.idle_queue is not None
        return self.idle_queue

    @property
    def engine(self) -> ModelFrontend | None:
        return self.chat.engine if self.chat is not None else None

    @property
    def model_name(self) -> str | None:
        return self.chat.model_name if self.chat is not None else None

    @property
    def max_model_len(self) -> int:
        return self.chat.max_model_len if self.chat is not None else 0

    @property
    def local_worker(self) -> EngineWorker | None:
        return self.chat.local_worker if self.chat is not None else None

    @property
    def load_error(self) -> str | None:
        return self.chat.load_error if self.chat is not None else None

    @property
    def ready(self) -> bool:
        """Every local model is ready (a gateway serving only remote models is ready unless draining)."""
        return not self.draining and all(p.ready for p in self.pools)

    def model_views(self) -> list[ModelView]:
        """Every local model, for the dashboard."""
        return [ModelView(p.model_name or p.entry.id or f"({p.kind})", p.kind, p.ready, p.worker_stats())
                for p in self.pools]

    def worker_stats(self) -> list[WorkerStats]:
        """The first chat model's engine workers (what the dashboard's engine panel shows)."""
        return self.chat.worker_stats() if self.chat is not None else []


STATE: web.AppKey[GatewayState] = web.AppKey("sluice_state", GatewayState)
