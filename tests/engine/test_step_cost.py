"""The scheduler's step cost model: the chunk it allows is the largest within a budget, and the start-up
fit recovers the coefficients behind three timings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.step_cost import StepCost


@given(per_row=st.floats(1e-5, 1e-2), per_pair=st.floats(0, 1e-5), start=st.integers(0, 100_000),
       budget=st.floats(0, 5.0), limit=st.integers(0, 600))
def test_max_chunk_is_the_largest_chunk_within_the_budget(per_row, per_pair, start, budget, limit):
    cost = StepCost(base=0.002, per_row=per_row, per_pair=per_pair)
    n = cost.max_chunk(start, budget, limit)
    assert 0 <= n <= limit
    if n:
        assert cost.chunk(n, start) <= budget
    if n < limit:
        assert cost.chunk(n + 1, start) > budget


def test_a_chunk_deep_in_a_context_costs_its_attention():
    cost = StepCost(base=0.002, per_row=0.0005, per_pair=4e-7)
    assert StepCost.chunk_pairs(3, 10) == 11 + 12 + 13
    assert cost.chunk(256, 8000) > 6 * cost.chunk(256, 0)
    assert cost.max_chunk(8000, cost.chunk(256, 0), 256) < 48


def test_fit_recovers_the_coefficients_of_three_timings():
    truth = StepCost(base=0.003, per_row=0.0004, per_pair=3e-7)
    n, deep, ctx = 64, 1024, 16
    one = truth.of(1, ctx)
    at_zero = truth.of(n, StepCost.chunk_pairs(n, 0))
    at_deep = truth.of(n, StepCost.chunk_pairs(n, deep))
    got = StepCost.fit(one, at_zero, at_deep, n, deep, one_row_context=ctx)
    assert got.base == pytest.approx(truth.base)
    assert got.per_row == pytest.approx(truth.per_row)
    assert got.per_pair == pytest.approx(truth.per_pair)
    assert got.seconds and not truth.seconds  # a timed model is in seconds (the scheduler's time cap reads it)


def _contended_timer(true: StepCost, n: int, deep: int, slow_calls: int, factor: float = 3.0):
    """`timed(kind)` of a machine whose first `slow_calls` timings run `factor` times slower (other
    engines loading beside the measurement at start)."""
    calls = []

    def timed(kind: str) -> float:
        calls.append(kind)
        t = {"one": true.of(1, 16), "zero": true.base + true.chunk(n, 0), "deep": true.base + true.chunk(n, deep)}[kind]
        return t * (factor if len(calls) <= slow_calls else 1.0)
    return timed


@pytest.mark.parametrize("slow_calls", [0, 3, 6])
def test_measure_keeps_the_attention_term_through_contention_at_start(slow_calls):
    """Contention over the first few timings (six: every one-row and chunk-at-zero run of a measurement
    that takes the best of three separate runs of each, which then reads the attention term as 0)
    leaves the median of paired differences within 10% of the true term."""
    true = StepCost(base=0.004, per_row=0.0008, per_pair=7e-7)
    got = StepCost.measure(_contended_timer(true, 64, 2048, slow_calls), 64, 2048, repeats=3)
    assert got.per_pair == pytest.approx(true.per_pair, rel=0.1), got
    assert got.per_row == pytest.approx(true.per_row, rel=0.25), got


def test_calibration_learns_a_chunks_real_cost_relative_to_decodes():
    """Steps that all run 1.3x slower than predicted (a busier machine) leave chunks' bias at 1; chunks
    that cost 2x their prediction on top of that move it to 2; tiny chunks and noise past the limits
    do not move it."""
    from engine.step_cost import ChunkCalibration

    c = ChunkCalibration()
    for _ in range(100):
        c.observe(0.002, 0.008, 0.0, 1.3 * 0.010)
        c.observe(0.002, 0.008, 0.005, 1.3 * 0.015)
    assert abs(c.decode_scale - 1.3) < 0.01 and abs(c.bias - 1.0) < 0.01
    for _ in range(100):
        c.observe(0.002, 0.008, 0.0, 1.3 * 0.010)
        c.observe(0.002, 0.008, 0.005, 1.3 * (0.010 + 2 * 0.005))
    assert abs(c.bias - 2.0) < 0.01
    before = c.bias
    c.observe(0.002, 0.008, 0.0001, 5.0)  # a chunk of 1% of its step: not observed
    assert c.bias == before
    for _ in range(100):
        c.observe(0.002, 0.008, 0.005, 60.0)  # a stall: capped
    assert c.bias == pytest.approx(c.limits[1], rel=1e-3)


def test_measure_stops_after_a_round_too_long_for_contention_to_matter():
    """Rounds of 3 s (deterministic mode on an AVX2 box) stop after the first; rounds of milliseconds
    take all three, which the contention test above relies on."""
    calls: list[str] = []

    def timed(kind: str) -> float:
        calls.append(kind)
        return {"one": 0.3, "zero": 1.0, "deep": 1.7}[kind]

    got = StepCost.measure(timed, 64, 1024, repeats=3)
    assert calls == ["zero", "deep", "one", "zero", "deep"]
    assert got.per_pair == pytest.approx(0.7 / (64 * 1024))
    calls.clear()
    StepCost.measure(lambda kind: calls.append(kind) or 0.01, 64, 1024, repeats=3)
    assert len(calls) == 2 + 3 * 3
