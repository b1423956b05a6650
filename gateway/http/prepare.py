"""Preparation, the step between parsing a request and submitting it: can this gateway take it, is it
tokenized here (the local engine may serve it) or relayed (only a remote provider may), the prompt
fitted into the context, the output budget, and the `GenerationRequest` the router takes, with the
shape its answer must have. Routes read parse -> prepare -> submit -> answer; the pure parts of the
arithmetic are http/prompt.py's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from engine import Guide, SamplingParams
from gateway.errors import APIError
from gateway.http import prompt
from gateway.http.offload import Offloader
from gateway.messages import GenerationRequest, Target
from gateway.openai import tools
from gateway.openai.endpoints import CHAT, COMPLETION, Endpoint
from gateway.openai.logprobs import TokenPieces
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest
from gateway.openai.shape import AnswerShape, chat_shape, completion_shape
from gateway.settings import cache_salt
from gateway.state import GatewayState


@dataclass(frozen=True)
class Caller:
    """Who asks, as admission left it on the HTTP request."""

    tier: str
    key: str | None  # the API key's name (None: anonymous)
    timeout: str | None  # the client's own timeout (the `x-request-timeout` header), as sent


@dataclass(frozen=True)
class Prepared:
    """A request ready for the router: what to generate, and how to answer it."""

    gen: GenerationRequest
    req: ChatCompletionRequest | CompletionRequest
    endpoint: Endpoint
    shape: AnswerShape
    tools: list[tools.ToolSpec] | None = None  # rendered into the prompt: names a tool grammar the engine refuses

    @property
    def end_user(self) -> str | None:
        """The client's `user` / `safety_identifier` (an end-user id, as OpenAI uses it): only logged."""
        return self.req.user or getattr(self.req, "safety_identifier", None)


# ---------------------------------------------------------------- can this gateway take it


def require_ready(state: GatewayState) -> None:
    if state.draining:
        raise APIError(503, "This gateway is shutting down; retry (another gateway will answer).",
                       code="shutting_down", retry_after=1)
    if state.no_engine and state.engine is not None and not state.remote_workers:
        raise APIError(503, "No engine worker is alive for this model.", code="no_workers", retry_after=1)
    if not state.ready:
        msg = "The model is still loading." if state.load_error is None else "The engine is not available."
        raise APIError(503, msg, code="not_ready", retry_after=1)


def check_model(state: GatewayState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist. Available: {state.model_name}.",
                       param="model", code="model_not_found")


def _tokenize_here(state: GatewayState, model: str) -> bool:
    """True: tokenize here, the local engine may serve it (the router may still overflow it);
    False: only remote providers can take it now (a remote-only model, or no engine worker ready)."""
    router = state.router
    if router is not None and router.serves_remotely(model) and not state.draining:
        return model == state.model_name and state.ready
    require_ready(state)
    check_model(state, model)
    return True


