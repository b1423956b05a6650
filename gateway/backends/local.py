"""LocalBackend: the chat engine behind the request queue; LocalEmbeddings: an embedding engine behind its.

`n > 1` fans out into n engine requests (`{id}-{i}`, seed `seed + i` when a seed is given) whose
outputs are merged as choices. Subscriptions are opened before the items are queued so no output is
lost, and whatever happens to the consumer (finish, error, disconnect, cancellation) `aclose` cancels
every unfinished sub-request so the engine frees its slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from engine import EmbeddingOutput, EmbeddingRequest, EngineRequest, RequestOutput
from gateway.backends.base import Backend, ChoiceStream
from gateway.messages import LOCAL, ChoiceOutput, EmbeddingJob, EmbeddingResult, GenerationRequest, QueueItem
from gateway.queue.base import RequestQueue, Subscription


class _LocalStream(ChoiceStream):
    def __init__(self, queue: RequestQueue, subs: list[Subscription], deadline: float | None = None):
        self._queue = queue
        self._subs = subs
        self._unfinished = {s.request_id for s in subs}
        self._merged: asyncio.Queue[ChoiceOutput | BaseException] = asyncio.Queue()
        self._readers = [asyncio.create_task(self._read(i, s)) for i, s in enumerate(subs)]
        self._closed = False
        self._expiry = asyncio.create_task(self._expire_at(deadline)) if deadline is not None else None

    async def _expire_at(self, deadline: float) -> None:
        """At the deadline, sub-requests no worker took yet end with a 504 (the queue publishes it), on
        time whatever the queue: waiting for a worker to pull them could take as long as a slot frees."""
        await asyncio.sleep(max(0.0, deadline - time.time()))
        for rid in list(self._unfinished):
            await self._queue.expire_if_queued(rid)

    async def withdraw_if_queued(self) -> bool:
        """A one-choice request no worker took yet leaves the queue (several choices stay: some may run)."""
        if len(self._subs) != 1 or not self._unfinished or self._closed:
            return False
        return await self._queue.expire_if_queued(self._subs[0].request_id)

    async def _read(self, index: int, sub: Subscription) -> None:
        try:
            while True:
                out = await sub.get()
                assert isinstance(out, RequestOutput)  # a chat model's queue carries chat outputs
                self._merged.put_nowait(ChoiceOutput(index, out))
                if out.finished:
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surface reader failures to the consumer
            self._merged.put_nowait(e)

    async def __anext__(self) -> ChoiceOutput:
        if not self._unfinished or self._closed:
            raise StopAsyncIteration
        item = await self._merged.get()
        if isinstance(item, BaseException):
            raise item
        if item.output.finished:
            self._unfinished.discard(item.output.request_id)
        return item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._readers + ([self._expiry] if self._expiry is not None else []):
            t.cancel()
        pending = list(self._unfinished)
        # Shielded: a second cancellation of the handler must not skip the engine abort.
        if pending:
            await asyncio.shield(_cancel_requests(self._queue, pending))
        for s in self._subs:
            await s.close()


async def _cancel_requests(queue: RequestQueue, request_ids: list[str]) -> None:
    for rid in request_ids:
        await queue.cancel(rid)


class LocalBackend(Backend):
    name = "local"

    def __init__(self, queue: RequestQueue):
        self.queue = queue

    @staticmethod
    def sub_requests(req: GenerationRequest) -> list[EngineRequest]:
        assert req.sampling is not None  # the router sends only local requests here
        out = []
        for i in range(req.n):
            rid = req.request_id if req.n == 1 else f"{req.request_id}-{i}"
            sampling = dataclasses.replace(req.sampling, stop=list(req.sampling.stop),
                                           stop_token_ids=list(req.sampling.stop_token_ids))
            if sampling.seed is not None:  # choice i: seed + i, wrapped into int64 (seed 2**63 - 1 with n=2)
                sampling.seed = (sampling.seed + i + 2**63) % 2**64 - 2**63
            out.append(EngineRequest(request_id=rid, prompt_token_ids=list(req.prompt_token_ids),
                                     sampling=sampling, priority=req.priority, cache_salt=req.cache_salt))
        return out

    async def submit(self, req: GenerationRequest) -> ChoiceStream:
        engine_reqs = self.sub_requests(req)
        subs: list[Subscription] = []
        queued: list[str] = []
        ok = False
        try:
            for er in engine_reqs:
                subs.append(await self.queue.subscribe(er.request_id))
            for er in engine_reqs:
                await self.queue.put(QueueItem(request=er, tier=req.tier, deadline=req.deadline, key=req.key))
                queued.append(er.request_id)
            stream = _LocalStream(self.queue, subs, req.deadline)
            ok = True
            return stream
        finally:
            if not ok:  # QueueFull (or cancellation) halfway: undo what was queued
                if queued:
                    await asyncio.shield(_cancel_requests(self.queue, queued))
                for s in subs:
                    await s.close()


class EmbeddingFailed(Exception):
    """The local engine ended an embedding request without its vectors: `output` says why (an engine
    refusal, a failed step, a queue timeout, a shutdown); the router may retry it remotely."""

    def __init__(self, output: RequestOutput | EmbeddingOutput):
        super().__init__(output.error or "embedding failed")
        self.output = output


class LocalEmbeddings:
    """An embedding model's queue: one queue item per request (the engine slices a big one into steps
    and puts queries first); the vectors come back one output per input, in any order."""

    name = "local"

    def __init__(self, queue: RequestQueue):
        self.queue = queue

    async def embed(self, job: EmbeddingJob) -> EmbeddingResult:
        """Queue the request and wait for every vector (QueueFull when its tier is at max_depth; on
        cancellation the request leaves the queue or the engine)."""
        rid = job.request_id
        sub = await self.queue.subscribe(rid)
        done = False
        expiry: asyncio.Task | None = None
        try:
            req = EmbeddingRequest(rid, job.inputs, priority=job.priority, truncate=job.truncate,
                                   dimensions=job.dimensions)
            await self.queue.put(QueueItem(request=req, tier=job.tier, deadline=job.deadline, key=job.key))
            if job.deadline is not None:
                expiry = asyncio.create_task(self._expire_at(rid, job.deadline))
            vectors: list[list[float] | None] = [None] * len(job.inputs)
            tokens = 0
            while True:
                out = await sub.get()
                if isinstance(out, EmbeddingOutput) and out.error is None:
                    vectors[out.index] = out.embedding
                    tokens += out.prompt_tokens
                    if out.finished:
                        break
                    continue
                done = out.finished
                raise EmbeddingFailed(out)
            done = True
            if any(v is None for v in vectors):  # the engine finished without a vector: never silently
                raise EmbeddingFailed(RequestOutput(request_id=rid, finished=True, finish_reason="error",
                                                    error="the engine finished without every vector"))
            return EmbeddingResult(backend=LOCAL, prompt_tokens=tokens,
                                   vectors=[v for v in vectors if v is not None])
        finally:
            if expiry is not None:
                expiry.cancel()
            if not done:
                await asyncio.shield(self.queue.cancel(rid))
            await sub.close()

    async def _expire_at(self, request_id: str, deadline: float) -> None:
        await asyncio.sleep(max(0.0, deadline - time.time()))
        await self.queue.expire_if_queued(request_id)
