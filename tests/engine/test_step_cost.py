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
