"""Builds what serves requests: the engine (or, for a gateway whose engines run elsewhere, a frontend
with only the tokenizer) and the queue, from the settings. Shared by `sluice serve` and `sluice worker`."""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any

from gateway.queue.base import RequestQueue
from gateway.settings import Settings
from gateway.worker.engine_api import Engine, ModelFrontend

if TYPE_CHECKING:
    from engine import EngineConfig

__all__ = ["ModelFrontend", "freeze_long_lived_objects", "load_engine", "load_frontend", "make_queue"]

log = logging.getLogger("sluice.worker")


def _engine_config(settings: Settings) -> EngineConfig:
    from pydantic import TypeAdapter

    from engine import EngineConfig

    return TypeAdapter(EngineConfig).validate_python(settings.engine_kwargs())


def load_engine(settings: Settings) -> Engine:
    """Build the engine from settings (slow: loads weights). Imports torch, so callers set OMP first."""
    from engine import LLMEngine

    engine = LLMEngine(_engine_config(settings))
    freeze_long_lived_objects()
    return engine


def load_frontend(settings: Settings) -> ModelFrontend:
    """The model's tokenizer, name, context and output caps without its weights (gateway only,
    `--no-engine`): `engine.load_frontend` with the engines' configuration."""
    from engine import load_frontend as load

    frontend = load(_engine_config(settings))
    freeze_long_lived_objects()
    return frontend


def freeze_long_lived_objects() -> None:
    """Once the engine (torch, weights, tokenizer) is loaded, move its millions of long-lived objects out
    of the cyclic GC's reach: otherwise each older-generation collection walks them all, which measured
    2-4x the CPU per relayed request."""
    gc.collect()
    gc.freeze()


def make_queue(settings: Settings) -> RequestQueue:
    """The Redis queue when `redis_url` is set, else the in-process one."""
    from gateway.queue.memory import MemoryQueue

    q = settings.queue
    kw: dict[str, Any] = dict(max_depth=dict(q.max_depth), fill_target=q.fill_target, max_wait_ms=q.max_wait_ms,
                              aging_s=q.aging_s)
    if settings.redis_url:
        from gateway.queue.redis import RedisQueue

        return RedisQueue(settings.redis_url, prefix=q.key_prefix, lease_s=q.lease_s, result_ttl_s=q.result_ttl_s,
                          heartbeat_ttl_s=5 * q.heartbeat_s, **kw)
    return MemoryQueue(**kw)
