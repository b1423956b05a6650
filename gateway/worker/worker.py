"""EngineWorker: pulls requests from the queue and drives the engine in one dedicated thread.

The engine is not thread-safe and `step()` blocks for tens of milliseconds, so every engine call
happens on one thread that the event loop never waits for. The two sides talk through:
  * an inbox (thread-safe SimpleQueue + Event) of `AddRequest` / `AbortRequest` messages, drained by
    the thread between steps, so a cancellation reaches `engine.abort` within one step;
  * `loop.call_soon_threadsafe` for outputs, which a publisher task forwards, in order, to the queue's
    result channels.
The worker pulls only as many requests as the engine has free slots (`max_running_requests` minus
in-flight), so requests beyond capacity wait in the queue where priority, aging and depth limits
apply. It takes the queue as an argument so the same class runs in-process or as `sluice worker`
against a Redis queue. With a queue that leases requests (Redis) it also renews the leases of what it
holds, publishes each step's outputs in one fenced round trip (retrying through Redis outages, in
order), aborts requests it no longer owns, sends heartbeats, and on `stop(handback=True)` hands
unfinished requests back to the queue (with their published tokens) instead of failing them.
"""

from __future__ import annotations

import asyncio
import logging
import queue as thread_queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from engine import RequestOutput, RequestRejected
from gateway.messages import (
    AbortRequest,
    AddRequest,
    AnyOutput,
    Failure,
    InboxMessage,
    QueueItem,
    WorkerStats,
    error_output,
    queue_timeout_output,
)
from gateway.queue.base import RequestQueue
from gateway.tasks import cancel_and_wait, cancel_requested, run_forever
from gateway.worker.engine_api import StepEngine

log = logging.getLogger("sluice.worker")


