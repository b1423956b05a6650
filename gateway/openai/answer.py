"""The JSON answer of a request that was not streamed: `chat.completion` and `text_completion` bodies,
built directly as dicts equal to the pydantic models' dumps (tests/gateway/test_chunks.py holds them
equal), then, for a request that asked for them, its tool calls parsed out of the text and its
log-probabilities."""

from __future__ import annotations

from typing import Any

from gateway.openai import tools
from gateway.openai.choices import ChoiceAcc, TokenUsage
from gateway.openai.logprobs import chat_logprobs, completion_logprobs
from gateway.openai.schema import SYSTEM_FINGERPRINT
from gateway.openai.shape import AnswerShape


def chat_response(rid: str, created: int, model: str, accs: list[ChoiceAcc], usage: TokenUsage) -> dict[str, object]:
    """`ChatCompletionResponse(...).model_dump()` (a message's `tool_calls` left out when None), built
    directly; `chat_answer` adds a choice's tool calls and logprobs."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": "".join(a.text), "refusal": None},
                         "finish_reason": a.finish_reason, "logprobs": None} for i, a in enumerate(accs)],
            "usage": usage.as_dict(), "system_fingerprint": SYSTEM_FINGERPRINT}


def completion_response(rid: str, created: int, model: str, accs: list[ChoiceAcc],
                        usage: TokenUsage) -> dict[str, object]:
    """`CompletionResponse(...).model_dump()`, built directly."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": "".join(a.text), "finish_reason": a.finish_reason, "logprobs": None}
                        for i, a in enumerate(accs)],
            "usage": usage.as_dict(), "system_fingerprint": SYSTEM_FINGERPRINT}


def chat_answer(rid: str, created: int, model: str, accs: list[ChoiceAcc], usage: TokenUsage,
                shape: AnswerShape) -> dict[str, object]:
    """The chat answer: tool calls parsed out of each choice's text, logprobs attached, as `shape` asks."""
    body = chat_response(rid, created, model, accs, usage)
    if shape.plain:
        return body
    choices: list[dict[str, Any]] = body["choices"]  # type: ignore[assignment]
    for i, (choice, acc) in enumerate(zip(choices, accs)):
        if shape.tools is not None:
            content, calls = tools.parse_tool_calls("".join(acc.text), shape.ids(i),
                                                    cut=acc.finish_reason == "length", names=shape.call_names)
            choice["message"]["content"] = content
            if calls:
                choice["message"]["tool_calls"] = [c.as_openai() for c in calls]
                if acc.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
        if shape.top_logprobs is not None and shape.pieces is not None:
            choice["logprobs"] = chat_logprobs(shape.pieces, acc.logprobs, shape.top_logprobs).model_dump()
    return body


def completion_answer(rid: str, created: int, model: str, accs: list[ChoiceAcc], usage: TokenUsage,
                      shape: AnswerShape) -> dict[str, object]:
    """The completion answer, with each choice's logprobs when `shape` asks for them."""
    body = completion_response(rid, created, model, accs, usage)
    if shape.top_logprobs is None or shape.pieces is None:
        return body
    choices: list[dict[str, Any]] = body["choices"]  # type: ignore[assignment]
    for choice, acc in zip(choices, accs):
        choice["logprobs"] = completion_logprobs(shape.pieces, acc.logprobs, shape.top_logprobs).model_dump()
    return body
