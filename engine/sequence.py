"""One request's state inside the engine: its tokens, how many have KV in the cache, and its blocks."""

from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass, field

import torch

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
    max_tokens: int  # the effective output limit (request, model context and req_max_output_len)
    output_token_ids: list[int] = field(default_factory=list)
    num_resumed_tokens: int = 0  # outputs produced elsewhere before a retry (never re-emitted)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache on first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks, in order
    cache_salt: str | None = None  # prefix-cache isolation: only sequences with the same salt share blocks
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    # The device sampler's noise is a pure function of (seed, token index): unseeded requests get a
    # random seed of their own.
    noise_seed: int = field(default_factory=lambda: random.getrandbits(62))
    order: int = field(default_factory=lambda: next(_order))  # tie-break for equal arrival times

    @classmethod
    def from_request(cls, req: EngineRequest, max_tokens: int, vocab_size: int = 0) -> "Sequence":
        seq = cls(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), sampling=req.sampling,
                  priority=req.priority, arrival_time=req.arrival_time, max_tokens=max_tokens,
                  output_token_ids=list(req.resume_token_ids), num_resumed_tokens=len(req.resume_token_ids),
                  cache_salt=req.cache_salt)
        if req.sampling.seed is not None:
            seq.noise_seed = req.sampling.seed & (2**62 - 1)
            seq.generator = torch.Generator().manual_seed(req.sampling.seed)
            # A resumed request continues the same random stream, as if it had never stopped: the
            # sampler draws one number per vocabulary entry per token.
            if seq.num_resumed_tokens and req.sampling.temperature > 0:
                torch.empty(seq.num_resumed_tokens, vocab_size).exponential_(generator=seq.generator)
        return seq

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.token_ids()[start:end]

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
