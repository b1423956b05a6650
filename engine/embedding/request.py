"""The embedding engine's messages: what goes in (`EmbeddingRequest`) and what comes out (`EmbeddingOutput`).

Plain dataclasses that survive a trip through a queue (`to_dict` / `from_dict`), like the chat engine's.
A request carries token ids, not text: the caller tokenizes (`EmbeddingEngine.tokenize`) so that it
can count and refuse inputs before they queue, and so that OpenAI's token-id inputs need no detour.
`priority` is just a number, lower runs first, as for chat requests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EmbeddingRequest:
    request_id: str
    # Each input's token ids, as the model sees them: framed by the tokenizer's special tokens
    # ([CLS] ... [SEP] for BERT), which EmbeddingEngine.tokenize adds.
    inputs: list[list[int]]
    priority: int = 0  # lower is served first (the gateway maps tiers onto it)
    # An input longer than the model's max_seq_length: cut to it (keeping the special tokens) when
    # true, else the request is refused.
    truncate: bool = False
    dimensions: int | None = None  # only for models that support shortened vectors (else refused)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EmbeddingRequest:
        return cls(**d)


@dataclass
class EmbeddingOutput:
    """One input's vector (`index` is its place in the request's `inputs`), sent as soon as its step
    ran: a request's vectors may come over several steps, in any order. The request's last output
    has `finished`. A request that failed inside the engine gets one output with `error` set,
    `index` -1 and no vector, finished."""

    request_id: str
    index: int
    embedding: list[float] = field(default_factory=list)  # float32 values; unit length when the model normalises
    prompt_tokens: int = 0  # this input's tokens, as embedded (after truncation, special tokens included)
    finished: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EmbeddingOutput:
        return cls(**d)
