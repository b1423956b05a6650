"""`/v1/batches`: create, retrieve, list, cancel, and the runner that answers their lines.

Each line is answered by the same handler its endpoint has (chat, completions, embeddings, responses),
called in-process as the batch's owner, at a priority below every tier: the lane below standard. A line
is admitted only while nothing waits in its model's queue, at most `[batches] max_in_flight` at once
across batches (oldest batch first), so interactive requests go first and the engine's priority
preemption takes batch sequences back when they come. A line's result is durable (BatchStore) before it
counts; a restart resumes every batch with the lines that have none. At the end the results become an
output file and an error file (purpose `batch_output`), one line per input line, in input order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway import jsonio
from gateway.admission.auth import KEY_NAME, TIER_KEY
from gateway.errors import APIError
from gateway.http import embeddings, files, pages, prepare, responses, routes
from gateway.http.offload import OFFLOAD
from gateway.openai import batches as bp
from gateway.state import STATE, GatewayState
from gateway.store.batches import BatchStore
from gateway.store.responses import ANONYMOUS

log = logging.getLogger("sluice.batches")

BATCHES = web.AppKey("batches_store", BatchStore)
RUNNER: web.AppKey[Runner] = web.AppKey("batches_runner")

RATE_WINDOW_S = 30.0  # the dashboard's lines/s: over this long
RETRIES = 5  # tries again of a line that failed on the gateway's side (429, 5xx) before its failure is recorded
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HANDLERS: dict[str, Handler] = {"/v1/chat/completions": routes.chat_completions, "/v1/completions": routes.completions,
                                "/v1/embeddings": embeddings.create_embeddings, "/v1/responses": responses.create}


def _owner(request: web.Request) -> str | None:
    return routes.caller(request, request.app[STATE]).key


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch with id '{batch_id}' found.", param="batch_id", code="not_found")


# ---------------------------------------------------------------- routes


async def create(request: web.Request) -> web.Response:
    req = await request.app[OFFLOAD].parse(await request.read(), bp.CreateBatch)
    owner = _owner(request)
    f = await request.app[files.FILES].get(owner, req.input_file_id)
    if f is None:
        raise APIError(404, f"No file with id '{req.input_file_id}' found.", param="input_file_id", code="not_found")
    if f.purpose != "batch":
        raise APIError(400, f"The file '{f.id}' has purpose {f.purpose!r}; a batch reads a `batch` file.",
                       param="input_file_id", code="invalid_value")
    batch = bp.new_batch(f"batch_{os.urandom(12).hex()}", req)
    tier = request.get(TIER_KEY, request.app[STATE].settings.auth.anonymous_tier)
    await request.app[BATCHES].put(owner, tier, batch)
    _runner(request.app).wake()
    return web.json_response(bp.public(batch))


async def retrieve(request: web.Request) -> web.Response:
    batch = await request.app[BATCHES].get(_owner(request), request.match_info["batch_id"])
    if batch is None:
        raise _not_found(request.match_info["batch_id"])
    return web.json_response(bp.public(batch))


async def list_batches(request: web.Request) -> web.Response:
    items = await request.app[BATCHES].list_for(_owner(request))
    return web.json_response(pages.page([bp.public(b) for b in items], request.query, default=20, most=100))


async def cancel(request: web.Request) -> web.Response:
    store, owner, batch_id = request.app[BATCHES], _owner(request), request.match_info["batch_id"]
    runner = _runner(request.app)
    async with runner.lock:
        batch = await store.get(owner, batch_id)
        if batch is None:
            raise _not_found(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            await store.update(batch)
            runner.cancelled.add(batch_id)
    runner.wake()
    return web.json_response(bp.public(batch))


# ---------------------------------------------------------------- the runner


class Runner:
    """Drives every active batch (all keys) to its end; one per gateway process."""

    def __init__(self, app: web.Application):
        self.app = app
        self.store: BatchStore = app[BATCHES]
        self.event = asyncio.Event()
        self.lock = asyncio.Lock()  # batch rows are read-modify-written by the runner and by cancel
        self.running: dict[str, asyncio.Task[None]] = {}
        self.cancelled: set[str] = set()
        self.slots = asyncio.Semaphore(app[STATE].settings.batches.max_in_flight)
        self.id = f"{os.getpid()}-{os.urandom(6).hex()}"  # this gateway's runner, in the batches' leases
        self.lease_s = app[STATE].settings.batches.lease_s
        self.in_flight: dict[str, int] = {}  # batch lines being answered, per model
        self.interactive_seen: dict[str, float] = {}  # per model: when other requests were last in flight
        self.calling: dict[str, list[asyncio.Task[None]]] = {}  # per model: line tasks, oldest first
        self.taken_back: set[asyncio.Task[None]] = set()  # cancelled for interactive requests, not shutdown
        self.lines_taken_back = 0
        self.requeued: dict[str, deque[int]] = {}  # per batch: lines taken back, to run again first
        self.by_owner: dict[str, int] = {}  # batch lines being answered, per key (its `batch_lines` quota)
        self.samples: dict[str, deque[tuple[float, int]]] = {}  # per batch: (when, lines answered), for lines/s

    def _forget(self, task: asyncio.Task[None]) -> None:
        for bid, t in list(self.running.items()):
            if t is task:
                del self.running[bid]

    def wake(self) -> None:
        self.event.set()

    async def run(self) -> None:
        while True:
            for owner, tier, batch in await self.store.active():
                bid = batch["id"]
                if bid not in self.running and await self.store.claim(bid, self.id, self.lease_s):
                    task = asyncio.create_task(self._batch(owner, tier, bid))
                    self.running[bid] = task
                    task.add_done_callback(self._forget)
            self.event.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.event.wait()

    async def _update(self, owner: str, bid: str, **fields: Any) -> dict[str, Any]:
        async with self.lock:
            batch = await self.store.get(None if owner == ANONYMOUS else owner, bid)
            assert batch is not None
            if fields.get("status") == "in_progress" and batch["status"] != "validating":
                fields.pop("status")  # cancelled while validating
            batch.update(fields)
            await self.store.update(batch)
            return batch

    async def _lines(self, owner: str, batch: dict[str, Any]) -> list[Any] | None:
        fs = self.app[files.FILES]
        f = await fs.get(None if owner == ANONYMOUS else owner, batch["input_file_id"])
        if f is None:
            return None
        text = await asyncio.to_thread(fs.path(f.id).read_text, "utf-8")
        out: list[Any] = []
        for raw in text.splitlines():
            if raw.strip():
                try:
                    out.append(json.loads(raw))
                except ValueError:
                    out.append(ValueError(raw[:80]))
        return out

    async def _batch(self, owner: str, tier: str, bid: str) -> None:
        renew = asyncio.create_task(self._renew(bid))
        try:
            await self._drive(owner, tier, bid)
        except Exception:
            log.exception("batch %s failed", bid)
            await self._update(owner, bid, status="failed", failed_at=int(time.time()),
                               errors={"object": "list", "data": [bp.line_error(0, "server_error",
                                                                                "the batch failed in the gateway")]})
        finally:
            renew.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self.store.unclaim(bid, self.id)

    async def _renew(self, bid: str) -> None:
        """Keeps this runner's lease on the batch while it drives it."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self.store.claim(bid, self.id, self.lease_s)

    async def _drive(self, owner: str, tier: str, bid: str) -> None:
        batch = await self.store.get(None if owner == ANONYMOUS else owner, bid)
        assert batch is not None
        lines = await self._lines(owner, batch)
        if batch["status"] == "validating":
            errors = self._validate(batch, lines)
            if errors:
                await self._update(owner, bid, status="failed", failed_at=int(time.time()),
                                   errors={"object": "list", "data": errors[:100]})
                return
            assert lines is not None
            batch = await self._update(owner, bid, status="in_progress", in_progress_at=int(time.time()),
                                       request_counts={"total": len(lines), "completed": 0, "failed": 0})
        assert lines is not None
        done = await self.store.results(bid)
        todo = deque(i for i in range(len(lines)) if i not in done)
        again = self.requeued.setdefault(bid, deque())  # lines taken back for interactive requests: first
        tasks: set[asyncio.Task[None]] = set()
        try:
            while todo or again or tasks:
                if bid in self.cancelled or batch["status"] == "cancelling" or time.time() > batch["expires_at"]:
                    break
                if not todo and not again:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    continue
                if not await self._quota(owner, tier):
                    continue  # waited: look at cancel and expiry again
                i = again.popleft() if again else todo.popleft()
                line = lines[i]
                model = line["body"]["model"]
                await self._admit(model)
                if bid in self.cancelled:
                    self._release(model)
                    break
                self.by_owner[owner] = self.by_owner.get(owner, 0) + 1
                task = asyncio.create_task(self._line(owner, tier, bid, i, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # shutdown: lines in flight stop; a line without a result runs at the next start
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        self.requeued.pop(bid, None)
        await self._finish(owner, bid, lines)

    def _validate(self, batch: dict[str, Any], lines: list[Any] | None) -> list[dict[str, Any]]:
        if lines is None:
            return [bp.line_error(0, "invalid_file", "the input file is gone")]
        if not lines:
            return [bp.line_error(0, "empty_file", "the input file has no lines")]
        state: GatewayState = self.app[STATE]
        seen: set[str] = set()
        errors = []
        for n, obj in enumerate(lines, 1):
            err = bp.line_error(n, "invalid_json_line", f"line {n} is not JSON") if isinstance(obj, ValueError) \
                else bp.validate_line(n, obj, batch["endpoint"], seen)
            if err is None and not self._served(state, obj["body"]["model"]):
                err = bp.line_error(n, "model_not_found", f"line {n}: the model {obj['body']['model']!r} is not "
                                                          "served here", "body.model")
            if err is not None:
                errors.append(err)
        return errors

    @staticmethod
    def _served(state: GatewayState, model: str) -> bool:
        if state.pool_for(model) is not None:
            return True
        return state.remote is not None and bool(state.remote.chain(model))

    async def _quota(self, owner: str, tier: str) -> bool:
        """True when the key may start another line: fewer than its `batch_lines` in flight (on this
        gateway) and its `batch_tokens_per_day` not used up. Otherwise waits a little (until a line ends;
        up to 5 s of the wait for the next UTC day) and returns False."""
        state: GatewayState = self.app[STATE]
        key = None if owner == ANONYMOUS else owner
        cap = state.limiter.limits_for(key, tier).batch_lines
        if cap is not None and self.by_owner.get(owner, 0) >= cap:
            await asyncio.sleep(0.02)
            return False
        wait = await state.limiter.batch_tokens_wait(key, tier)
        if wait > 0:
            await asyncio.sleep(min(wait, 5.0))
            return False
        return True

    async def _admit(self, model: str) -> None:
        """A slot, once the model's engine has room for a batch line: nothing waits in its queue, and while
        interactive requests ran in the last `interactive_window_s`, at most `beside_interactive` batch
        lines are in flight (each batch row in a step lengthens every interactive token's wait)."""
        await self.slots.acquire()
        pool = self.app[STATE].pool_for(model)
        if pool is None:
            return
        conf = self.app[STATE].settings.batches
        while True:
            mine = self.in_flight.get(model, 0)
            others = await self._others(pool, model)
            now = time.monotonic()
            if others > 0:
                self.interactive_seen[model] = now
            near = now - self.interactive_seen.get(model, -1e9) < conf.interactive_window_s
            if others <= 0 and not (near and mine >= conf.beside_interactive):
                self.in_flight[model] = mine + 1
                return
            await asyncio.sleep(0.02)

    async def _line(self, owner: str, tier: str, bid: str, i: int, line: dict[str, Any]) -> None:
        """One line to its recorded result. A failure that is the gateway's and passes (429, 5xx: a queue
        full, a shutdown, a provider down) is tried again after a backoff, not recorded: at most
        RETRIES times while the gateway runs; a gateway going down leaves the line for the next start."""
        model = line["body"]["model"]
        me = asyncio.current_task()
        assert me is not None
        self.calling.setdefault(model, []).append(me)
        try:
            for attempt in range(RETRIES + 1):
                status, body = await self._call(owner, tier, line)
                if status != 429 and status < 500:
                    break
                if self.app[STATE].draining:
                    return
                if attempt < RETRIES:
                    await asyncio.sleep(min(30.0, 0.5 * 2 ** attempt))
        except asyncio.CancelledError:
            if me not in self.taken_back:
                raise  # shutting down: the line runs again at the next start
            self.taken_back.discard(me)
            me.uncancel()
            self.requeued.setdefault(bid, deque()).append(i)  # its turn again once there is room
            return
        finally:
            self.calling[model].remove(me)
            self._release(model)
            self.by_owner[owner] -= 1
        ok = status < 400
        result = {"id": f"batch_req_{os.urandom(12).hex()}", "custom_id": line["custom_id"],
                  "response": {"status_code": status, "request_id": f"req_{os.urandom(8).hex()}", "body": body},
                  "error": None}
        if await self.store.record(bid, i, ok, result):
            await self._count(owner, bid)

    def _release(self, model: str) -> None:
        self.slots.release()
        if self.app[STATE].pool_for(model) is not None:
            self.in_flight[model] -= 1

    async def _others(self, pool: Any, model: str) -> int:  # noqa: ARG002 (the model's name: the callers')
        """Requests of the model's that are not batch lines (interactive ones), queued or in the engine:
        those queued at a tier's priority, and those in flight on its workers less the ones at a priority
        beyond every tier's (the workers count them apart). From `sluice worker`s' heartbeats on the Redis
        path, so up to a heartbeat old there, but never this or another gateway's batch lines."""
        top = max(t.priority for t in self.app[STATE].settings.tiers.values())
        queued = await pool.queue.depth_at_most(top)
        return queued + sum(max(0, w.in_flight - w.background) for w in pool.worker_stats())

    async def watch(self) -> None:
        """Takes batch lines back from an engine that interactive requests arrived at: beyond
        `beside_interactive`, the newest lines still being answered are cancelled (their engine slots and
        step share freed at once) and queued again at the front of their batch."""
        conf = self.app[STATE].settings.batches
        while True:
            await asyncio.sleep(0.02)
            for model, tasks in self.calling.items():
                extra = len(tasks) - conf.beside_interactive
                pool = self.app[STATE].pool_for(model)
                if extra <= 0 or pool is None:
                    continue
                if await self._others(pool, model) > 0:
                    self.interactive_seen[model] = time.monotonic()
                    for t in tasks[-extra:]:
                        if t not in self.taken_back:
                            self.taken_back.add(t)
                            self.lines_taken_back += 1
                            t.cancel()

    async def progress(self) -> dict[str, Any]:
        """The dashboard's view: every unfinished batch (all gateways sharing the directory, all keys: the
        dashboard is the operators') with its lines answered, lines/s over the last RATE_WINDOW_S of
        looks, and the time left at that rate; and per local model the batch lane's share of the engine
        (this gateway's lines in flight over the workers' capacity)."""
        now = time.monotonic()
        rows = []
        active = await self.store.active()
        for owner, _tier, b in active:
            counts = b.get("request_counts") or {}
            total, done = counts.get("total", 0), counts.get("completed", 0) + counts.get("failed", 0)
            seen = self.samples.setdefault(b["id"], deque())
            seen.append((now, done))
            while len(seen) > 1 and now - seen[1][0] >= RATE_WINDOW_S:
                seen.popleft()
            t0, d0 = seen[0]
            rate = (done - d0) / (now - t0) if now - t0 >= 0.5 else None
            rows.append({"id": b["id"], "owner": None if owner == ANONYMOUS else owner, "endpoint": b["endpoint"],
                         "status": b["status"], "total": total, "completed": counts.get("completed", 0),
                         "failed": counts.get("failed", 0), "lines_per_s": rate,
                         "eta_s": (total - done) / rate if rate else None,
                         "here": b["id"] in self.running})
        for gone in set(self.samples) - {b["id"] for _, _, b in active}:
            del self.samples[gone]
        lane = []
        for pool in self.app[STATE].pools:
            stats = pool.worker_stats()
            capacity = sum(w.capacity for w in stats)
            mine = sum(self.in_flight.get(name, 0) for name in pool.names)
            lane.append({"model": pool.model_name, "batch_in_flight": mine,
                         "in_flight": sum(w.in_flight for w in stats), "capacity": capacity,
                         "share": mine / capacity if capacity else None})
        return {"batches": rows, "lane": lane, "lines_taken_back": self.lines_taken_back}

    async def _count(self, owner: str, bid: str) -> dict[str, Any]:
        """request_counts from the recorded results (so a restart or a race cannot skew them)."""
        answered, failed = await self.store.counts(bid)
        async with self.lock:
            batch = await self.store.get(None if owner == ANONYMOUS else owner, bid)
            assert batch is not None
            batch["request_counts"].update(completed=answered - failed, failed=failed)
            await self.store.update(batch)
            return batch

    async def _call(self, owner: str, tier: str, line: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The line answered by its endpoint's own handler, as its owner would be, at the batch priority."""
        url = line["url"]
        state: GatewayState = self.app[STATE]
        req = make_mocked_request("POST", url, headers={"Content-Type": "application/json"}, app=self.app)
        req._read_bytes = jsonio.dumps(line["body"])  # the handler's `await request.read()`
        req[TIER_KEY] = tier
        if owner != ANONYMOUS:
            req[KEY_NAME] = owner
        req[prepare.PRIORITY] = max(t.priority for t in state.settings.tiers.values()) + 1
        try:
            resp = await HANDLERS[url](req)
        except APIError as e:
            return e.status, e.body()
        except Exception as e:
            log.exception("batch line %s failed", line.get("custom_id"))
            return 500, APIError(500, f"the line failed: {type(e).__name__}", type="server_error").body()
        assert isinstance(resp, web.Response) and resp.body is not None
        return resp.status, json.loads(resp.body)  # type: ignore[arg-type]

    async def _finish(self, owner: str, bid: str, lines: list[Any]) -> None:
        batch = await self._count(owner, bid)
        cancelled = bid in self.cancelled or batch["status"] == "cancelling"
        expired = not cancelled and time.time() > batch["expires_at"]
        await self._update(owner, bid, status="finalizing", finalizing_at=int(time.time()))
        results = await self.store.results(bid)
        out = [json.dumps(r) for i in range(len(lines)) if i in results and results[i][0] for r in [results[i][1]]]
        err = [json.dumps(r) for i in range(len(lines)) if i in results and not results[i][0] for r in [results[i][1]]]
        if expired:
            err += [json.dumps({"id": f"batch_req_{os.urandom(12).hex()}", "custom_id": lines[i]["custom_id"],
                                "response": None, "error": {"code": "batch_expired",
                                                            "message": "the batch's window ended first"}})
                    for i in range(len(lines)) if i not in results]
        fields: dict[str, Any] = {"output_file_id": await self._file(owner, bid, "output", out),
                                  "error_file_id": await self._file(owner, bid, "error", err)}
        now = int(time.time())
        if cancelled:
            fields.update(status="cancelled", cancelled_at=now)
        elif expired:
            fields.update(status="expired", expired_at=now)
        else:
            fields.update(status="completed", completed_at=now)
        await self._update(owner, bid, **fields)
        self.cancelled.discard(bid)

    async def _file(self, owner: str, bid: str, kind: str, rows: list[str]) -> str | None:
        if not rows:
            return None
        fs = self.app[files.FILES]
        file_id = f"file-{os.urandom(12).hex()}"
        data = ("\n".join(rows) + "\n").encode()
        await asyncio.to_thread(fs.temp_path(file_id).write_bytes, data)
        await fs.commit(None if owner == ANONYMOUS else owner, file_id, f"{bid}_{kind}.jsonl", "batch_output",
                        len(data))
        return file_id


def _runner(app: web.Application) -> Runner:
    return app[RUNNER]


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The runner, from start to shutdown; registered last (app.py), so it stops before the engines do and
    no line fails because the gateway is going down."""
    runner = app[RUNNER]
    task = asyncio.create_task(runner.run())
    watcher = asyncio.create_task(runner.watch())
    yield
    watcher.cancel()
    task.cancel()
    for t in list(runner.running.values()):
        t.cancel()  # lines without a result run again at the next start
    await asyncio.gather(task, watcher, *runner.running.values(), return_exceptions=True)
    await app[BATCHES].close()


def setup(app: web.Application, state: GatewayState) -> None:
    app[BATCHES] = BatchStore(state.settings.files_dir())
    app[RUNNER] = Runner(app)
    app.router.add_post("/v1/batches", create)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel)
