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
from gateway.backends.remote.backend import RemoteBackend
from gateway.messages import WorkerStats
from gateway.observability.metrics import Metrics
from gateway.openai.logprobs import TokenPieces
from gateway.queue.base import RequestQueue
from gateway.routing.router import Router
from gateway.settings import Settings
from gateway.worker.factory import ModelFrontend
from gateway.worker.worker import EngineWorker


@dataclass
class GatewayState:
    settings: Settings
    keys: KeyStore
    queue: RequestQueue
    metrics: Metrics
    limiter: Limiter
    usage: UsageStore
    remote: RemoteBackend | None
    router: Router | None = None  # set right after construction (it needs this object as its LocalSide)
    # The model: the engine itself, or (gateway only) a frontend with its tokenizer; None while loading.
    engine: ModelFrontend | None = None
    local_worker: EngineWorker | None = None  # the embedded engine worker (not with --no-engine)
    remote_workers: list[WorkerStats] | None = None  # live `sluice worker`s of this model (Redis queue)
    model_name: str | None = None
    max_model_len: int = 0
    load_error: str | None = None
    no_engine: bool = False  # gateway only: engine workers run elsewhere (`sluice worker`, Redis queue)
    draining: bool = False  # SIGTERM received: new requests get 503 + Retry-After
    created: int = field(default_factory=lambda: int(time.time()))
    token_pieces: TokenPieces | None = None  # token id -> text and bytes, for logprobs (built on first use)

    @property
    def ready(self) -> bool:
        if self.draining or self.engine is None:
            return False
        if self.no_engine:
            return bool(self.remote_workers)
        return self.local_worker is not None and self.local_worker.running

    # ---- the router's view of the local side (routing.capacity.LocalSide)

    def local_ready(self) -> bool:
        return self.ready

    def local_model(self) -> str | None:
        return self.model_name

    def worker_stats(self) -> list[WorkerStats]:
        if self.local_worker is not None:
            return [self.local_worker.stats()]
        return list(self.remote_workers or [])


STATE: web.AppKey[GatewayState] = web.AppKey("sluice_state", GatewayState)
