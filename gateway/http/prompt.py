"""From a validated OpenAI request to what the engine takes: the prompt fitted into the context, the
output budget, sampling parameters with the model's defaults, the tier's priority and the deadline.
Pure functions of their arguments, so each is unit-testable without an app."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from engine import Guide, SamplingParams
from gateway.errors import APIError
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest
from gateway.settings import TierSettings

DEADLINE_HEADER = "x-request-timeout"  # seconds the client is willing to wait (its own timeout)
TRUNCATION_MARKER = "\n\n[... middle of the prompt truncated ...]\n\n"


def resolve_max_tokens(max_model_len: int, prompt_len: int, requested: int | None, default: int | None,
                       prompt_param: str = "messages", room: int | None = None) -> int:
    """The output budget: what was asked for, or what is left of the context (capped by `default`).

    `room`: the engine's own cap for this prompt (its `max_output_tokens`: the KV pool, req_max_output_len),
    which an unasked budget stays within; the engine refuses a requested one above it. At least 1, so a
    prompt that fills the engine alone gets the engine's refusal, which names the prompt."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                            f"{prompt_len} tokens. Please shorten the prompt.",
                       param=prompt_param, code="context_length_exceeded")
    available = max_model_len - prompt_len
    if requested is None:
        budget = available if default is None else min(default, available)
        return budget if room is None else max(1, min(budget, room))
    if requested > available:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. The prompt has "
                            f"{prompt_len} tokens, so at most {available} tokens are available for the "
                            f"completion, but {requested} were requested. Lower max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    return requested


def fit_prompt(ids: Sequence[int], max_model_len: int, requested_max_tokens: int | None, mode: str | None,
               marker: list[int]) -> Sequence[int]:
    """With prompt_truncation="middle", cut an over-long prompt's middle (the head keeps the system prompt,
    the tail the latest turn and the generation prompt) so that it and max_tokens fit the context.
    A prompt over the context without truncation comes back as it is (an array from the helper process
    stays one: `resolve_max_tokens` refuses it by its length)."""
    reserve = requested_max_tokens if requested_max_tokens is not None else min(256, max_model_len // 4)
    budget = max_model_len - reserve
    if mode != "middle" or len(ids) <= budget:
        return ids if len(ids) >= max_model_len else list(ids)
    keep = budget - len(marker)
    if keep < 2:
        raise APIError(400, f"max_tokens {reserve} leaves no room for the prompt in the {max_model_len}-token "
                            "context.", param="max_tokens", code="context_length_exceeded")
    head = keep // 2
    return list(ids[:head]) + marker + list(ids[len(ids) - (keep - head):])


def tier_priority(tiers: Mapping[str, TierSettings], tier: str) -> int:
    """The tier's priority number (lower runs first); an unknown tier gets the lowest priority."""
    if tier in tiers:
        return tiers[tier].priority
    return max(t.priority for t in tiers.values())


def deadline(tiers: Mapping[str, TierSettings], client_timeout: str | None, tier: str) -> float | None:
    """When a still-queued request stops being wanted: the tier's deadline_s, or the client's timeout."""
    limits = []
    t = tiers.get(tier)
    if t is not None and t.deadline_s is not None:
        limits.append(t.deadline_s)
    try:
        client = float(client_timeout or "")
        if client > 0:
            limits.append(client)
    except ValueError:
        pass
    return time.time() + min(limits) if limits else None


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                    defaults: Mapping[str, float] | None = None, *, guide: Guide | None = None,
                    logprobs: int | None = None) -> SamplingParams:
    """Fields the request leaves out take the model's recommended values, then OpenAI's defaults."""
    d = defaults or {}
    return SamplingParams(
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(req.repetition_penalty or 1.0),
        min_tokens=min(int(req.min_tokens or 0), max_tokens),
        logit_bias=req.logit_bias_ids(),
        logprobs=logprobs,
        guide=guide,
        temperature=float(d.get("temperature", 1.0)) if req.temperature is None else float(req.temperature),
        top_p=float(d.get("top_p", 1.0)) if req.top_p is None else float(req.top_p),
        top_k=int(d.get("top_k", 0)) if req.top_k is None else req.top_k,
        max_tokens=max_tokens,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
    )