class EngineWorker:
    def __init__(self, engine: StepEngine, queue: RequestQueue, *, max_batch: int = 128, poll_s: float = 0.5,
                 idle_wait_s: float = 0.5, heartbeat_s: float = 1.0, model_name: str | None = None,
                 on_pulled: Callable[[list[QueueItem]], None] | None = None, background_above: int | None = None):
        self.engine = engine
        self.queue = queue
        self.max_batch = max_batch
        self.poll_s = poll_s  # how often the asyncio loops re-check for shutdown
        self.idle_wait_s = idle_wait_s
        self.capacity = int(engine.config.max_running_requests)
        self.heartbeat_s = heartbeat_s
        self.model_name = model_name or engine.model_name
        self.on_pulled = on_pulled  # sees every pulled batch (the queue-time histogram)
        # Items at a priority above this (beyond every tier's: Batch API lines) are reported apart, so the
        # batch lane can tell interactive requests in flight from its own lines.
        self.background_above = background_above
        self._background: set[str] = set()
        self._handing_back: set[str] = set()

        self._inbox: thread_queue.SimpleQueue[InboxMessage] = thread_queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop_thread = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[list[AnyOutput]] | None = None
        self._tasks: list[asyncio.Task] = []
        self._room: asyncio.Event | None = None
        self._stopping = False

        self._in_flight: set[str] = set()  # event-loop side: handed to the thread, not yet finished
        self._thread_running: set[str] = set()  # thread side: added to the engine, not finished/aborted
        self._early_aborts: OrderedDict[str, None] = OrderedDict()  # aborts that overtook their add
        self.steps = 0
        self.step_errors = 0

    # ------------------------------------------------------------ lifecycle

    @property
    def running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and all(not t.done() for t in self._tasks))

    def stats(self) -> WorkerStats:
        """Racy reads of the engine's counters from the loop thread: fine for monitoring and routing."""
        self._background &= self._in_flight  # finished ones leave
        st = WorkerStats(model=self.model_name, capacity=self.capacity, in_flight=len(self._in_flight),
                         background=len(self._background),
                         running=int(self.engine.num_running), waiting=int(self.engine.num_waiting),
                         steps=self.steps, step_errors=self.step_errors,
                         busy_seconds=float(self.engine.stats.busy_seconds), kv_usage=float(self.engine.kv_usage()),
                         draining=self._stopping)
        prefill = getattr(self.engine, "pending_prefill_tokens", None)  # a chat engine
        if prefill is not None:
            try:
                st.prefill_pending = int(prefill())
            except RuntimeError:  # the engine thread changed a list meanwhile: report none this time
                st.prefill_pending = None
            st.prefill_tokens = int(getattr(self.engine.stats, "prefill_tokens", 0))
        pending = getattr(self.engine, "pending_tokens", None)  # an embedding engine
        if pending is not None:
            try:
                st.pending_tokens = {str(p): int(n) for p, n in pending().items()}
            except RuntimeError:  # the engine thread changed its dict meanwhile: report none this time
                st.pending_tokens = None
            st.tokens = int(getattr(self.engine.stats, "tokens", 0))
        return st

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()
        self._thread = threading.Thread(target=self._thread_main, name="sluice-engine", daemon=True)
        self._thread.start()
        self._tasks = [
            asyncio.create_task(self._pull_loop(), name="sluice-worker-pull"),
            asyncio.create_task(self._cancel_loop(), name="sluice-worker-cancel"),
            asyncio.create_task(self._publish_loop(), name="sluice-worker-publish"),
            asyncio.create_task(self._heartbeat_loop(), name="sluice-worker-heartbeat"),
        ]
        if self.queue.renew_interval_s:
            self._tasks.append(asyncio.create_task(self._renew_loop(), name="sluice-worker-renew"))

    async def stop(self, grace_s: float = 0.0, *, handback: bool | None = None) -> None:
        """Stop pulling; give in-flight requests `grace_s` to finish; then hand the rest back to the
        queue (when it leases: `handback` defaults to that) or abort them; join the thread."""
        self._stopping = True
        self._tasks[0].cancel()  # no new work
        if handback is None:
            handback = self.queue.lease_s is not None
        deadline = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if handback:
            # The thread aborts them at shutdown; those abort outputs must not reach the clients.
            self._handing_back = set(self._in_flight)
        else:
            for rid in list(self._in_flight):
                self._send(AbortRequest(rid))
        self._stop_thread.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        await asyncio.sleep(0)  # let the last call_soon_threadsafe callbacks run
        await cancel_and_wait(self._tasks)
        assert self._outbox is not None
        while not self._outbox.empty():  # outputs the publisher had not forwarded yet
            batch = self._outbox.get_nowait()
            try:
                await self.queue.publish_batch(batch)
            except Exception:
                log.exception("publishing %d outputs at shutdown failed", len(batch))
        if handback and self._handing_back:
            ids = sorted(self._handing_back)
            try:
                n = await self.queue.release(ids)
                log.info("handed %d unfinished requests back to the queue", n)
                self._in_flight.difference_update(ids)
            except Exception:  # their leases expire and the reaper requeues them anyway
                log.exception("handing back %d requests failed; their leases will expire", len(ids))
                self._in_flight.difference_update(ids)
        try:
            await self.queue.unregister()
        except Exception as e:  # the heartbeat expires on its own
            log.warning("unregistering the worker failed (%s); its heartbeat will expire", e)
        # Whatever is still in flight gets a final answer so no handler waits forever.
        for rid in list(self._in_flight):
            await self.queue.publish(error_output(rid, Failure.UNAVAILABLE, "shutdown", "server shutting down"))
        self._in_flight.clear()

    # ------------------------------------------------------------ event-loop side

    def _send(self, msg: InboxMessage) -> None:
        self._inbox.put(msg)
        self._wake.set()

    async def _pull_loop(self) -> None:
        assert self._room is not None
        while not self._stopping:
            room = self.capacity - len(self._in_flight)
            if room <= 0:
                self._room.clear()
                try:
                    await asyncio.wait_for(self._room.wait(), self.poll_s)
                except TimeoutError:
                    pass
                continue
            try:
                items = await self.queue.pull(min(room, self.max_batch), timeout=self.poll_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("queue pull failed; retrying")
                await asyncio.sleep(self.poll_s)
                continue
            if items and self.on_pulled is not None:
                self.on_pulled(items)
            now = time.time()
            for item in items:
                if item.deadline is not None and now > item.deadline:
                    await self.queue.publish_batch([queue_timeout_output(item.request_id)])
                    continue
                self._in_flight.add(item.request_id)
                if self.background_above is not None and item.priority > self.background_above:
                    self._background.add(item.request_id)
                self._send(AddRequest(item))

    async def _cancel_loop(self) -> None:
        async def take() -> None:
            for rid in await self.queue.next_cancellations(timeout=self.poll_s):
                self._send(AbortRequest(rid))
        await run_forever(take, every_s=0, log=log, what="reading cancellations")

    def _on_outputs(self, outputs: list[AnyOutput]) -> None:
        """Runs on the loop (via call_soon_threadsafe)."""
        assert self._outbox is not None and self._room is not None
        if self._handing_back:
            outputs = [o for o in outputs
                       if not (o.request_id in self._handing_back and getattr(o, "finish_reason", None) == "abort")]
        for out in outputs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        self._room.set()
        self._outbox.put_nowait(outputs)

    async def _publish_loop(self) -> None:
        """Forwards each step's outputs in order; a failed publish is retried (never skipped), so a
        Redis outage delays tokens but loses none."""
        assert self._outbox is not None
        while True:
            outputs = await self._outbox.get()
            delay = 0.05
            while True:
                try:
                    lost = await self.queue.publish_batch(outputs)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if cancel_requested():
                        raise asyncio.CancelledError() from e
                    log.warning("publishing %d outputs failed (%s); retrying", len(outputs), e)
                    await asyncio.sleep(delay)
                    delay = min(1.0, delay * 2)
            self._drop_lost(lost)

    def _drop_lost(self, lost: list[str]) -> None:
        """Requests this worker no longer owns (cancelled, or reclaimed after a stalled lease): stop them."""
        for rid in lost:
            if rid in self._in_flight:
                log.info("request %s is no longer ours (cancelled or reclaimed); aborting it", rid)
                self._send(AbortRequest(rid))

    async def _renew_loop(self) -> None:
        async def renew() -> None:
            self._drop_lost(await self.queue.renew(list(self._in_flight)))
        interval = float(self.queue.renew_interval_s or 1.0)
        await asyncio.sleep(interval)
        await run_forever(renew, every_s=interval, log=log, what="renewing leases")

    async def _heartbeat_loop(self) -> None:
        async def beat() -> None:
            await self.queue.heartbeat(self.stats())
        await run_forever(beat, every_s=self.heartbeat_s, log=log, what="heartbeat")

    # ------------------------------------------------------------ engine thread

    def _emit(self, outputs: list[AnyOutput]) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _drain_inbox(self) -> None:
        emitted: list[AnyOutput] = []
        while True:
            try:
                msg = self._inbox.get_nowait()
            except thread_queue.Empty:
                break
            if isinstance(msg, AddRequest):
                emitted.extend(self._add(msg.item))
            else:
                emitted.extend(self._abort(msg.request_id))
        self._emit(emitted)

    def _add(self, item: QueueItem) -> list[AnyOutput]:
        rid = item.request_id
        if rid in self._early_aborts:
            del self._early_aborts[rid]
            return [RequestOutput(request_id=rid, finished=True, finish_reason="abort")]
        try:
            self.engine.add_request(item.request)
        except RequestRejected as e:
            return [error_output(rid, Failure.INVALID_REQUEST, e.code, str(e), param=e.param)]
        except Exception as e:  # a bug or a bad request the engine did not classify
            log.exception("engine.add_request failed for %s", rid)
            return [error_output(rid, Failure.ENGINE, "engine_error", f"engine error: {type(e).__name__}")]
        self._thread_running.add(rid)
        return []

    def _abort(self, rid: str) -> list[AnyOutput]:
        if rid not in self._thread_running:
            self._early_aborts[rid] = None
            while len(self._early_aborts) > 10000:
                self._early_aborts.popitem(last=False)
            return []
        self._thread_running.discard(rid)
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("engine.abort failed for %s", rid)
        return [RequestOutput(request_id=rid, finished=True, finish_reason="abort")]

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.step_errors += 1
            log.exception("engine.step failed; failing %d in-flight requests", len(self._thread_running))
            failed: list[AnyOutput] = []
            for rid in list(self._thread_running):
                self._abort_quietly(rid)
                failed.append(error_output(rid, Failure.ENGINE, "engine_error",
                                           f"engine step failed: {type(e).__name__}"))
            self._thread_running.clear()
            self._emit(failed)
            return
        self.steps += 1
        for out in outputs:
            if out.finished:
                self._thread_running.discard(out.request_id)
        # Outputs for a request aborted meanwhile would be harmless (nobody subscribes) but skip them.
        self._emit(outputs)

    def _thread_main(self) -> None:
        while not self._stop_thread.is_set():
            self._drain_inbox()
            if self._thread_running or self.engine.has_unfinished():
                self._step()
            else:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
        # Shutdown: abort whatever is left so the engine frees its slots.
        self._drain_inbox()
        leftovers: list[AnyOutput] = [RequestOutput(request_id=rid, finished=True, finish_reason="abort")
                     for rid in self._thread_running]
        for rid in list(self._thread_running):
            self._abort_quietly(rid)
        self._thread_running.clear()
        self._emit(leftovers)

    def _abort_quietly(self, rid: str) -> None:
        """Free an engine slot on a path that is already failing: log, never raise."""
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("engine.abort failed for %s", rid)
