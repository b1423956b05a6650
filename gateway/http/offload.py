"""Request preparation that may take long (parsing a big body, templating and tokenizing a long prompt)
runs in a helper process, so one large request never stalls the event loop for other clients.

JSON decoding, pydantic validation and the tokenizer all hold the GIL for their whole call (a 4 MB
prompt takes seconds to tokenize), so a thread would not help: the loop thread could not run until the
call returned. Small requests, the common case, are prepared inline, where a hop to another process
would cost more than the work. Results cross the process boundary as plain values: a request model, or
token ids packed as `array('i')` bytes (a million ids unpickle as one memcpy, not a million ints).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import threading
import time
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from gateway.errors import APIError
from gateway.http.errors import validation_error

log = logging.getLogger("sluice.gateway")

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request's size, checked before any templating or tokenization."""

    max_messages: int = 2048
    max_prompt_chars: int = 1_000_000


def parse_request(body: bytes, model: type[M], limits: RequestLimits) -> M:
    """Bytes -> validated request model, or an APIError (400) that says what is wrong."""
    if not body:
        raise APIError(400, "Request body is empty; send a JSON object.", code="invalid_json")
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first.get("type") == "json_invalid":
            msg = str(first.get("msg", "invalid JSON"))
            if "recursion" in msg.lower():
                raise APIError(400, "Malformed JSON body: nested too deeply.", code="invalid_json") from None
            raise APIError(400, f"Malformed JSON body: {msg}", code="invalid_json") from None
        raise validation_error(e) from None
    except RecursionError:
        raise APIError(400, "Malformed JSON body: nested too deeply.", code="invalid_json") from None
    check_limits(req, limits)
    return req


def check_limits(req: Any, limits: RequestLimits) -> None:
    messages = getattr(req, "messages", None)
    if messages is not None:
        if len(messages) > limits.max_messages:
            raise APIError(400, f"Too many messages: {len(messages)}; at most {limits.max_messages} are allowed "
                                "per request.", param="messages", code="too_many_messages")
        chars = sum(len(m.text()) for m in messages)
        param = "messages"
    else:
        prompt = getattr(req, "prompt", None)
        chars = len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt or [] if isinstance(p, str))
        param = "prompt"
    if chars > limits.max_prompt_chars:
        raise APIError(400, f"The prompt has {chars} characters; at most {limits.max_prompt_chars} are allowed "
                            "per request.", param=param, code="prompt_too_long")


# ---------------------------------------------------------------- the helper process's side

_TOKENIZER: Any = None


CHILD_NICENESS = 10  # the helper's work is one large request's: it yields the CPU to the engine's steps


def _init_child(tokenizer_bytes: bytes | None, niceness: int) -> None:
    """Runs first in the helper process: it already runs at `niceness` (inherited from the thread that
    started it, so its interpreter's start yields the CPU too); made sure of here before it loads the
    tokenizer, so neither that nor a long prompt's tokenization takes the CPU from the engine's steps."""
    global _TOKENIZER
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < niceness:
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:  # not allowed here: run at the normal priority
        pass
    _TOKENIZER = pickle.loads(tokenizer_bytes) if tokenizer_bytes else None
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="sluice-helper-orphan", daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A gateway killed with SIGKILL cannot stop its helper: the helper leaves once it is reparented (else it
    and the multiprocessing resource tracker, which holds its pipe open, outlive the gateway forever)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _ready() -> bool:
    return True


def _error_tuple(e: APIError) -> tuple[str, int, str, str | None, str | None]:
    return ("error", e.status, e.message, e.param, e.code)


def _child_parse(body: bytes, model: type[BaseModel], limits: RequestLimits) -> tuple[Any, ...]:
    try:
        return ("ok", parse_request(body, model, limits))
    except APIError as e:  # exceptions with custom constructors do not pickle: send the fields
        return _error_tuple(e)


def _child_tokenize(kind: str, payload: Any) -> tuple[Any, ...]:
    try:
        if kind == "chat":
            messages, options = payload
            ids = _TOKENIZER.apply_chat_template(messages, **(options or {}))
        else:
            ids = _TOKENIZER.encode(payload)
    except ValueError as e:
        return ("error", 400, str(e), "messages", "invalid_messages")
    return ("ok", array("i", ids).tobytes())


def _unwrap(result: tuple[Any, ...]) -> Any:
    if result[0] == "error":
        _, status, message, param, code = result
        raise APIError(status, message, param=param, code=code)
    return result[1]


# ---------------------------------------------------------------- the event loop's side


