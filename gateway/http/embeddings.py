"""`POST /v1/embeddings`: parse, prepare, route, answer, as the chat routes read.

Prepare: the model names a local embedding pool (a chat model is a 400 naming it), or only remote
providers serve it (relayed as sent). Texts are tokenized here with the model's own tokenizer (off the
event loop when there are many), so an input over the model's maximum is a 400 naming its index before
anything queues, unless the request asks for `truncate`. `dimensions` where the model does not support
it is a 400 naming it (or the request goes to a provider serving the model, which may).
"""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from engine import RequestOutput
from gateway import jsonio
from gateway.admission.auth import KEY_NAME, TIER_KEY
from gateway.backends.local import EmbeddingFailed
from gateway.errors import APIError
from gateway.http import prepare, prompt
from gateway.http.errors import error_for_output
from gateway.http.middleware import END_USER
from gateway.http.offload import OFFLOAD
from gateway.messages import EmbeddingJob, Target
from gateway.openai.embeddings import EmbeddingRequestBody, embedding_response
from gateway.queue.base import QueueFull
from gateway.routing.embeddings import EmbeddingRouter
from gateway.routing.router import BACKEND_HEADER
from gateway.state import STATE, GatewayState
from gateway.worker.pool import ModelPool

INLINE_TOKENIZE_INPUTS = 32  # more inputs than this are tokenized on a thread


def _router(state: GatewayState, pool: ModelPool | None) -> EmbeddingRouter:
    router = pool.router if pool is not None else state.embedding_router
    assert isinstance(router, EmbeddingRouter)
    return router


async def _inputs(pool: ModelPool, req: EmbeddingRequestBody) -> list[list[int]]:
    """Token ids per input, framed by the model's special tokens (ids the client sent are taken as they
    are, as OpenAI does); over-long inputs refused here by index unless `truncate`."""
    items = req.texts_or_ids()
    model = pool.engine
    if items and isinstance(items[0], str):
        texts: list[str] = items
        if len(texts) <= INLINE_TOKENIZE_INPUTS:
            ids = model.tokenize(texts, truncate=req.truncate)
        else:
            ids = await asyncio.to_thread(model.tokenize, texts, req.truncate)
    else:
        ids = items
    if not req.truncate:
        limit = model.max_input_tokens
        for i, one in enumerate(ids):
            if len(one) > limit:
                raise APIError(400, f"input[{i}] has {len(one)} tokens, more than the {limit} the model "
                                    f"`{req.model}` takes; shorten it, or send \"truncate\": true to cut it to "
                                    f"{limit}.", param="input", code="context_length_exceeded")
    return ids


def _relayed(state: GatewayState, req: EmbeddingRequestBody, pool: ModelPool | None) -> bool:
    """True: only a remote provider may serve it now; False: tokenize here (or refuse it)."""
    router = _router(state, pool)
    remote = router.serves_remotely(req.model) and not state.draining
    if pool is None:
        if remote:
            return True
        if state.draining:
            prepare.require_ready(state)
        prepare.check_model(state, req.model, "embedding")
        raise AssertionError("check_model raises for an unknown model")
    if remote and not pool.ready:
        return True
    prepare.require_ready(state, pool)
    if req.dimensions is not None and not pool.engine.supports_dimensions:
        if remote:
            return True  # a provider serving the model may shorten vectors
        raise APIError(400, f"The model `{req.model}` does not support `dimensions`; remove it.",
                       param="dimensions", code="unsupported_parameter")
    return False


async def create_embeddings(request: web.Request) -> web.Response:
    state, offload = request.app[STATE], request.app[OFFLOAD]
    body = await request.read()
    req = await offload.parse(body, EmbeddingRequestBody)
    if req.user:
        request[END_USER] = req.user
    pool = prepare.find_pool(state, req.model, "embedding")
    tier = request.get(TIER_KEY, state.settings.auth.anonymous_tier)
    tiers = state.settings.tiers
    job = EmbeddingJob(request_id=f"embd-{os.urandom(16).hex()}", model=req.model, body=req.relay_body(),
                       truncate=req.truncate, dimensions=req.dimensions, tier=tier,
                       priority=request.get(prepare.PRIORITY, prompt.tier_priority(tiers, tier)),
                       deadline=prompt.deadline(tiers, request.headers.get(prompt.DEADLINE_HEADER), tier),
                       key=request.get(KEY_NAME), size_bytes=len(body), batch=prepare.PRIORITY in request)
    if _relayed(state, req, pool):
        job.target = Target.RELAY
    else:
        assert pool is not None
        job.model = pool.model_name or req.model
        job.inputs = await _inputs(pool, req)
    try:
        result = await _router(state, pool).embed(job)
    except QueueFull as e:
        raise APIError(503, f"The server is overloaded ({e.tier} queue full); retry shortly.",
                       type="overloaded_error", code="queue_full", retry_after=e.retry_after) from None
    except EmbeddingFailed as e:
        out = e.output
        err = error_for_output(out) if isinstance(out, RequestOutput) else None
        raise (err if err is not None else APIError(500, str(e), type="server_error", code="engine_error")) from None
    inputs = len(job.inputs) or len(req.texts_or_ids())
    m = state.metrics
    m.embedding_inputs.labels(job.model, result.backend).inc(inputs)
    m.embedding_request_inputs.labels(job.model).observe(inputs)
    if result.body is not None:  # a provider's answer, in the encoding the client asked for
        answer = dict(result.body)
        answer["model"] = req.model
    else:
        assert result.vectors is not None
        answer = embedding_response(job.model, result.vectors, result.prompt_tokens, req.encoding_format)
    return web.Response(body=jsonio.dumps(answer), content_type="application/json", charset="utf-8",
                        headers={BACKEND_HEADER: result.backend})


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", create_embeddings)
