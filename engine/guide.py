"""Constrained decoding with llguidance: each guided sequence samples only tokens its grammar allows.

`Guides` (one per engine) builds llguidance's tokenizer from the engine's own on first use, compiles
each distinct (kind, spec) once (an LRU cache; a spec that does not compile is remembered too, so a
repeated bad schema costs nothing), and hands every guided sequence its own `GuideMatcher`, a copy of
the compiled matcher. Each step the model runner asks `fill_bitmask` for the token masks of the guided
rows (one bit per vocabulary entry); the scheduler advances a sequence's matcher with each token it
appends (`Sequence.append_output`), and the sequence finishes with "stop" once the grammar is complete.

Preemption and recompute keep a sequence's generated tokens, and the matcher has consumed exactly those,
so it stays valid; a request resumed elsewhere replays its resumed tokens into a fresh matcher at add.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
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
    masks: int = 0  # token masks computed (one per guided row per step)
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


class Guides:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], stats: GuideStats,
                 cache_size: int = 64):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.stats = stats
        self.cache_size = cache_size
        self.words = (vocab_size + 31) // 32  # int32 words per row of a bitmask
        self._tokenizer: llguidance.LLTokenizer | str | None = None  # str: why it could not be built
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher | str] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None

    def _llg_tokenizer(self) -> llguidance.LLTokenizer | str:
        if self._tokenizer is None:
            t0 = time.perf_counter()
            try:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids or None)
                log.info("constrained decoding: llguidance tokenizer built in %.2fs", time.perf_counter() - t0)
            except Exception as e:  # llguidance raises plain exceptions for tokenizers it cannot read
                self._tokenizer = f"this model's tokenizer is not supported by the grammar engine ({e})"
                log.warning("constrained decoding unavailable: %s", self._tokenizer)
        return self._tokenizer

    def _compile(self, guide: Guide) -> llguidance.LLMatcher | str:
        """The compiled matcher of (kind, spec), or the reason it does not compile."""
        key = (guide.kind, guide.spec)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        tok = self._llg_tokenizer()
        if isinstance(tok, str):
            return tok
        t0 = time.perf_counter()
        result: llguidance.LLMatcher | str
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
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
            result = f"{_WHAT[guide.kind]}: {matcher.get_error()}" if matcher.is_error() else matcher
        except ValueError as e:  # grammar_from_json_schema: the schema is not a JSON object
            result = f"{_WHAT[guide.kind]}: {e}"
        self.stats.compiles += 1
        self.stats.compile_seconds += time.perf_counter() - t0
        self._cache[key] = result
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return result

    def matcher(self, guide: Guide, replay: list[int]) -> GuideMatcher:
        """A fresh matcher for one sequence, advanced past `replay` (resumed tokens).

        Raises RequestRejected (code "invalid_grammar") when the grammar does not compile, or the replayed
        tokens do not follow it (or already complete it)."""
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


_PARAM = "response_format"
_WHAT = {"json_schema": "the JSON schema is not supported", "json_object": "json_object",
         "lark": "the grammar is not supported", "regex": "the regular expression is not supported"}
