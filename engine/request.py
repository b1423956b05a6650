"""The engine's public messages: what goes in (`EngineRequest`) and what comes out (`RequestOutput`).

These are the only types the gateway and the workers exchange with the engine, so they are plain
dataclasses with no behaviour: they must survive a trip through a queue (see `to_dict`/`from_dict`).
The engine knows nothing of tiers or HTTP; a request's `priority` is just a number (lower runs first).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or less: no top-k cut
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)  # never emitted, even when split across tokens
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # same seed, same output
    ignore_eos: bool = False

    def validate(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        # Everything below reaches int64 tensors or torch.Generator: out of range would fail a whole step.
        if not -(2**31) <= self.top_k < 2**31:
            raise ValueError("top_k must fit in 32 bits (0 or -1: off)")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError("seed must fit in 64 bits")
        if any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids")


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower is served first (the gateway maps tiers onto it)
    arrival_time: float = field(default_factory=time.time)
    # Tokens this request already produced elsewhere (a retried request resumes after them; they
    # count against max_tokens and are never re-emitted).
    resume_token_ids: list[int] = field(default_factory=list)
    # Prefix-cache isolation: requests share cached prompt blocks only with requests of the same salt
    # (an opaque string; the gateway derives it from the API key, tier or a client's `cache_salt`).
    cache_salt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineRequest:
        d = dict(d)
        d["sampling"] = SamplingParams(**d.get("sampling", {}))
        return cls(**d)


@dataclass
class RequestOutput:
    """One step's worth of news about one request: a text delta and the token ids behind it."""

    request_id: str
    text: str = ""  # the new text since the previous output (stop strings already cut away)
    token_ids: list[int] = field(default_factory=list)  # the new token ids since the previous output
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestOutput:
        return cls(**d)


class RequestRejected(ValueError):
    """The engine cannot take this request (for example its prompt exceeds the context).

    `code` is an OpenAI error code such as `context_length_exceeded`; callers map it to a 400.
    """

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param
