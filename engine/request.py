"""The engine's public messages: what goes in (`EngineRequest`) and what comes out (`RequestOutput`).

These are the only types the gateway and the workers exchange with the engine, so they are plain
dataclasses with no behaviour: they must survive a trip through a queue (see `to_dict`/`from_dict`).
The engine knows nothing of tiers or HTTP; a request's `priority` is just a number (lower runs first).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]
GuideKind = Literal["json_schema", "json_object", "lark", "regex"]
GUIDE_KINDS: tuple[GuideKind, ...] = ("json_schema", "json_object", "lark", "regex")
MAX_LOGPROBS = 20


@dataclass
class Guide:
    """Constrained decoding: every sampled token keeps the output a prefix of the grammar's language.

    `spec`: the JSON schema's text (json_schema), "" (json_object: any JSON object), a Lark grammar
    (lark, llguidance's dialect) or a regular expression (regex). A guided sequence finishes with "stop"
    once the grammar is complete."""

    kind: GuideKind
    spec: str = ""


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the `top` alternatives (most likely first).

    Values come from the distribution the token was sampled from (after logit_bias, penalties, the
    grammar mask, temperature and top-k/top-p), in float32; a token that distribution excludes has
    -9999.0 (OpenAI's floor), so every value is finite JSON."""

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


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
    # OpenAI: logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0), counting the
    # generated tokens only (resumed ones included), before temperature.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM / Hugging Face: over prompt and generated tokens, positive logits are divided by it, negative
    # ones multiplied.
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # the stop tokens (eos included) cannot be sampled before this many outputs
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    logprobs: int | None = None  # None: none; k in 0..20: the sampled token's logprob and the top k
    guide: Guide | None = None

    def __post_init__(self) -> None:
        # Through JSON (the Redis queue) the bias's keys arrive as strings and the guide as a dict.
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.guide, dict):
            self.guide = Guide(**self.guide)

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
        # `not lo <= x <= hi` also refuses NaN.
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if any(not 0 <= t < 2**31 for t in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.guide is not None and self.guide.kind not in GUIDE_KINDS:
            raise ValueError(f"guide kind must be one of {', '.join(GUIDE_KINDS)}")
        if self.guide is not None and not isinstance(self.guide.spec, str):
            raise ValueError("guide spec must be a string")


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
    # Set when the request itself is at fault (its grammar failed to compile or exhausted its limits):
    # an OpenAI error code such as `invalid_grammar` and the field it names; the gateway answers 400.
    # Unset on an error, the engine failed (500).
    error_code: str | None = None
    error_param: str | None = None
    # When the request asked for logprobs: one per token of `token_ids`, in order (None otherwise).
    logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        # Rebuilt from plain dicts (JSON), however the output was constructed (`from_dict` or `cls(**d)`).
        if self.logprobs is not None:
            self.logprobs = [TokenLogprob(**lp) if isinstance(lp, dict) else lp for lp in self.logprobs]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestOutput:
        return cls(**d)


def finite_logprob(x: float) -> float:
    """A logprob JSON can carry: -inf (and NaN) become OpenAI's floor of -9999.0."""
    return x if not math.isnan(x) and x > -9999.0 else -9999.0


class RequestRejected(ValueError):
    """The engine cannot take this request (for example its prompt exceeds the context).

    `code` is an OpenAI error code such as `context_length_exceeded`; callers map it to a 400.
    """

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param
