"""Preparation, the step between parsing a request and submitting it: can this gateway take it, is it
tokenized here (the local engine may serve it) or relayed (only a remote provider may), the prompt
fitted into the context, the output budget, and the `GenerationRequest` the router takes, with the
shape its answer must have. Routes read parse -> prepare -> submit -> answer; the pure parts of the
arithmetic are http/prompt.py's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

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
from gateway.routing.router import Router
from gateway.settings import cache_salt
from gateway.state import GatewayState
from gateway.worker.pool import ModelPool

PRIORITY = web.RequestKey("sluice_priority", int)  # on a request the gateway makes for itself (a batch line)


@dataclass(frozen=True)
class Caller:
    """Who asks, as admission left it on the HTTP request."""

    tier: str
    key: str | None  # the API key's name (None: anonymous)
    timeout: str | None  # the client's own timeout (the `x-request-timeout` header), as sent
    priority: int | None = None  # None: the tier's; set for batch lines (below every tier)

    @property
    def batch(self) -> bool:
        """A Batch API line: the gateway's own request, the only one that carries a priority."""
        return self.priority is not None


@dataclass(frozen=True)
class Prepared:
    """A request ready for the router: what to generate, and how to answer it."""

    gen: GenerationRequest
    req: ChatCompletionRequest | CompletionRequest
    endpoint: Endpoint
    shape: AnswerShape
    router: Router  # the model's (its pool's, or the remote-only models')
    tools: list[tools.ToolSpec] | None = None  # rendered into the prompt: names a tool grammar the engine refuses

    @property
    def end_user(self) -> str | None:
        """The client's `user` / `safety_identifier` (an end-user id, as OpenAI uses it): only logged."""
        return self.req.user or getattr(self.req, "safety_identifier", None)


# ---------------------------------------------------------------- can this gateway take it


def require_ready(state: GatewayState, pool: ModelPool | None = None) -> None:
    """503 unless the model's pool (default: the first chat model's) can serve now."""
    if state.draining:
        raise APIError(503, "This gateway is shutting down; retry (another gateway will answer).",
                       code="shutting_down", retry_after=1)
    pool = pool if pool is not None else state.chat
    if pool is None:
        return
    if pool.no_engine and pool.engine is not None and not pool.remote_workers:
        raise APIError(503, "No engine worker is alive for this model.", code="no_workers", retry_after=1)
    if not pool.ready:
        msg = "The model is still loading." if pool.load_error is None else "The engine is not available."
        raise APIError(503, msg, code="not_ready", retry_after=1)


_ENDPOINT_OF = {"chat": "/v1/chat/completions and /v1/completions", "embedding": "/v1/embeddings"}


def _a(kind: str) -> str:
    return "an embedding" if kind == "embedding" else "a chat"


def find_pool(state: GatewayState, model: str, kind: str) -> ModelPool | None:
    """The local pool serving `model`, None when no local pool does; a model of the other kind is a 400
    naming it."""
    pool = state.pool_for(model)
    if pool is not None and pool.kind != kind:
        raise APIError(400, f"The model `{model}` is {_a(pool.kind)} model: use it with {_ENDPOINT_OF[pool.kind]}, "
                            f"or send {_a(kind)} model here.", param="model", code="wrong_model_kind")
    return pool


def check_model(state: GatewayState, model: str, kind: str = "chat") -> None:
    """404 for a model nobody serves (503 while a local model of this kind is still loading: it may be it)."""
    if state.pool_for(model) is not None:
        return
    if any(p.kind == kind and p.model_name is None and p.load_error is None for p in state.pools):
        require_ready(state, next(p for p in state.pools if p.kind == kind and p.model_name is None))
    names = [n for p in state.pools if p.kind == kind for n in p.names]
    raise APIError(404, f"The model `{model}` does not exist. Available: {', '.join(names) or 'none'}.",
                   param="model", code="model_not_found")


def router_for(state: GatewayState, pool: ModelPool | None) -> Router:
    router = pool.router if pool is not None else state.router
    assert isinstance(router, Router)
    return router


def _tokenize_here(state: GatewayState, pool: ModelPool | None, model: str) -> bool:
    """True: tokenize here, the local engine may serve it (the router may still overflow it);
    False: only remote providers can take it now (a remote-only model, or no engine worker ready)."""
    if router_for(state, pool).serves_remotely(model) and not state.draining:
        return pool is not None and pool.ready
    if state.draining:
        require_ready(state, pool)
    check_model(state, model)
    require_ready(state, pool)
    return True