def _capability(state: GatewayState, req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """What the local model cannot serve in this request: None, or the field (then only a remote provider
    that serves the model may take it; without one it is a 400 naming the field)."""
    field = req.local_unsupported()
    if field is None:
        return None
    if state.router is not None and state.router.serves_remotely(req.model) and not state.draining:
        return field
    raise APIError(400, f"{field}: the model `{req.model}` takes text only here, and no remote provider serves "
                        "it; remove the part or configure a provider that serves this model.",
                   param=field.split(" ")[0], code="unsupported_content")


# ---------------------------------------------------------------- the model's pieces


def _marker(state: GatewayState) -> list[int]:
    assert state.engine is not None
    return state.engine.tokenizer.encode(prompt.TRUNCATION_MARKER)


def _pieces(state: GatewayState) -> TokenPieces | None:
    if state.engine is None:
        return None
    if state.token_pieces is None:
        tok = state.engine.tokenizer
        state.token_pieces = TokenPieces(tok, tok.token_pieces())
    return state.token_pieces


# ---------------------------------------------------------------- the two endpoints


async def chat(state: GatewayState, offload: Offloader, req: ChatCompletionRequest, caller: Caller) -> Prepared:
    requested = req.requested_max_tokens()
    needs_remote = _capability(state, req)
    shape, guide, specs = chat_shape(req, _pieces(state))
    if needs_remote is None and _tokenize_here(state, req.model):
        assert state.engine is not None
        messages = req.template_messages()
        if specs:
            messages = tools.with_tool_system(messages, specs)
        ids = await offload.chat_prompt(state.engine.tokenizer, messages)
        ids = prompt.fit_prompt(ids, state.max_model_len, requested, req.prompt_truncation, _marker(state))
        max_tokens = prompt.resolve_max_tokens(state.max_model_len, len(ids), requested, None,
                                               room=state.engine.max_output_tokens(len(ids)))
        gen = _local(state, req, caller, CHAT, ids, max_tokens, guide, shape)
    else:  # remote providers only: they tokenize, parse tools, and their usage is what counts
        shape = AnswerShape()
        gen = _relay(state, req, caller, CHAT, needs_remote)
    return Prepared(gen, req, CHAT, shape, specs)


async def completion(state: GatewayState, offload: Offloader, req: CompletionRequest, caller: Caller) -> Prepared:
    ids: Sequence[int]
    shape, guide = completion_shape(req, _pieces(state))
    if _tokenize_here(state, req.model):
        assert state.engine is not None
        text_or_ids = req.prompt_text_or_ids()
        ids = (await offload.encode(state.engine.tokenizer, text_or_ids) if isinstance(text_or_ids, str)
               else text_or_ids)
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt", code="invalid_value")
        ids = prompt.fit_prompt(ids, state.max_model_len, req.max_tokens, req.prompt_truncation, _marker(state))
        # OpenAI's default max_tokens for completions: 16
        max_tokens = prompt.resolve_max_tokens(state.max_model_len, len(ids), req.max_tokens, 16, "prompt",
                                               room=state.engine.max_output_tokens(len(ids)))
        gen = _local(state, req, caller, COMPLETION, ids, max_tokens, guide, shape)
    else:  # remote providers only
        shape = AnswerShape()
        gen = _relay(state, req, caller, COMPLETION, None)
    return Prepared(gen, req, COMPLETION, shape)


# ---------------------------------------------------------------- the generation request


def _local(state: GatewayState, req: ChatCompletionRequest | CompletionRequest, caller: Caller, endpoint: Endpoint,
           ids: Sequence[int], max_tokens: int, guide: Guide | None, shape: AnswerShape) -> GenerationRequest:
    """Tokenized here, with the engine's sampling parameters: the local engine may serve it."""
    assert state.engine is not None  # tokenized by it
    sampling = prompt.sampling_params(req, max_tokens, state.engine.generation_defaults,
                                      guide=guide, logprobs=shape.top_logprobs)
    return _generation(state, req, caller, endpoint, Target.LOCAL, list(ids), sampling=sampling)


def _relay(state: GatewayState, req: ChatCompletionRequest | CompletionRequest, caller: Caller, endpoint: Endpoint,
           needs_remote: str | None) -> GenerationRequest:
    """Not tokenized: a remote provider gets the request as the client sent it (`api`)."""
    return _generation(state, req, caller, endpoint, Target.RELAY, [], needs_remote=needs_remote)


def _generation(state: GatewayState, req: ChatCompletionRequest | CompletionRequest, caller: Caller,
                endpoint: Endpoint, target: Target, ids: list[int], *, sampling: SamplingParams | None = None,
                needs_remote: str | None = None) -> GenerationRequest:
    tiers = state.settings.tiers
    return GenerationRequest(
        request_id=f"{endpoint.id_prefix}-{os.urandom(16).hex()}", prompt_token_ids=ids, target=target,
        n=req.n or 1, tier=caller.tier, priority=prompt.tier_priority(tiers, caller.tier),
        deadline=prompt.deadline(tiers, caller.timeout, caller.tier), model=req.model, api=req,
        endpoint=endpoint.name, key=caller.key,
        cache_salt=cache_salt(state.settings.auth.prefix_cache_scope, caller.key, caller.tier, req.cache_salt),
        sampling=sampling, needs_remote=needs_remote)
