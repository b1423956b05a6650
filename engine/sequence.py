"""One request's state inside the engine: its tokens, how many have KV in the cache, and its blocks.

Writers: the scheduler owns progress (`status`, `num_computed_tokens`, `output_token_ids` through
`append_output`, which also advances the grammar matcher and the penalty counts, `finish_reason`); the
block manager owns `block_table` and `block_hashes`. The model runner and the output processor only read.
"""

from __future__ import annotations

import enum
import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from .guide import GuideMatcher
from .request import EngineRequest, FinishReason, SamplingParams

_order = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    arrival_time: float
    max_tokens: int  # the output limit (the request's; the engine refuses one that cannot fit)
    output_token_ids: list[int] = field(default_factory=list)
    num_resumed_tokens: int = 0  # outputs produced elsewhere before a retry (never re-emitted)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache on first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks, in order
    cache_salt: str | None = None  # prefix-cache isolation: only sequences with the same salt share blocks
    stop_token_ids: frozenset[int] = frozenset()  # sampling a token in this set finishes with "stop"
    num_preemptions: int = 0
    # Fair prefill: the step cost this sequence may still spend on prefill chunks while decodes run
    # (written by the scheduler; starts unlimited, capped at the scheduler's burst when used).
    prefill_credit: float = math.inf
    finish_reason: FinishReason | None = None
    # The sampler's noise is a pure function of (seed, token index): unseeded requests get a random seed
    # of their own, and a resumed request continues its stream at its first new token.
    noise_seed: int = field(default_factory=lambda: random.getrandbits(62))
    order: int = field(default_factory=lambda: next(_order))  # tie-break for equal arrival times
    guide: GuideMatcher | None = None  # constrained decoding: the grammar's state after output_token_ids
    # Penalties, kept up to date token by token (only for requests that use them): counts of the
    # generated tokens (frequency/presence), and the distinct prompt + generated tokens (repetition).
    output_counts: dict[int, int] = field(default_factory=dict)
    seen_token_ids: dict[int, None] = field(default_factory=dict)  # an ordered set

    @classmethod
    def from_request(cls, req: EngineRequest, max_tokens: int, eos_token_ids: Iterable[int] = ()) -> Sequence:
        """`eos_token_ids` stop the sequence too, unless the request sets `ignore_eos`."""
        stop_ids = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stop_ids.update(eos_token_ids)
        seq = cls(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), sampling=req.sampling,
                  priority=req.priority, arrival_time=req.arrival_time, max_tokens=max_tokens,
                  output_token_ids=list(req.resume_token_ids), num_resumed_tokens=len(req.resume_token_ids),
                  cache_salt=req.cache_salt, stop_token_ids=frozenset(stop_ids))
        sp = req.sampling
        if sp.presence_penalty != 0 or sp.frequency_penalty != 0:
            for t in seq.output_token_ids:
                seq.output_counts[t] = seq.output_counts.get(t, 0) + 1
        if sp.repetition_penalty != 1:
            seq.seen_token_ids = dict.fromkeys(seq.prompt_token_ids + seq.output_token_ids)
        if req.sampling.seed is not None:
            seq.noise_seed = req.sampling.seed & (2**62 - 1)
        return seq

    def append_output(self, token_id: int) -> None:
        """The scheduler's one way to add a sampled token: the penalty state and the grammar follow it."""
        self.output_token_ids.append(token_id)
        sp = self.sampling
        if sp.presence_penalty != 0 or sp.frequency_penalty != 0:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        if sp.repetition_penalty != 1:
            self.seen_token_ids[token_id] = None
        if self.guide is not None:
            self.guide.advance(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """The tokens at positions [start, end) of prompt + output (all of them by default)."""
        p = len(self.prompt_token_ids)
        if end is not None and end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:None if end is None else end - p]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token still needs computing (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed > 1

    @property
    def num_new_outputs(self) -> int:
        return len(self.output_token_ids) - self.num_resumed_tokens

    def stop_reason(self) -> FinishReason | None:
        """Why the sequence ends after its newest token: a stop token, else the output limit (None: it goes on)."""
        if self.guide is not None and self.guide.error is not None:
            return "error"
        if self.output_token_ids[-1] in self.stop_token_ids:
            return "stop"
        if self.guide is not None and self.guide.complete:
            return "stop"
        if len(self.output_token_ids) >= self.max_tokens:
            return "length"
        return None
