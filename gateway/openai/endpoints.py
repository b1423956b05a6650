"""The generation endpoints side by side: for `/v1/chat/completions` and `/v1/completions`, the name a
`GenerationRequest` carries, the answer's id prefix, its JSON body and its streamed chunks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway.openai import answer, chunks
from gateway.openai.choices import ChoiceAcc, TokenUsage
from gateway.openai.chunks import ChunkEncoder
from gateway.openai.shape import AnswerShape


@dataclass(frozen=True)
class Endpoint:
    name: Literal["chat", "completion"]
    id_prefix: str
    answer: Callable[[str, int, str, list[ChoiceAcc], TokenUsage, AnswerShape], dict[str, object]]
    chunks: Callable[[str, int, str, bool, AnswerShape], ChunkEncoder]  # (rid, created, model, usage?, shape)


CHAT = Endpoint("chat", "chatcmpl", answer.chat_answer, chunks.ShapedChatChunks)
COMPLETION = Endpoint("completion", "cmpl", answer.completion_answer, chunks.ShapedCompletionChunks)
