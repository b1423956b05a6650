"""Backends the router chooses from: the local engine (through the queue) now, remote providers later."""

from gateway.backends.base import Backend, ChoiceOutput, ChoiceStream, GenerationRequest
from gateway.backends.local import LocalBackend

__all__ = ["Backend", "ChoiceOutput", "ChoiceStream", "GenerationRequest", "LocalBackend"]
