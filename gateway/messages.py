"""The typed things that cross the gateway's modules: a generation request on its way to a backend
(with its target: the local engine may serve it, or only a remote provider), the per-choice outputs
coming back, failures (by kind, never by HTTP status: the HTTP layer maps a kind to a status), worker
stats (the heartbeat's schema) and the commands a worker's engine thread takes.

Outputs and stats travel through Redis, so each has a `to_dict`/`from_dict` pair.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from engine import EmbeddingOutput, EmbeddingRequest, EngineRequest, RequestOutput, SamplingParams
from gateway.errors import Failure
from gateway.settings import ProviderSettings

if TYPE_CHECKING:
    from gateway.openai.schema import ChatCompletionRequest, CompletionRequest

    OpenAIRequest = ChatCompletionRequest | CompletionRequest

LOCAL = "local"


class Target(enum.Enum):
    """Where a request may be served, decided when it is prepared."""

    LOCAL = "local"  # tokenized here: the local engine may serve it (the router may still send it to a provider)
    RELAY = "relay"  # not tokenized: only a remote provider may serve it, relayed as the client sent it (`api`)


@dataclass
class GenerationRequest:
    """A validated request, as every backend takes it: tokenized with the engine's sampling parameters
    (target LOCAL), or the client's request to relay (target RELAY: no tokens, no engine parameters)."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None
    target: Target = Target.LOCAL
    n: int = 1
    tier: str = "standard"
    priority: int = 1
    deadline: float | None = None  # wall-clock time after which a still-queued request is dropped (504)
    model: str = ""  # the model id the client asked for
    endpoint: Literal["chat", "completion"] = "chat"
    api: OpenAIRequest | None = None  # the request as the client sent it (remote providers relay it)
    key: str | None = None  # the API key's name (never the key), for limits and usage
    # Prefix-cache isolation: an opaque salt mixed into the first KV block's hash (see settings.cache_salt).
    cache_salt: str | None = None
    # A relay's reason when the local model cannot serve it: the field it cannot serve (e.g. an image part).
    needs_remote: str | None = None
    batch: bool = False  # a Batch API line: priced at the batch price, and not charged when taken back

    def __post_init__(self) -> None:
        if self.target is Target.LOCAL and self.sampling is None:
            raise ValueError(f"{self.request_id}: a request the local engine may serve needs its sampling parameters")


@dataclass
class EmbeddingJob:
    """A validated `/v1/embeddings` request, as the embedding router takes it: tokenized here (target
    LOCAL: `inputs`, the local engine may serve it) or to relay as the client sent it (RELAY: `body`)."""

    request_id: str
    model: str  # the served id (an alias resolved) of a local model, else the name the client sent
    inputs: list[list[int]] = field(default_factory=list)
    target: Target = Target.LOCAL
    body: dict[str, Any] = field(default_factory=dict)  # the client's request (remote providers get it)
    truncate: bool = False
    dimensions: int | None = None
    tier: str = "standard"
    priority: int = 1
    deadline: float | None = None  # wall-clock time after which a still-queued request is dropped (504)
    key: str | None = None  # the API key's name (never the key), for limits and usage
    size_bytes: int = 0  # the request body's size: bounds the prompt tokens a provider may count
    batch: bool = False  # a Batch API line: priced at the batch price

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


@dataclass
class EmbeddingResult:
    """The answer to an `EmbeddingJob`: the vectors in input order (local) or the provider's body (remote,
    already in the encoding the client asked for), with what the answer is accounted by."""

    backend: str  # `local` or `remote:<provider>` (the x-sluice-backend header)
    prompt_tokens: int
    vectors: list[list[float]] | None = None  # local
    body: dict[str, Any] | None = None  # remote: the provider's answer
    provider: ProviderSettings | None = None  # remote: prices it


@dataclass
class ChoiceOutput:
    """One output tagged with the choice index it belongs to (0..n-1)."""

    index: int
    output: RequestOutput


@dataclass
class ErrorOutput(RequestOutput):
    """A finished output that says what kind of failure ended it (the HTTP layer maps it to a status)."""

    failure: Failure = Failure.ENGINE


def error_output(request_id: str, failure: Failure, code: str, message: str, *, param: str | None = None,
                 prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0) -> ErrorOutput:
    return ErrorOutput(request_id=request_id, finished=True, finish_reason="error", error=message,
                       error_code=code, error_param=param, failure=failure, prompt_tokens=prompt_tokens,
                       completion_tokens=completion_tokens, cached_tokens=cached_tokens)


