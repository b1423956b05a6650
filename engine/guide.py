"""Constrained decoding with llguidance: each guided sequence samples only tokens its grammar allows.

`Guides` (one per engine) builds llguidance's tokenizer from the engine's own when the first grammar
arrives (it holds ~80 MB for a 128k vocabulary, so an engine that never constrains never pays it), compiles
each distinct (kind, spec) once (an LRU cache; a spec that does not compile is remembered too, so a
repeated bad schema costs nothing), and hands every guided sequence its own `GuideMatcher`, a copy of
the compiled matcher. Each step the model runner asks `fill_bitmask` for the token masks of the guided
rows (one bit per vocabulary entry); the scheduler advances a sequence's matcher with each token it
appends (`Sequence.append_output`), and the sequence finishes with "stop" once the grammar is complete.

Compiling runs on a thread of its own (`submit`), never on the engine's or the event loop's: a large
schema takes seconds, and llguidance drops the GIL while it builds. The engine schedules a guided
request only once its ticket is done. `GuideLimits` is the compile budget (size, time) and the
first-token walk that turns grammars which compile but cannot produce an output into a rejection
before the request is scheduled.

Preemption and recompute keep a sequence's generated tokens, and the matcher has consumed exactly those,
so it stays valid; a request resumed elsewhere replays its resumed tokens into a fresh matcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

from .request import Guide, RequestRejected

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

log = logging.getLogger(__name__)

# JSON in a fixed layout (", " and ": ", no other whitespace), as json.dumps writes it: free whitespace
# lets a small model pad forever. A schema may override it with llguidance's "x-guidance" options.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                                "key_separator": ": "}


@dataclass
class GuideStats:
    """Counters for benchmarks and metrics: grammar compiles and per-row token masks."""

    compiles: int = 0
    compile_seconds: float = 0.0
    masks: int = 0  # token masks computed (a guided row's step, where its sampled token was not checked first)
    checks: int = 0  # sampled tokens checked against their grammar instead of a mask
    mask_seconds: float = 0.0  # host time computing them


class GuideMatcher:
    """One sequence's position in its grammar. Advanced only by the scheduler, through the sequence."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token_id: int) -> None:
        """Consumes a sampled token (a token the mask forbade puts the matcher in its error state)."""
        self.matcher.consume_token(token_id)

    @property
    def error(self) -> str | None:
        return (self.matcher.get_error() or "error") if self.matcher.is_error() else None

    @property
    def complete(self) -> bool:
        """No further token is allowed (the grammar is finished, or its stop token was consumed)."""
        return self.matcher.is_stopped()


@dataclass(frozen=True)
class GuideLimits:
    """What one grammar may cost, so a single request cannot freeze the engine or its neighbours.

    A spec is refused before compiling when it is larger than `max_spec_bytes` or one JSON object in
    it has more than `max_object_properties` properties (llguidance's compile time grows with the square
    of an object's optional properties: 2,000 take ~0.3 s, 8,000 ~4 s). A compile, with the walk that
    checks the grammar's first tokens, that has not finished `compile_timeout_s` after it was submitted
    is refused too. Each mask step is bounded by llguidance's own fuel limits (`step_lexer_fuel`,
    `step_max_items`: a few milliseconds); a grammar that exhausts them fails its request only."""

    compile_timeout_s: float = 1.5
    max_spec_bytes: int = 1 << 20
    max_object_properties: int = 2048
    walk_steps: int = 16  # mask / forced-token rounds of the first-token walk
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        # verbose_errors=False: errors name the problem without dumping the parser's state and grammar.
        return llguidance.LLParserLimits(step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
                                         verbose_errors=False)


@dataclass
class TokenizerClock:
    """When llguidance's tokenizer became ready (monotonic seconds; None while not yet built): the
    compile budget of the grammars that waited for it starts there."""

    ready_at: float | None = None


