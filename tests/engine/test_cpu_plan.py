"""The CPU step plan: per step size, packed or dense weights and a thread count, chosen by timing."""

import json

import pytest
import torch

from engine import cpu_plan
from engine.cpu_plan import Choice, CpuKernels, Plan, measure_plan, thread_candidates, wide_thresholds


def test_plan_looks_up_the_smallest_bucket_that_holds_the_step():
    plan = Plan((1, 4, 16), (Choice(True, 1), Choice(True, 2), Choice(False, 2)), Choice(False, 4))
    assert plan.for_rows(1) == Choice(True, 1)
    assert plan.for_rows(2) == plan.for_rows(4) == Choice(True, 2)
    assert plan.for_rows(5) == Choice(False, 2)
    assert plan.for_rows(17) == plan.for_rows(10_000) == Choice(False, 4)
    assert plan.packed_max_rows() == 4
    assert Plan.fixed(3).for_rows(1) == Choice(False, 3)
    assert Plan.fixed(3, packed_max_rows=8).for_rows(8) == Choice(True, 3)
    assert Plan.fixed(3, packed_max_rows=8).for_rows(9) == Choice(False, 3)


def test_thread_candidates_are_one_powers_of_two_and_all_at_most_four():
    assert thread_candidates(1) == [1]
    assert thread_candidates(2) == [1, 2]
    assert thread_candidates(16) == [1, 2, 4, 16]


