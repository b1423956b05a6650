"""What the router sees of the local side: is an engine worker ready, which model it serves, and the
stats of every engine worker (the embedded one, or the live ones behind the Redis queue)."""

from __future__ import annotations

from typing import Protocol

from gateway.messages import WorkerStats


class LocalSide(Protocol):
    def local_ready(self) -> bool:
        """An engine worker is up (the embedded one runs, or live workers' heartbeats exist)."""
        ...

    def local_model(self) -> str | None:
        """The model the local engines serve (None while loading)."""
        ...

    def worker_stats(self) -> list[WorkerStats]:
        """Every local engine worker's stats (empty when none is known)."""
        ...
