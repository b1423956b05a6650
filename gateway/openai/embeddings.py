"""`POST /v1/embeddings` as OpenAI defines it (CreateEmbeddingRequest / CreateEmbeddingResponse in
openapi-subset.json): the request validated at the boundary and the answer's body.

`input` is a string, a list of strings, a list of token ids, or a list of lists of token ids: at most
2,048 inputs, none empty. Sluice adds one field, `truncate` (false by default): an input longer than the
model's maximum is cut to it instead of refused with a 400 naming it (vLLM calls it
`truncate_prompt_tokens`; OpenAI refuses). `encoding_format` base64 is each vector's float32 values,
little-endian, base64-encoded: what the openai SDK decodes (and asks for by default).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import Field, field_validator

from gateway.openai.schema import _Request

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
MAX_TOKEN_ID = 2**31 - 1


class EmbeddingRequestBody(_Request):
    """The client's request, strict as every request model here: an unknown field is a 400 naming it."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=256)  # an end-user id: logged, nothing else
    truncate: bool = False  # Sluice: cut over-long inputs to the model's maximum instead of refusing them

    @field_validator("input")
    @classmethod
    def _inputs(cls, v: str | list[str] | list[int] | list[list[int]]) -> Any:
        if isinstance(v, str):
            if not v:
                raise ValueError("`input` is an empty string; send at least one character")
            return v
        if not v:
            raise ValueError("`input` is an empty list; send at least one input")
        if len(v) > MAX_INPUTS:
            raise ValueError(f"`input` has {len(v)} items; at most {MAX_INPUTS} are allowed per request")
        items: list[Any] = list(v)
        for i, item in enumerate(items):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"`input[{i}]` is an empty string; every input needs at least one character")
            elif isinstance(item, list):
                if not item:
                    raise ValueError(f"`input[{i}]` is an empty list of token ids")
                if any(not 0 <= t <= MAX_TOKEN_ID for t in item):
                    raise ValueError(f"`input[{i}]` has a negative or too large token id")
            elif not 0 <= item <= MAX_TOKEN_ID:
                raise ValueError(f"`input[{i}]` is a negative or too large token id")
        return v

    def texts_or_ids(self) -> list[str] | list[list[int]]:
        """The inputs, one per vector: texts (to tokenize) or token-id lists (as given)."""
        v: Any = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, str) for x in v):
            return list(v)
        if all(isinstance(x, int) for x in v):
            return [list(v)]  # one input given as token ids
        return [list(x) for x in v]

    def relay_body(self) -> dict[str, Any]:
        """The body a remote provider gets: what the client sent (the remote backend strips `truncate`)."""
        return self.model_dump(exclude_none=True, exclude_defaults=False)


def _base64(vector: list[float]) -> str:
    data = struct.pack(f"<{len(vector)}f", *vector)
    return base64.b64encode(data).decode("ascii")


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    return _base64(vector) if encoding_format == "base64" else vector


def embedding_response(model: str, vectors: list[list[float]], prompt_tokens: int,
                       encoding_format: str) -> dict[str, Any]:
    """CreateEmbeddingResponse: one `embedding` object per input, in input order."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


__all__ = ["MAX_INPUTS", "EmbeddingRequestBody", "embedding_response", "encode_vector"]