class CompileTicket:
    """A grammar on its way: `done` once compiled or refused; `matcher()` then gives the sequence its
    matcher or raises RequestRejected. Written by the compile thread, read by the engine thread."""

    def __init__(self, guide: Guide, replay: list[int], timeout_s: float, clock: TokenizerClock | None = None):
        self.guide = guide
        self.replay = list(replay)
        self.submitted = time.monotonic()
        self.timeout_s = timeout_s
        self._clock = clock
        self._done = threading.Event()
        self._result: GuideMatcher | RequestRejected | None = None
        self._finished_at = float("inf")

    @property
    def deadline(self) -> float:
        """When the compile budget runs out: `timeout_s` from submission, or from when llguidance's
        tokenizer was ready if that came later (its one-off build is not the grammar's cost); no deadline
        while that build runs."""
        ready = 0.0 if self._clock is None else self._clock.ready_at
        if ready is None:
            return float("inf")
        return max(self.submitted, ready) + self.timeout_s

    def _finish(self, result: GuideMatcher | RequestRejected) -> None:
        self._result = result
        self._finished_at = time.monotonic()
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set() or time.monotonic() >= self.deadline

    def matcher(self) -> GuideMatcher:
        """The compiled matcher; refused when the compile finished after its budget ran out, whenever the
        engine looks (a compile that lands between `done` turning true and this call is still late)."""
        if not self._done.is_set() or self._finished_at > self.deadline:
            raise RequestRejected(f"the grammar did not compile within {self.timeout_s:g} s (the compile budget); "
                                  "simplify the schema", code="invalid_grammar", param=_PARAM)
        assert self._result is not None
        if isinstance(self._result, RequestRejected):
            raise self._result
        return self._result


