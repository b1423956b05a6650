"""PoolBackend: chat, completion and embedding requests on engine replicas, Sluice's tier order kept in front.

`submit` waits, in tier order (then arrival), until some replica serving the model has room
(replica.py's room rule), picks one (balancer.py), and relays the request there with the remote
layer's machinery: a failure before the first text moves it to the next replica, least loaded first,
with the breakers taking a failing replica out and probing it back. Inside a tier, the keys share the
pool fairly (queue/fair.py: a key flooding it cannot push another key's request behind its flood).
Waiting is bounded by the request's deadline and by `max_wait_s` (the router passes the tier's target,
a time to first token) less the replicas' own first-token time (slo.py); a request that expects to wait
longer than that for room leaves at once. Then `PoolBusy` is raised and the router sends the request
elsewhere (or refuses it with a 429 where nothing else serves the model).

Each replica's `/metrics` is polled every `POLL_S`; a poll that fails counts as a failure on the
replica's breaker, so a replica that stops answering them is taken out like one that refuses requests.
Answers are priced at the local price (the replicas are the team's own capacity) and carry
`x-sluice-backend: engine:<name>`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from typing import Any

import aiohttp

from gateway import jsonio
from gateway.backends.base import ChoiceStream
from gateway.backends.pool.balancer import fallback_order, pick, prefix_hashes, round_robin
from gateway.backends.pool.load import parse_load
from gateway.backends.pool.replica import Replica
from gateway.backends.pool.slo import Durations, expected_wait, wait_budget
from gateway.backends.remote.backend import (
    CONTINUES,
    SLUICE_ONLY_FIELDS,
    RemoteAnswer,
    RemoteBackend,
    RemoteStream,
    TryResult,
)
from gateway.backends.remote.provider import Provider
from gateway.errors import APIError
from gateway.messages import EmbeddingJob, GenerationRequest
from gateway.observability.metrics import Metrics
from gateway.openai.schema import ChatMessage, engine_only_fields
from gateway.queue.fair import FairShare, request_cost
from gateway.settings import EngineReplicaSettings, ProviderSettings, RoutingSettings

log = logging.getLogger("sluice.pool")

POLL_S = 0.5
LABEL = "engine"
ENGINE_EXTRAS = ("top_k", "stop_token_ids", "ignore_eos", "repetition_penalty", "min_tokens", "guided_json",
                 "continue_final_message", "add_generation_prompt")


class PoolBusy(Exception):
    """No replica had room within the wait allowed."""


def prompt_text(gen: GenerationRequest) -> str:
    """The request's prompt as text, for prefix affinity: its messages (or prompt) as sent."""
    api = gen.api
    if api is None:
        return ""
    part = getattr(api, "messages", None)
    if part is None:
        part = getattr(api, "prompt", None)
    if part is None:
        return ""
    if isinstance(part, str):
        return part
    if all(isinstance(m, ChatMessage) for m in part):  # each turn's role and text (what a prefix cache holds)
        return "".join(f"{m.role}\n{m.text()}\n" for m in part)
    return jsonio.dumps([m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m
                         for m in part]).decode()


class PoolStream(RemoteStream):
    """A relayed answer from a replica: labelled `engine:<name>`, priced locally, the tier passed on."""

    label = LABEL

    def __init__(self, pool: PoolBackend, gen: GenerationRequest, chain: list[Provider], held: Replica):
        super().__init__(pool, gen, chain)
        self._pool = pool
        self._held: Replica | None = held
        self._ended = False
        self._admitted_at = time.monotonic()

    @property
    def provider_settings(self) -> ProviderSettings | None:
        return None  # the team's own capacity: the local price

    def _unhold(self) -> None:
        if self._held is not None:
            self._held.reserved -= 1
            self._held = None

    async def _attempt(self, p: Provider, deadline: float) -> TryResult:
        self._unhold()  # the try holds an in-flight slot now
        return await super()._attempt(p, deadline)

    def _dropped(self, p: Provider) -> set[str]:
        if isinstance(p, Replica) and p.kind in CONTINUES:
            # vLLM's extras, which these engines apply (a Sluice replica salts its own prefix cache by key)
            return set(SLUICE_ONLY_FIELDS.difference(ENGINE_EXTRAS))
        return super()._dropped(p)

    def _body(self, p: Provider) -> dict[str, Any]:
        body = super()._body(p)
        for k in ENGINE_EXTRAS:  # an extra set to null is left to the engine's default
            if k in body and body[k] is None:
                del body[k]
        if isinstance(p, Replica) and p.engine.pass_priority:
            body["priority"] = -self._gen.priority if p.kind == "sglang" else self._gen.priority
        return body

    def _continue_order(self, others: list[Provider]) -> list[Provider]:
        """Least busy first, as a request not yet started moves on."""
        replicas = [r for r in others if isinstance(r, Replica)]
        return list(fallback_order(replicas, min(replicas, key=lambda r: r.busy()))) if replicas else others

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            self._unhold()
            if not self._ended:
                self._ended = True
                self._pool.durations.ended(time.monotonic() - self._admitted_at)