class _Clock:
    """A virtual perf_counter: the fake steps advance it by their cost, so the plan does not depend on how
    a loaded machine (a CI run beside) wakes sleeping threads (1 ms margins flipped there)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(cpu_plan, "time", c)
    return c


def _fake(cost: dict[tuple[bool, int], float], calls: list[tuple[int, bool, int]], clock: _Clock):
    """run(rows, packed) whose duration depends on (packed, threads) and on the row count."""
    def run(rows: int, packed: bool):
        def fn() -> None:
            threads = torch.get_num_threads()
            calls.append((rows, packed, threads))
            clock.now += cost[(packed, threads)] * (1 if packed else 4 / min(rows, 4)) / 1000
        return fn
    return run


def test_measure_plan_keeps_the_fastest_choice_and_stops_when_dense_wins_twice(clock):
    calls: list[tuple[int, bool, int]] = []
    # packed: 3 ms on one thread, 9 on two; dense on two threads: 8 / rows ms (at least 2).
    run = _fake({(True, 1): 3.0, (True, 2): 9.0, (False, 1): 40.0, (False, 2): 2.0}, calls, clock)
    previous = torch.get_num_threads()
    plan, times = measure_plan(run, max_threads=2, can_pack=True, rows=(1, 2, 4, 8, 16, 32))
    assert torch.get_num_threads() == previous  # the caller's setting is restored
    # dense costs 8, 4, 2, 2 ms at 1, 2, 4, 8 rows: packed on one thread wins below 4 rows.
    assert plan.for_rows(1) == plan.for_rows(2) == Choice(True, 1)
    assert plan.for_rows(3) == plan.for_rows(8) == Choice(False, 2)
    assert plan.above == Choice(False, 2) and max(times) == 8  # stopped after two dense wins
    assert {c[1:] for c in calls} == {(True, 1), (True, 2), (False, 1), (False, 2)}  # threads really applied


def test_configured_packed_rows_are_kept_and_only_threads_measured(clock):
    calls: list[tuple[int, bool, int]] = []
    run = _fake({(True, 1): 1.0, (True, 2): 3.0, (False, 1): 40.0, (False, 2): 0.1}, calls, clock)
    plan, _ = measure_plan(run, max_threads=2, can_pack=True, forced_packed_rows=3, rows=(1, 2, 4, 8))
    assert plan.for_rows(3) == Choice(True, 1)  # 3 is a bucket edge although it is not a candidate
    assert plan.for_rows(4).packed is False
    assert all(not packed for rows, packed, _ in calls if rows > 3)
    plan, _ = measure_plan(run, max_threads=2, can_pack=True, forced_packed_rows=4096, rows=(1, 2))
    assert plan.for_rows(100_000).packed  # packed beyond the measured sizes too


def test_losers_are_not_timed_again_at_larger_sizes(clock):
    calls: list[tuple[int, bool, int]] = []
    # packed loses from 4 rows on; one thread never wins.
    run = _fake({(True, 1): 9.0, (True, 2): 3.0, (False, 1): 12.0, (False, 2): 2.0}, calls, clock)
    plan, _ = measure_plan(run, max_threads=2, can_pack=True, rows=(1, 2, 4, 8, 16))
    assert plan.for_rows(2) == Choice(True, 2) and plan.for_rows(4) == Choice(False, 2)
    assert all(threads == 2 for rows, packed, threads in calls if rows > 1 and packed)  # won at 1 row
    assert all(threads == 2 for rows, packed, threads in calls if rows > 4 and not packed)  # won at 4
    assert all(not packed for rows, packed, _ in calls if rows > 4)  # packed lost at 4 rows
    calls.clear()
    measure_plan(run, max_threads=2, can_pack=True, rows=(1, 2), all_threads_only=True)
    assert {threads for _, _, threads in calls} == {2}


def test_a_wide_matmul_runs_from_the_first_size_from_which_it_keeps_winning():
    # a wide matmul costs a fixed widening of the weights per step and little per row; int16 costs per row
    def time_step(rows: int, mode: str) -> float:
        calls.append((rows, mode))
        return 10.0 + rows * 0.1 if mode == "int8" else rows * 1.0

    calls: list[tuple[int, str]] = []
    int8, amx, times = wide_thresholds(time_step, ("int16", "int8"), (1, 2, 4, 8, 16, 32, 64))
    assert (int8, amx) == (16, 0)  # 8: 10.8 > 8; 16: 11.6 < 16
    # each size: the warm-up, then the modes take turns, three runs each (not a mode's runs back to back)
    assert calls[:8] == [(1, "int16"), (1, "int8")] + [(1, "int16"), (1, "int8")] * 3
    assert set(times) == {1, 2, 4, 8, 16, 32}  # stops once the last mode has won twice in a row
    assert (64, "int8") not in calls
    # a win that does not last is not taken: only sizes from which it keeps winning
    noisy = {1: (1.0, 2.0), 2: (3.0, 2.0), 4: (1.0, 4.0), 8: (1.0, 8.0)}
    assert wide_thresholds(lambda rows, mode: noisy[rows][mode == "int16"], ("int16", "int8"), (1, 2, 4, 8))[0] == 4
    never = wide_thresholds(lambda rows, mode: 2.0 if mode == "int8" else 1.0, ("int16", "int8"), (1, 2, 4))
    assert never[:2] == (0, 0)


def test_int8_takes_the_middle_sizes_and_amx_the_large_ones():
    """Measured shape on a 2-core Xeon (SmolLM2, ms): int8 costs per row, AMX a widening per step."""
    cost = {"int16": lambda r: 0.9 * r, "int8": lambda r: 0.7 * r + 1.0, "amx": lambda r: 0.35 * r + 6.0}
    int8, amx, times = wide_thresholds(lambda rows, mode: cost[mode](rows), ("int16", "int8", "amx"),
                                       (1, 2, 4, 8, 16, 32, 64))
    # 4 rows: int16 3.6 < int8 3.8; 8: int8 6.6 < int16 7.2 < AMX 8.8; 16: AMX 11.6 < int8 12.2
    winners = {r: min(t, key=t.__getitem__) for r, t in times.items()}
    assert winners == {1: "int16", 2: "int16", 4: "int16", 8: "int8", 16: "amx", 32: "amx"}
    assert (int8, amx) == (8, 16)
    # AMX alone past int16, never int8: no int8 range
    assert wide_thresholds(lambda rows, mode: cost[mode](rows) + (5.0 if mode == "int8" else 0.0),
                           ("int16", "int8", "amx"), (1, 2, 4, 8, 16, 32, 64))[:2] == (0, 16)
    # int8 everywhere from 2 rows, AMX never: int8 from 2, no AMX (and every size measured)
    int8, amx, times = wide_thresholds(lambda rows, mode: {"int16": 1.0 * rows, "int8": 0.5 * rows + 0.6,
                                                           "amx": 10.0 * rows}[mode], ("int16", "int8", "amx"),
                                       (1, 2, 4, 8))
    assert (int8, amx) == (2, 0) and set(times) == {1, 2, 4, 8}


def test_the_kernel_choice_is_made_once_from_the_device_and_sluice_kernels(monkeypatch):
    import kernels.cpu

    monkeypatch.setattr(kernels.cpu, "available", lambda: True)
    monkeypatch.delenv("SLUICE_KERNELS", raising=False)
    choice = CpuKernels.decide(torch.device("cpu"))
    assert choice.native and choice.threads == torch.get_num_threads() and choice.wide_min_rows == 0
    assert not CpuKernels.decide(torch.device("cuda")).native
    monkeypatch.setenv("SLUICE_KERNELS", "torch")
    assert not CpuKernels.decide(torch.device("cpu")).native


def test_a_plan_survives_its_json_form_for_the_tuning_cache():
    plan = Plan((1, 8, 32), (Choice(True, 1), Choice(True, 2), Choice(False, 1)), Choice(False, 2))
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert Plan.from_json(Plan.fixed(2).to_json()) == Plan.fixed(2)
