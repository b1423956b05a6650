"""Builds what serves requests: the engine (or, for a gateway whose engines run elsewhere, a frontend
with only the tokenizer) and the queue, from the settings. Shared by `sluice serve` and `sluice worker`."""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any

from gateway.queue.base import RequestQueue
from gateway.settings import ModelEntry, Settings, queue_prefix
from gateway.worker.engine_api import ModelFrontend, StepEngine

if TYPE_CHECKING:
    from engine import EmbeddingConfig, EngineConfig

__all__ = ["ModelFrontend", "freeze_long_lived_objects", "load_engine", "load_frontend", "make_queue"]

log = logging.getLogger("sluice.worker")


def _engine_config(settings: Settings, entry: ModelEntry | None = None) -> EngineConfig:
    from pydantic import TypeAdapter

    from engine import EngineConfig

    kw = settings.engine_kwargs() if entry is None else settings.chat_engine_kwargs(entry)
    return TypeAdapter(EngineConfig).validate_python(_known(EngineConfig, kw))


def _embedding_config(entry: ModelEntry) -> EmbeddingConfig:
    from pydantic import TypeAdapter

    from engine import EmbeddingConfig

    kw = {**entry.engine}
    kw.setdefault("model", entry.path)
    if entry.id is not None:
        kw.setdefault("served_model_name", entry.id)
    return TypeAdapter(EmbeddingConfig).validate_python(_known(EmbeddingConfig, kw))


def _known(config: type, kw: dict[str, Any]) -> dict[str, Any]:
    """`kw` when every key is a field of the dataclass `config`. Pydantic would drop an unknown key (a typo,
    an option since renamed) without a word and the engine would start on its default instead: refuse it,
    naming the key, so the model's load error (/ready, the log) says what to fix."""
    from dataclasses import fields

    from engine import EngineConfigError

    unknown = sorted(set(kw) - {f.name for f in fields(config)})
    if unknown:
        raise EngineConfigError(f"unknown {config.__name__} option(s) {', '.join(unknown)} (from the [engine] "
                                "section, a model's engine table or SLUICE_ENGINE__* variables)")
    return kw


def load_engine(settings: Settings, entry: ModelEntry | None = None) -> StepEngine:
    """Build one model's engine from settings (slow: loads weights): the chat engine of `entry` (default:
    the first chat model), or its embedding engine. Imports torch, so callers set OMP first."""
    from engine import EmbeddingEngine, LLMEngine

    built: StepEngine
    if entry is not None and entry.kind == "embedding":
        built = EmbeddingEngine(_embedding_config(entry))
    else:
        built = LLMEngine(_engine_config(settings, entry))
    freeze_long_lived_objects()
    return built


def load_frontend(settings: Settings, entry: ModelEntry | None = None) -> Any:
    """One model's tokenizer, name and limits without its weights (gateway only, `--no-engine`):
    `engine.load_frontend` (chat) or `engine.load_embedding_frontend` with the engines' configuration."""
    from engine import load_embedding_frontend
    from engine import load_frontend as load

    frontend: Any = (load_embedding_frontend(_embedding_config(entry)) if entry is not None
                     and entry.kind == "embedding" else load(_engine_config(settings, entry)))
    freeze_long_lived_objects()
    return frontend


def freeze_long_lived_objects() -> None:
    """Once the engine (torch, weights, tokenizer) is loaded, move its millions of long-lived objects out
    of the cyclic GC's reach: otherwise each older-generation collection walks them all, which measured
    2-4x the CPU per relayed request."""
    gc.collect()
    gc.freeze()


def make_queue(settings: Settings, entry: ModelEntry | None = None, *, first_chat: bool = True) -> RequestQueue:
    """One model's queue: the Redis queue when `redis_url` is set (the first chat model's under the
    deployment's key prefix, every other model's beneath it: settings.queue_prefix), else in-process."""
    from gateway.queue.memory import MemoryQueue

    q = settings.queue
    max_depth = dict(entry.max_depth) if entry is not None and entry.max_depth is not None else dict(q.max_depth)
    kw: dict[str, Any] = dict(max_depth=max_depth, fill_target=q.fill_target, max_wait_ms=q.max_wait_ms,
                              aging_s=q.aging_s)
    if settings.redis_url:
        from gateway.queue.redis import RedisQueue

        prefix = q.key_prefix if entry is None else queue_prefix(q.key_prefix, entry, first_chat)
        return RedisQueue(settings.redis_url, prefix=prefix, lease_s=q.lease_s, result_ttl_s=q.result_ttl_s,
                          heartbeat_ttl_s=5 * q.heartbeat_s, **kw)
    return MemoryQueue(**kw)
