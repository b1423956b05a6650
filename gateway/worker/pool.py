"""One served model's local side: its queue, its engine (or, for a gateway whose engines run elsewhere,
its frontend) and the workers that drain the queue. A gateway holds one `ModelPool` per model it serves
(`[[models]]`), so a request goes to the pool of the model it names, and each pool is what the router
sees as that model's local side (routing.capacity.LocalSide)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.messages import WorkerStats
from gateway.queue.base import RequestQueue
from gateway.settings import ModelEntry
from gateway.worker.worker import EngineWorker


@dataclass
class ModelPool:
    entry: ModelEntry
    queue: RequestQueue
    no_engine: bool = False  # its engines are `sluice worker --model ID`s behind the Redis queue
    # The engine itself (embedded), or a frontend with its tokenizer (--no-engine); None while loading.
    # Chat: a worker.engine_api.ModelFrontend; embedding: a worker.engine_api.EmbeddingModel.
    engine: Any = None
    local_worker: EngineWorker | None = None
    remote_workers: list[WorkerStats] | None = None  # live `sluice worker`s of this model (Redis queue)
    model_name: str | None = None  # the served id, once known (the engine's name when `id` is unset)
    max_model_len: int = 0  # chat: the context; embedding: the longest input
    load_error: str | None = None
    token_pieces: Any = None  # chat: token id -> text and bytes, for logprobs (built on first use)
    router: Any = None  # this model's router (routing.router.Router), set when the app is built
    is_draining: Callable[[], bool] = field(default=lambda: False)

    @property
    def kind(self) -> str:
        return self.entry.kind

    @property
    def names(self) -> list[str]:
        """Every id that names this model: its served id, then its aliases."""
        return ([self.model_name] if self.model_name else []) + list(self.entry.aliases)

    @property
    def ready(self) -> bool:
        if self.is_draining() or self.engine is None:
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