class Offloader:
    """Prepares requests inline when they are small and in one helper process when they are large.

    At most `max_pending` large requests are in the helper at once; more wait (without using CPU) for a
    turn. The process starts on first use, or with the gateway when it calls `warm()` (`[server]
    prepare_helper_at_start`), so the first large request does not wait for it.
    """

    def __init__(self, limits: RequestLimits, *, inline_body_bytes: int = 64 * 1024,
                 inline_prompt_chars: int = 16 * 1024, max_pending: int = 4):
        self.limits = limits
        self.inline_body_bytes = inline_body_bytes
        self.inline_prompt_chars = inline_prompt_chars
        self._tokenizer: Any = None
        self._tokenizer_bytes: bytes | None = None
        self._pool: ProcessPoolExecutor | None = None
        self._slots = asyncio.Semaphore(max_pending)
        self._starting = asyncio.Lock()
        self._warming: asyncio.Task[Any] | None = None
        self._start_thread: threading.Thread | None = None
        self._closed = False

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The engine's tokenizer, once loaded. One that cannot be pickled is used on a thread instead."""
        self._tokenizer = tokenizer
        try:
            self._tokenizer_bytes = pickle.dumps(tokenizer)
        except Exception as e:
            log.info("tokenizer %s cannot go to a helper process (%s); long prompts tokenize on a thread",
                     type(tokenizer).__name__, e)
            self._tokenizer_bytes = None
        self._restart_pool()

    def _restart_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _start_pool(self, niceness: int) -> ProcessPoolExecutor:
        """A started helper (blocking: runs on its own thread, reniced first so that the new process
        inherits the lower priority from its first instruction). Starting one writes the pickled
        tokenizer into a pipe the new process reads only once its interpreter is up, which takes
        seconds on a busy machine: done on the event loop, that write stalled every running stream."""
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_child, initargs=(self._tokenizer_bytes, niceness))
        pool.submit(_ready).result()
        return pool

    async def _get_pool(self) -> ProcessPoolExecutor:
        async with self._starting:
            if self._pool is None:
                loop = asyncio.get_running_loop()
                started: asyncio.Future[ProcessPoolExecutor] = loop.create_future()
                niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + CHILD_NICENESS)

                def settle(pool: ProcessPoolExecutor | None, error: BaseException | None) -> None:
                    # On the loop; kept even when the request that started it went away meanwhile.
                    if pool is not None and self._pool is None and not self._closed:
                        self._pool = pool
                    elif pool is not None:
                        pool.shutdown(wait=False)
                    if started.done():
                        return
                    if self._pool is not None:
                        started.set_result(self._pool)
                    else:
                        started.set_exception(error or RuntimeError("the helper did not start"))

                def start() -> None:
                    pool: ProcessPoolExecutor | None = None
                    error: BaseException | None = None
                    try:
                        pool = self._start_pool(niceness)
                    except BaseException as e:
                        error = e
                    try:
                        loop.call_soon_threadsafe(settle, pool, error)
                    except RuntimeError:  # the loop has closed meanwhile (the gateway stopped)
                        if pool is not None:
                            pool.shutdown(wait=False)

                self._start_thread = threading.Thread(target=start, name="sluice-helper-start", daemon=True)
                self._start_thread.start()
                await asyncio.shield(started)
            assert self._pool is not None
            return self._pool

    async def _run(self, fn: Any, *args: Any) -> Any:
        async with self._slots:
            loop = asyncio.get_running_loop()
            try:
                return _unwrap(await loop.run_in_executor(await self._get_pool(), fn, *args))
            except BrokenProcessPool:  # the helper died (killed, out of memory): start a new one next time
                log.error("the request-preparation helper process died; restarting it")
                self._restart_pool()
                raise APIError(503, "The server could not prepare this request; retry.", code="helper_failed",
                               retry_after=1) from None

    async def parse(self, body: bytes, model: type[M]) -> M:
        if len(body) <= self.inline_body_bytes:
            return parse_request(body, model, self.limits)
        return await self._run(_child_parse, body, model, self.limits)

    async def chat_prompt(self, tokenizer: Any, messages: list[dict[str, Any]],
                          options: dict[str, bool] | None = None) -> Any:
        """Token ids of the templated conversation (a list, or an `array('i')` when it was long); `options`:
        the template's `add_generation_prompt` and `continue_final_message` (default: a new assistant turn)."""
        chars = sum(len(str(m.get("content") or "")) for m in messages)
        if chars <= self.inline_prompt_chars:
            return _apply_template(tokenizer, messages, options)
        return await self._tokenize(tokenizer, "chat", (messages, options))

    async def encode(self, tokenizer: Any, text: str) -> Any:
        if len(text) <= self.inline_prompt_chars:
            return tokenizer.encode(text)
        return await self._tokenize(tokenizer, "text", text)

    async def _tokenize(self, tokenizer: Any, kind: str, payload: Any) -> Any:
        if tokenizer is not self._tokenizer:
            self.set_tokenizer(tokenizer)
        if self._tokenizer_bytes is None:
            async with self._slots:
                return await asyncio.to_thread(
                    lambda: _apply_template(tokenizer, *payload) if kind == "chat" else tokenizer.encode(payload))
        ids = array("i")
        ids.frombytes(await self._run(_child_tokenize, kind, payload))
        return ids

    def warm(self) -> None:
        """Starts the helper now, in the background (at a lower priority), instead of on first use."""
        async def start() -> None:
            try:
                await self._get_pool()
            except Exception as e:  # first use tries again and answers 503 if it cannot
                log.warning("the request-preparation helper did not start: %s", e)
        self._warming = asyncio.create_task(start(), name="sluice-helper-warm")

    def close(self, start_wait_s: float = 10.0) -> None:
        """Stops the helper. One still starting is waited for (at most `start_wait_s`): a process that
        exits while its new helper still reads its start-up pipe leaves that helper a stack trace
        (its semaphores gone) in the server's log."""
        self._closed = True
        if self._warming is not None:
            self._warming.cancel()
        thread = self._start_thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(start_wait_s)
        self._restart_pool()


OFFLOAD: web.AppKey[Offloader] = web.AppKey("sluice_offload", Offloader)


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]],
                    options: dict[str, bool] | None = None) -> list[int]:
    try:
        if options and (options.get("continue_final_message") or not options.get("add_generation_prompt", True)):
            return tokenizer.apply_chat_template(messages, **options)
        return tokenizer.apply_chat_template(messages)
    except ValueError as e:  # the model's chat template refuses this conversation
        raise APIError(400, str(e), param="messages", code="invalid_messages") from None


__all__ = ["OFFLOAD", "Offloader", "RequestLimits", "check_limits", "parse_request"]