class Guides:
    """Compiles grammars off the engine thread (one compile thread, at a lower CPU priority than the
    engine) and hands out per-sequence matchers."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int],
                 stats: GuideStats, cache_size: int = 64, limits: GuideLimits | None = None,
                 tokenizer_at_start: bool = False):
        self._tokenizer_json = tokenizer_json  # called once, when llguidance's tokenizer is built
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.stats = stats
        self.cache_size = cache_size
        self.limits = limits or GuideLimits()
        self.words = (vocab_size + 31) // 32  # int32 words per row of a bitmask
        self._tokenizer: llguidance.LLTokenizer | str | None = None  # str: why it could not be built
        self.clock = TokenizerClock()
        self.tokenizer_at_start = tokenizer_at_start
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the tokenizer: the compile and engine threads share them
        self._executor: llguidance.LLExecutor | None = None
        self._jobs: queue.SimpleQueue[CompileTicket | None] = queue.SimpleQueue()
        self.compiled = threading.Event()  # set whenever a ticket finishes (the engine waits on it when idle)
        # The compile thread builds llguidance's tokenizer before the first grammar, or at start with
        # `tokenizer_at_start`: 0.2 s (49k vocabulary) to 0.5 s (128k) that holds the GIL, so the first
        # guided request stalls running streams once by that much unless the engine pays it at start.
        self._thread = threading.Thread(target=self._run_compiles, name="sluice-grammar", daemon=True)
        self._thread.start()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer | str:
        with self._lock:
            if self._tokenizer is None:
                t0 = time.perf_counter()
                try:
                    self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                             eos_token=self.eos_token_ids or None)
                    log.info("constrained decoding: llguidance tokenizer built in %.2fs", time.perf_counter() - t0)
                except Exception as e:  # llguidance raises plain exceptions for tokenizers it cannot read
                    self._tokenizer = f"this model's tokenizer is not supported by the grammar engine ({e})"
                    log.warning("constrained decoding unavailable: %s", self._tokenizer)
                self.clock.ready_at = time.monotonic()
            return self._tokenizer

    # -- compiling -------------------------------------------------------------------------------
    def cached(self, guide: Guide) -> llguidance.LLMatcher | str | None:
        key = (guide.kind, guide.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _remember(self, guide: Guide, result: llguidance.LLMatcher | str) -> None:
        with self._lock:
            self._cache[(guide.kind, guide.spec)] = result
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _compile(self, guide: Guide) -> llguidance.LLMatcher | str:
        """The compiled matcher of (kind, spec), or the reason it cannot be used (both cached)."""
        hit = self.cached(guide)
        if hit is not None:
            return hit
        tok = self._llg_tokenizer()
        if isinstance(tok, str):
            return tok
        t0 = time.perf_counter()
        result = self._build(guide, tok)
        self.stats.compiles += 1
        self.stats.compile_seconds += time.perf_counter() - t0
        self._remember(guide, result)
        return result

    def _build(self, guide: Guide, tok: llguidance.LLTokenizer) -> llguidance.LLMatcher | str:
        what = _WHAT[guide.kind]
        too_big = self._too_big(guide)
        if too_big:
            return f"{what}: {too_big}"
        try:
            if guide.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(guide.spec, defaults=JSON_DEFAULTS)
            elif guide.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}),
                                                                        defaults=JSON_DEFAULTS)
            elif guide.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(guide.spec)
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(guide.spec)
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=self.limits.parser_limits())
        except ValueError as e:  # grammar_from_json_schema: the schema is not a JSON object
            return f"{what}: {clean_error(str(e))}"
        if matcher.is_error():
            return f"{what}: {clean_error(matcher.get_error())}"
        failure = self._walk(matcher)
        return f"{what}: {failure}" if failure else matcher

    def _too_big(self, guide: Guide) -> str | None:
        """Why the spec is over the compile budget before compiling it (None: within it)."""
        lim = self.limits
        if len(guide.spec.encode()) > lim.max_spec_bytes:
            return f"the spec is larger than the compile budget of {lim.max_spec_bytes} bytes"
        if guide.kind != "json_schema":
            return None
        try:
            schema = json.loads(guide.spec)
        except ValueError:
            return None  # llguidance says what is wrong with it
        widest = _widest_object(schema)
        if widest > lim.max_object_properties:
            return (f"an object has {widest} properties, more than the compile budget of "
                    f"{lim.max_object_properties}")
        return None

    def _walk(self, matcher: llguidance.LLMatcher) -> str | None:
        """Follows the grammar's first tokens on a copy: forced tokens, and each of the few tokens a narrow
        mask allows. A grammar that compiles but has no finite instance (a required self-reference, a
        $ref loop) or whose lexer or parser blows its limits fails here, before its request is
        scheduled, instead of at its first sampled token. Returns why it failed (None: usable)."""
        m = matcher.deep_copy()
        mask = bytearray(self.words * 4)
        for _ in range(self.limits.walk_steps):
            m.unsafe_compute_mask_ptr(_address(mask), len(mask))
            if m.is_error():
                return clean_error(m.get_error())
            if m.is_stopped():
                return None
            forced = m.compute_ff_tokens()
            if m.is_error():
                return clean_error(m.get_error())
            if forced:
                m.consume_tokens(forced)
                if m.is_error():
                    return clean_error(m.get_error())
                continue
            allowed = _allowed(mask, self.vocab_size, limit=8)
            if allowed is None:
                return None  # a wide mask: free text from here
            if not allowed:
                return "no token can start the output"
            nxt = None
            for t in allowed:
                c = m.deep_copy()
                c.consume_token(t)
                if c.is_error():
                    return clean_error(c.get_error())
                if nxt is None and not c.is_stopped():
                    nxt = c
            if nxt is None:
                return None  # only stop tokens are left: the grammar is complete
            m = nxt
        return None

    def _run_compiles(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # the engine's threads go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
        if self.tokenizer_at_start:
            self._llg_tokenizer()
        while (ticket := self._jobs.get()) is not None:
            try:
                result: GuideMatcher | RequestRejected = self._new_matcher(ticket.guide, ticket.replay)
            except RequestRejected as e:
                result = e
            except Exception as e:  # a grammar library failure fails its request only
                log.exception("compiling a %s grammar failed", ticket.guide.kind)
                result = RequestRejected(f"{_WHAT[ticket.guide.kind]}: {type(e).__name__}", code="invalid_grammar",
                                         param=_PARAM)
            ticket._finish(result)
            self.compiled.set()

    def submit(self, guide: Guide, replay: list[int]) -> CompileTicket:
        """Queues the grammar's compile on the compile thread (a cached one is ready at once)."""
        ticket = CompileTicket(guide, replay, self.limits.compile_timeout_s, self.clock)
        if self.cached(guide) is not None:
            try:
                ticket._finish(self._new_matcher(guide, replay))
            except RequestRejected as e:
                ticket._finish(e)
            return ticket
        self._jobs.put(ticket)
        return ticket

    def close(self) -> None:
        self._jobs.put(None)

    def _new_matcher(self, guide: Guide, replay: list[int]) -> GuideMatcher:
        compiled = self._compile(guide)
        if isinstance(compiled, str):
            raise RequestRejected(compiled, code="invalid_grammar", param=_PARAM)
        m = GuideMatcher(compiled.deep_copy())
        if replay:
            m.matcher.consume_tokens(replay)
            if m.error is not None:
                raise RequestRejected(f"the resumed tokens do not follow the grammar: {m.error}",
                                      code="invalid_grammar", param=_PARAM)
            if m.complete:
                raise RequestRejected("the resumed tokens already complete the grammar", code="invalid_grammar",
                                      param=_PARAM)
        return m

    def matcher(self, guide: Guide, replay: list[int]) -> GuideMatcher:
        """A fresh matcher for one sequence, advanced past `replay` (resumed tokens), compiled on the
        calling thread (tests and tools; the engine uses `submit`).

        Raises RequestRejected (code "invalid_grammar") when the grammar does not compile, or the replayed
        tokens do not follow it (or already complete it)."""
        return self._new_matcher(guide, replay)

    def allows(self, m: GuideMatcher, token_id: int) -> bool:
        """Whether the matcher's grammar allows `token_id` next (without consuming it)."""
        self.stats.checks += 1
        return 0 <= token_id < self.vocab_size and m.matcher.validate_tokens([token_id]) == 1

    def fill_bitmask(self, matchers: list[GuideMatcher], pin_memory: bool = False) -> torch.Tensor:
        """int32 [len(matchers), words] on the host: row i is the mask of matchers[i]'s next token."""
        t0 = time.perf_counter()
        mask = torch.empty((len(matchers), self.words), dtype=torch.int32, pin_memory=pin_memory)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                               self.words * 4, len(matchers))
        self.stats.masks += len(matchers)
        self.stats.mask_seconds += time.perf_counter() - t0
        return mask


COMPILE_NICE = 19  # the compile thread's niceness: it takes CPU the engine's step leaves idle first


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _allowed(mask: bytearray, vocab_size: int, limit: int) -> list[int] | None:
    """The token ids a bitmask allows, or None when there are more than `limit`."""
    bits = int.from_bytes(mask, "little")
    if bits.bit_count() > limit:
        return None
    out = []
    while bits:
        low = bits & -bits
        t = low.bit_length() - 1
        if t < vocab_size:
            out.append(t)
        bits ^= low
    return out


def _widest_object(schema: object) -> int:
    """The largest number of properties any one object of a JSON schema lists (iteratively: the gateway
    bounds nesting, the engine does not rely on it)."""
    widest, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return widest


def clean_error(message: str) -> str:
    """llguidance's error without its trailing state dump (`<state>`, `<non-verbose/>`, backtraces)."""
    for marker in ("\n<state>", "\n<non-verbose/>", "\n<backtrace>"):
        message = message.split(marker)[0]
    return message.strip()


_PARAM = "response_format"
_WHAT = {"json_schema": "the JSON schema is not supported", "json_object": "json_object",
         "lark": "the grammar is not supported", "regex": "the regular expression is not supported"}