def _capability(state: GatewayState, pool: ModelPool | None,
                req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """What the local model cannot serve in this request: None, or the field (then only a remote provider
    that serves the model may take it; without one it is a 400 naming the field)."""
    field = req.local_unsupported()
    if field is None:
        return None
    if router_for(state, pool).serves_remotely(req.model) and not state.draining:
        return field
    raise APIError(400, f"{field}: the model `{req.model}` takes text only here, and no remote provider serves "
                        "it; remove the part or configure a provider that serves this model.",
                   param=field.split(" ")[0], code="unsupported_content")


# ---------------------------------------------------------------- the model's pieces


def _marker(pool: ModelPool) -> list[int]:
    return pool.engine.tokenizer.encode(prompt.TRUNCATION_MARKER)


def _pieces(pool: ModelPool | None) -> TokenPieces | None:
    if pool is None or pool.engine is None:
        return None
    if pool.token_pieces is None:
        tok = pool.engine.tokenizer
        pool.token_pieces = TokenPieces(tok, tok.token_pieces())
    return pool.token_pieces


# ---------------------------------------------------------------- the two endpoints


async def chat(state: GatewayState, offload: Offloader, req: ChatCompletionRequest, caller: Caller) -> Prepared:
    requested = req.requested_max_tokens()
    pool = find_pool(state, req.model, "chat")
    needs_remote = _capability(state, pool, req)
    shape, guide, specs = chat_shape(req, _pieces(pool))
    if needs_remote is None and _tokenize_here(state, pool, req.model):
        assert pool is not None and pool.engine is not None
        messages = req.template_messages()
        if specs:
            messages = tools.with_tool_system(messages, specs)
        ids = await offload.chat_prompt(pool.engine.tokenizer, messages, req.template_options())
        ids = prompt.fit_prompt(ids, pool.max_model_len, requested, req.prompt_truncation, _marker(pool))
        max_tokens = prompt.resolve_max_tokens(pool.max_model_len, len(ids), requested, None,
                                               room=pool.engine.max_output_tokens(len(ids)))
        gen = _local(state, pool, req, caller, CHAT, ids, max_tokens, guide, shape)
    else:  # remote providers only: they tokenize, parse tools, and their usage is what counts
        shape = AnswerShape()
        gen = _relay(state, req, caller, CHAT, needs_remote)
    return Prepared(gen, req, CHAT, shape, router_for(state, pool), specs)


async def completion(state: GatewayState, offload: Offloader, req: CompletionRequest, caller: Caller) -> Prepared:
    ids: Sequence[int]
    pool = find_pool(state, req.model, "chat")
    shape, guide = completion_shape(req, _pieces(pool))
    if _tokenize_here(state, pool, req.model):
        assert pool is not None and pool.engine is not None
        text_or_ids = req.prompt_text_or_ids()
        ids = (await offload.encode(pool.engine.tokenizer, text_or_ids) if isinstance(text_or_ids, str)
               else text_or_ids)
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt", code="invalid_value")
        ids = prompt.fit_prompt(ids, pool.max_model_len, req.max_tokens, req.prompt_truncation, _marker(pool))
        # OpenAI's default max_tokens for completions: 16
        max_tokens = prompt.resolve_max_tokens(pool.max_model_len, len(ids), req.max_tokens, 16, "prompt",
                                               room=pool.engine.max_output_tokens(len(ids)))
        gen = _local(state, pool, req, caller, COMPLETION, ids, max_tokens, guide, shape)
    else:  # remote providers only
        shape = AnswerShape()
        gen = _relay(state, req, caller, COMPLETION, None)
    return Prepared(gen, req, COMPLETION, shape, router_for(state, pool))


# ---------------------------------------------------------------- the generation request


def _local(state: GatewayState, pool: ModelPool, req: ChatCompletionRequest | CompletionRequest, caller: Caller,
           endpoint: Endpoint, ids: Sequence[int], max_tokens: int, guide: Guide | None,
           shape: AnswerShape) -> GenerationRequest:
    """Tokenized here, with the engine's sampling parameters: the local engine may serve it."""
    sampling = prompt.sampling_params(req, max_tokens, pool.engine.generation_defaults,
                                      guide=guide, logprobs=shape.top_logprobs)
    return _generation(state, req, caller, endpoint, Target.LOCAL, list(ids), sampling=sampling,
                       model=pool.model_name or req.model)


def _relay(state: GatewayState, req: ChatCompletionRequest | CompletionRequest, caller: Caller, endpoint: Endpoint,
           needs_remote: str | None) -> GenerationRequest:
    """Not tokenized: a remote provider gets the request as the client sent it (`api`)."""
    return _generation(state, req, caller, endpoint, Target.RELAY, [], needs_remote=needs_remote)


def _generation(state: GatewayState, req: ChatCompletionRequest | CompletionRequest, caller: Caller,
                endpoint: Endpoint, target: Target, ids: list[int], *, sampling: SamplingParams | None = None,
                needs_remote: str | None = None, model: str | None = None) -> GenerationRequest:
    tiers = state.settings.tiers
    priority = caller.priority if caller.priority is not None else prompt.tier_priority(tiers, caller.tier)
    return GenerationRequest(
        request_id=f"{endpoint.id_prefix}-{os.urandom(16).hex()}", prompt_token_ids=ids, target=target,
        n=req.n or 1, tier=caller.tier, priority=priority,
        deadline=prompt.deadline(tiers, caller.timeout, caller.tier), model=model or req.model, api=req,
        endpoint=endpoint.name, key=caller.key,
        cache_salt=cache_salt(state.settings.auth.prefix_cache_scope, caller.key, caller.tier, req.cache_salt),
        sampling=sampling, needs_remote=needs_remote, batch=caller.batch)
