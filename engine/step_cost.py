"""What a step costs, so the scheduler can bound it by work rather than by tokens alone.

A prefill chunk deep in a long context costs far more than its token count says: each of its rows
attends to every earlier position. `StepCost` predicts a step's time as

    base + per_row * rows + per_pair * pairs

where `pairs` counts (query row, cached key) pairs, the attention's work. The model runner measures
the three coefficients at start on synthetic steps (`ModelRunner.measure_step_cost`); the scheduler
only ever compares predictions with each other (a decode batch's cost, a chunk's cost, the step cap),
so the unit does not matter and a default model (one unit per row, no attention term) keeps the
token-count behaviour where nothing was measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

LONG_ROUND_S = 1.5  # a measuring round this long is enough alone (`StepCost.measure`)


@dataclass(frozen=True)
class StepCost:
    base: float = 0.0
    per_row: float = 1.0
    per_pair: float = 0.0
    seconds: bool = False  # measured, in seconds (the default model counts rows)

    def of(self, rows: int, pairs: int) -> float:
        """A whole step of `rows` rows attending over `pairs` (row, key) pairs in all."""
        return self.base + self.per_row * rows + self.per_pair * pairs

    @staticmethod
    def chunk_pairs(n: int, start: int) -> int:
        """(row, key) pairs of a chunk of n rows at positions [start, start + n): row p sees p + 1 keys."""
        return n * start + n * (n + 1) // 2

    def chunk(self, n: int, start: int) -> float:
        """The added cost of a prefill chunk of n tokens from position `start` (no base: it joins a step)."""
        return self.per_row * n + self.per_pair * self.chunk_pairs(n, start)

    def max_chunk(self, start: int, budget: float, limit: int) -> int:
        """The most tokens (at most `limit`) from position `start` whose chunk costs no more than `budget`."""
        if limit <= 0 or budget <= 0:
            return 0
        if self.chunk(limit, start) <= budget:
            return limit
        # per_pair/2 n^2 + (per_row + per_pair (start + 1/2)) n - budget = 0, then fix rounding.
        a, b = self.per_pair / 2, self.per_row + self.per_pair * (start + 0.5)
        n = int(budget / b) if a == 0 else int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
        n = max(0, min(n, limit))
        while n > 0 and self.chunk(n, start) > budget:
            n -= 1
        while n < limit and self.chunk(n + 1, start) <= budget:
            n += 1
        return n

    @classmethod
    def fit(cls, one_row: float, chunk_at_zero: float, chunk_deep: float, n: int, deep_start: int,
            one_row_context: int) -> StepCost:
        """From three timings: a 1-row decode over `one_row_context` keys, an n-row chunk at position 0
        and the same chunk from position `deep_start`. Negative estimates (noise) become zero."""
        per_pair = max(0.0, (chunk_deep - chunk_at_zero) / (n * deep_start))
        pairs0 = cls.chunk_pairs(n, 0)
        per_row = max(1e-9, (chunk_at_zero - one_row - per_pair * (pairs0 - one_row_context)) / (n - 1))
        base = max(0.0, one_row - per_row - per_pair * one_row_context)
        return cls(base=base, per_row=per_row, per_pair=per_pair, seconds=True)

    @classmethod
    def measure(cls, timed: Callable[[str], float], n: int, deep_start: int, repeats: int,
                one_row_context: int = 16, long_round_s: float = LONG_ROUND_S) -> StepCost:
        """`fit` from timings taken by `timed(kind)` (kind: "one", "zero" or "deep", the steps `fit` names).
        The chunks run in turns after a warm-up run of each, and the attention term comes from the median
        of their paired differences: contention that comes and goes (at start the other engines and the
        request helper load beside this) then slows both sides of a difference or only one round, where
        the best of a few separate runs of each put the term anywhere from 0 to 7x its value.

        A round that takes `long_round_s` or more is the last (deterministic mode's per-token attention
        takes ~3 s a round on an AVX2 box): contention of some milliseconds cannot move timings that
        long, and each further round would add its seconds to every start."""
        timed("zero"), timed("deep")
        ones, zeros, extra = [], [], []
        for _ in range(repeats):
            ones.append(timed("one"))
            zeros.append(timed("zero"))
            deep = timed("deep")
            extra.append(deep - zeros[-1])
            if ones[-1] + zeros[-1] + deep >= long_round_s:
                break
        zero = statistics.median(zeros)
        return cls.fit(statistics.median(ones), zero, zero + statistics.median(extra), n, deep_start,
                       one_row_context)

    def describe(self) -> str:
        return (f"{self.base * 1e3:.2f} ms + {self.per_row * 1e3:.3f} ms/row + "
                f"{self.per_pair * 1e9:.1f} ns per attended (row, key) pair")


@dataclass
class ChunkCalibration:
    """How much a prefill chunk really costs against the model's prediction, learned from the steps that
    run (`observe`). The model is timed once at start on a 64-row chunk; under load the chunks that share
    steps with decodes are 16-20 rows deep in a long context, where the weights and the cached keys are
    reused over fewer rows, and the served process (event loop, request helper) takes its own slice of
    the cores. A chunk that costs 1.5x its prediction takes 1.5 streams' shares instead of one, and the
    streams beside it slow by that much more. The scheduler scales chunk costs by `bias` so a prefill's
    share is one of real time.

    Decode-only steps give the scale of the model's decode predictions (`decode_scale`); a step with a
    chunk gives the chunk's real cost as what the step took beyond its decodes' (scaled) prediction.
    Both are moving averages; a chunk that is a small part of its step says little and is skipped."""

    bias: float = 1.0  # a chunk's real cost / its predicted cost, relative to decodes'
    decode_scale: float = 1.0  # a decode-only step's real time / its predicted time
    alpha: float = 0.1  # weight of each new observation
    min_share: float = 0.1  # a chunk under this part of its step's prediction is not observed
    limits: tuple[float, float] = (0.5, 4.0)  # bias stays within these
    observed: int = 0  # chunk steps observed

    def observe(self, base: float, decode_cost: float, chunk_cost: float, seconds: float) -> None:
        """One step that ran: `base` and `decode_cost` as the model predicts them, `chunk_cost` the
        predicted cost of its prefill chunks without the bias, `seconds` what it took."""
        if seconds <= 0 or base + decode_cost <= 0:
            return
        if chunk_cost <= 0:
            sample = seconds / (base + decode_cost)
            self.decode_scale += self.alpha * (sample - self.decode_scale)
            return
        if decode_cost <= 0 or chunk_cost < self.min_share * (base + decode_cost + chunk_cost):
            return
        sample = (seconds / self.decode_scale - base - decode_cost) / chunk_cost
        sample = min(max(sample, self.limits[0]), self.limits[1])
        self.bias += self.alpha * (sample - self.bias)
        self.observed += 1
