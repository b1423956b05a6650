"""The Backend interface: a validated, tokenized request in, a stream of per-choice outputs out.

The HTTP layer only knows this interface, so a remote OpenAI-compatible provider can be added as
another Backend without touching handlers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any
from engine.request import RequestOutput, SamplingParams


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    n: int = 1
    tier: str = "standard"
    priority: int = 1
    deadline: float | None = None
    # For routing and remote providers (the router needs the request as the client sent it):
    model: str = ""  # the model id the client asked for
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completion" (/v1/completions)
    api: Any = None  # the validated OpenAI request (ChatCompletionRequest / CompletionRequest)
    key: str | None = None  # the API key's name (never the key), for limits and usage
    # Prefix-cache isolation: the engine shares cached prompt blocks only between requests with the
    # same salt (derived from the key, tier and client `cache_salt`; see gateway.config.cache_salt).
    cache_salt: str | None = None


@dataclass
class ChoiceOutput:
    """One engine output tagged with the choice index it belongs to (0..n-1)."""

    index: int
    output: RequestOutput


class ChoiceStream(ABC):
    """Outputs of a submitted request until every choice finished.

    `aclose()` must always be called (use `async with`): on an unfinished stream it cancels the request.
    `backend` says where it is served (`local` or `remote:<provider>`; known once the first output
    arrived); `prompt_tokens` is the provider's prompt count when remote (None: the local count).
    """

    backend: str = "local"
    prompt_tokens: int | None = None

    def __aiter__(self) -> "ChoiceStream":
        return self

    @abstractmethod
    async def __anext__(self) -> ChoiceOutput: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> "ChoiceStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Backend(ABC):
    name: str = "backend"

    @abstractmethod
    async def submit(self, request: GenerationRequest) -> ChoiceStream:
        """Accept the request (raises QueueFull when it cannot be queued) and return its output stream.

        Accepting before streaming lets the handler answer 503 with a status code, not mid-stream.
        """

    async def ready(self) -> bool:
        return True
