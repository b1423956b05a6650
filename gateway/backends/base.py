"""The Backend interface: a validated, tokenized request in, a stream of per-choice outputs out.

The HTTP layer and the router know only this interface; the local engine (through the queue) and the
remote provider chain both implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from gateway.messages import LOCAL, ChoiceOutput, GenerationRequest
from gateway.settings import ProviderSettings


class ChoiceStream(ABC):
    """Outputs of a submitted request until every choice finished.

    `aclose()` must always be called (use `async with`): on an unfinished stream it cancels the request.
    `backend` says where it is served (`local` or `remote:<provider>`, the `x-sluice-backend` header;
    known once the first output arrived); `prompt_tokens` is the provider's prompt count when remote
    (None: the local count); `provider_settings` prices a remote answer (None when served locally).
    """

    @property
    def backend(self) -> str:
        return LOCAL

    @property
    def prompt_tokens(self) -> int | None:
        return None

    @property
    def provider_settings(self) -> ProviderSettings | None:
        return None

    def __aiter__(self) -> ChoiceStream:
        return self

    @abstractmethod
    async def __anext__(self) -> ChoiceOutput: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    async def next_batch(self) -> list[ChoiceOutput]:
        """The outputs available now, at least one (StopAsyncIteration at the end). A stream that gets
        several per read (a remote SSE answer) returns them together, so the relay writes them at once."""
        return [await self.__anext__()]

    async def withdraw_if_queued(self) -> bool:
        """Take the request back if it still waits for an engine (the stream then ends with the queue's
        `queue_timeout` output); False when it runs already or the stream cannot (the default)."""
        return False

    async def __aenter__(self) -> ChoiceStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class WrappedStream(ChoiceStream):
    """A stream around another one (fallback, accounting): it reports where the inner one is served."""

    _inner: ChoiceStream

    @property
    def backend(self) -> str:
        return self._inner.backend

    @property
    def prompt_tokens(self) -> int | None:
        return self._inner.prompt_tokens

    @property
    def provider_settings(self) -> ProviderSettings | None:
        return self._inner.provider_settings


class Backend(ABC):
    @abstractmethod
    async def submit(self, request: GenerationRequest) -> ChoiceStream:
        """Accept the request (raises QueueFull when it cannot be queued) and return its output stream.

        Accepting before streaming lets the handler answer 503 with a status code, not mid-stream.
        """