class PoolBackend(RemoteBackend):
    """The engine replicas of every model: `submit` for chat and completions (see the module)."""

    def __init__(self, engines: list[EngineReplicaSettings], routing: RoutingSettings, metrics: Metrics | None = None):
        super().__init__([e.as_provider() for e in engines], routing, metrics)
        self.replicas = [Replica(e, routing, self._wake, self._has_waiters) for e in engines]
        self.providers = list(self.replicas)
        self._waiters: list[tuple[int, float, int, asyncio.Future[None]]] = []  # (priority, fair tag, arrival, ...)
        self._fair = FairShare()
        self.durations = Durations()
        self._seq = itertools.count()
        self._poller: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def chain(self, model: str) -> list[Provider]:
        return [r for r in self.replicas if model in r.settings.models]

    def order(self, chain: list[Provider]) -> list[Provider]:
        return chain  # PoolStream's chain is already in order (balancer.fallback_order)

    # ---------------------------------------------------------------- admission

    def _has_waiters(self) -> bool:
        return any(not w[-1].done() for w in self._waiters)

    def _wake(self) -> None:
        """Room may have appeared: let the first waiter look (it wakes the next if room is left)."""
        while self._waiters and self._waiters[0][-1].done():
            heapq.heappop(self._waiters)
        if self._waiters:
            self._waiters[0][-1].set_result(None)

    async def admit(self, gen: GenerationRequest, max_wait_s: float | None = None) -> Replica:
        """The replica the request goes to, its room held (`reserved`) until its first try starts; waits
        in (priority, fair share, arrival) order for room; raises PoolBusy once waiting longer could not
        meet `max_wait_s` (a time to first token: the module's docstring), or past the deadline."""
        replicas = [r for r in self.replicas if gen.model in r.settings.models]
        if not replicas:
            raise APIError(404, f"The model `{gen.model}` does not exist.", param="model", code="model_not_found")
        extras = engine_only_fields(gen.api)
        if extras:  # only the replicas that apply vLLM's extras (llama-server and plain OpenAI ones would drop them)
            replicas = [r for r in replicas if r.kind in CONTINUES]
            if not replicas:
                raise APIError(400, f"`{extras[0]}` is applied only by vLLM, SGLang or Sluice engines, and no replica "
                                    f"serving `{gen.model}` is one. Remove `{extras[0]}`.",
                               param=extras[0], code="unsupported_parameter")
        text = prompt_text(gen)
        cost = request_cost(len(text) // 4, _max_tokens(gen))
        return await self._admit(gen.model, replicas, text, gen.priority, gen.key, cost, gen.deadline, max_wait_s)

    async def _admit(self, model: str, replicas: list[Replica], text: str, priority: int, key: str | None, cost: float,
                     deadline: float | None, max_wait_s: float | None) -> Replica:
        """`admit` for any request: `text` for prefix affinity, `cost` its fair share (queue/fair.py)."""
        self.start()
        hashes = prefix_hashes(text)
        if max_wait_s is None:
            limit = self.routing.request_timeout_s
        else:
            limit = wait_budget(max_wait_s, self.replicas_first_token_s(replicas))
        if deadline is not None:
            limit = min(limit, deadline - time.time())
        until = time.monotonic() + max(0.0, limit)
        tag = self._fair.tag(priority, key, cost)
        order = (priority, tag, next(self._seq))
        plain = self.routing.pool_policy == "round_robin"
        while True:
            ahead = sum(1 for *o, f in self._waiters if not f.done() and tuple(o) < order)
            r = round_robin(replicas) if plain else None if ahead else pick(replicas, hashes)
            if r is not None:
                r.reserved += 1
                r.remember(hashes)
                self._fair.served(priority, tag)
                self._wake()  # room may be left for the next waiter
                return r
            left = until - time.monotonic()
            if max_wait_s is not None:
                slots = sum(min(r.level, r.engine.max_in_flight) for r in replicas if r.breaker.available())
                expect = expected_wait(ahead, self.durations.drain_rate(slots))
                if expect is not None and expect > left:
                    left = 0.0  # it would not get room in time: elsewhere now, not after waiting in vain
            if left <= 0:
                self._fair.withdraw(priority, key, tag, cost)  # not served: no share used
                self._wake()
                raise PoolBusy(model)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (order[0], order[1], order[2], fut))
            try:
                # Polls may open room without a request ending: look again at least every poll.
                await asyncio.wait_for(asyncio.shield(fut), min(left, POLL_S))
            except TimeoutError:
                pass
            except BaseException:  # the client left while it waited
                self._fair.withdraw(priority, key, tag, cost)
                raise
            finally:
                if not fut.done():
                    fut.cancel()
                self._waiters = [w for w in self._waiters if w[-1] is not fut]
                heapq.heapify(self._waiters)

    def replicas_first_token_s(self, replicas: list[Replica]) -> float | None:
        """The replicas' learnt first-token time (the mean of those known): what a request sent now pays."""
        known = [t for t in (r.first_token.estimate() for r in replicas) if t is not None]
        return sum(known) / len(known) if known else None

    async def submit(self, gen: GenerationRequest, max_wait_s: float | None = None) -> ChoiceStream:
        r = await self.admit(gen, max_wait_s)
        chain = fallback_order([x for x in self.replicas if gen.model in x.settings.models], r)
        return PoolStream(self, gen, list(chain), r)

    async def embed(self, job: EmbeddingJob, max_wait_s: float | None = None) -> RemoteAnswer:
        """`POST /v1/embeddings` on a replica serving `job.model`: admitted as a chat request is (tier order,
        fair share, room, least loaded), then relayed with the remote layer's tries, the chosen replica
        first and the others after it (a replica failing before its answer moves it on). Raises PoolBusy
        as `admit` does, and the last replica's error when every one failed."""
        replicas = [r for r in self.replicas if job.model in r.settings.models]
        if not replicas:
            raise APIError(404, f"The model `{job.model}` does not exist.", param="model", code="model_not_found")
        text = _first_text(job.body.get("input"))
        size = job.prompt_tokens or max(1, job.size_bytes // 4)
        r = await self._admit(job.model, replicas, text, job.priority, job.key, request_cost(size, 0), job.deadline,
                              max_wait_s)
        started = time.monotonic()
        r.reserved -= 1  # the first try takes its in-flight slot at once
        try:
            return await self.embeddings(job.request_id, job.model, job.body, job.deadline,
                                         chain=list(fallback_order(replicas, r)))
        finally:
            self.durations.ended(time.monotonic() - started)
            self._wake()

    def has_room(self, model: str) -> bool:
        return any(r.has_room() for r in self.replicas if model in r.settings.models)

    # ---------------------------------------------------------------- load polling

    def start(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(r) for r in self.replicas if r.metrics_url))
            await asyncio.sleep(POLL_S)

    async def poll(self, r: Replica) -> None:
        """Read one replica's metrics into its load; a failure to read them counts on its breaker."""
        assert r.metrics_url is not None
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        key = r.engine.metrics_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            async with self._session.get(r.metrics_url, headers=headers) as resp:
                if resp.status in (401, 403):  # our configuration, not the replica's health: load unknown
                    if r.metrics_error is None:
                        log.warning("replica %s refuses our key for %s (HTTP %d): its load is Sluice's own count "
                                    "only; set metrics_key_env (a Sluice replica's /metrics needs an admin key)",
                                    r.name, r.metrics_url, resp.status)
                    r.metrics_error = f"metrics refused (HTTP {resp.status})"
                    return
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                text = await resp.text()
            r.metrics_error = None
            r.observe(parse_load(r.kind, text))
            if r.breaker.state != "closed" and r.breaker.allow():
                r.breaker.success()  # its metrics answer again: a probe may go
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            if r.breaker.state == "closed":
                log.warning("replica %s: metrics unreadable (%s)", r.name, e or type(e).__name__)
            r.breaker.failure()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass
        if self._session is not None:
            await self._session.close()
        await super().close()


def _first_text(value: Any) -> str:
    """An embedding request's first text input (prefix affinity), "" for token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return ""


def _max_tokens(gen: GenerationRequest) -> int | None:
    """The most the request may generate (its fair-share cost): the engine's parameters, else the API's."""
    if gen.sampling is not None:
        return gen.sampling.max_tokens
    api = gen.api
    for name in ("max_completion_tokens", "max_tokens"):
        v = getattr(api, name, None)
        if isinstance(v, int):
            return v
    return None