def queue_timeout_output(request_id: str) -> ErrorOutput:
    """The result of a request that waited in the queue past its deadline."""
    return error_output(request_id, Failure.TIMED_OUT, "queue_timeout",
                        "the request waited in the queue past its deadline")


def is_failure(out: RequestOutput) -> bool:
    """An output that ends its request without a proper finish (error or abort)."""
    return out.finish_reason in ("error", "abort") or out.error is not None


# What a queue carries back to the gateway: a chat engine's output (or an error ending any request), or
# an embedding engine's vector.
AnyOutput = RequestOutput | EmbeddingOutput


def output_to_dict(out: AnyOutput) -> dict[str, Any]:
    d = asdict(out)
    if isinstance(out, EmbeddingOutput):
        d["_kind"] = "embedding"
    elif isinstance(out, ErrorOutput):
        d["_kind"] = "error"
        d["failure"] = out.failure.value
    return d


def output_from_dict(d: dict[str, Any]) -> AnyOutput:
    d = dict(d)
    kind = d.pop("_kind", "output")
    if kind == "embedding":
        return EmbeddingOutput.from_dict(d)
    if kind == "error":
        d["failure"] = Failure(d.get("failure", Failure.ENGINE.value))
        return ErrorOutput(**d)
    return RequestOutput(**d)


@dataclass
class WorkerStats:
    """What an engine worker reports about itself: in /ready, in its Redis heartbeat, to the router."""

    model: str | None = None
    capacity: int = 0  # requests it can run at once
    in_flight: int = 0  # requests handed to it and not finished
    background: int = 0  # of those, at a priority beyond every tier's (Batch API lines)
    running: int = 0  # the engine's running batch
    waiting: int = 0  # admitted to the engine, waiting for KV memory
    steps: int = 0
    step_errors: int = 0
    busy_seconds: float | None = None  # seconds spent inside engine steps (the busy ratio)
    kv_usage: float | None = None  # the share of the engine's KV pool that running requests hold
    # Chat engines: prompt tokens admitted and not yet prefilled, and tokens prefilled so far (the rate at
    # which that work drains: what the router's time-to-first-token estimate reads).
    prefill_pending: int | None = None
    prefill_tokens: int | None = None
    # Embedding engines: tokens of the inputs not yet embedded, by priority ("0": pro's), and tokens
    # embedded so far (with busy_seconds: the throughput); what the embedding router's wait estimate reads.
    pending_tokens: dict[str, int] | None = None
    tokens: int | None = None
    draining: bool = False
    worker_id: str | None = None  # set by the Redis queue on heartbeats

    @property
    def free_slots(self) -> int:
        return 0 if self.draining else max(0, self.capacity - self.in_flight)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerStats:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class QueueItem:
    """One engine request waiting in (or pulled from) a queue, with what the queue needs to order it: a
    chat engine's request, or an embedding engine's (each model has its own queue)."""

    request: EngineRequest | EmbeddingRequest
    tier: str
    enqueued_at: float = field(default_factory=time.time)
    deadline: float | None = None  # wall-clock time after which the request is no longer wanted
    key: str | None = None  # the API key's name: keys of one tier share the engine fairly (queue/fair.py)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> int:
        return self.request.priority

    def to_dict(self) -> dict[str, Any]:
        d = {"request": self.request.to_dict(), "tier": self.tier, "enqueued_at": self.enqueued_at,
             "deadline": self.deadline, "key": self.key}
        if isinstance(self.request, EmbeddingRequest):
            d["kind"] = "embedding"
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QueueItem:
        kind = EmbeddingRequest if d.get("kind") == "embedding" else EngineRequest
        return cls(request=kind.from_dict(d["request"]), tier=d["tier"],
                   enqueued_at=d["enqueued_at"], deadline=d.get("deadline"), key=d.get("key"))


@dataclass
class AddRequest:
    """Worker inbox: start this queue item on the engine."""

    item: QueueItem


@dataclass
class AbortRequest:
    """Worker inbox: stop this request (client gone, reclaimed, revoked)."""

    request_id: str


InboxMessage = AddRequest | AbortRequest

__all__ = ["LOCAL", "AbortRequest", "AddRequest", "AnyOutput", "ChoiceOutput", "EmbeddingJob", "EmbeddingResult",
           "ErrorOutput", "GenerationRequest", "InboxMessage", "QueueItem", "Target", "WorkerStats", "error_output",
           "is_failure", "output_from_dict", "output_to_dict", "queue_timeout_output"]
