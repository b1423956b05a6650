"""The embedding scheduler alone (no model): the token budget, slices of a big request, priority before
arrival, one priority per step, shortest inputs first, and aging."""

from __future__ import annotations

from engine.embedding.scheduler import EmbeddingScheduler


def ids(*lengths: int) -> list[list[int]]:
    return [[7] * n for n in lengths]


def served(step) -> list[tuple[str, int]]:
    return [(p.request_id, i) for p, i in step.rows]


def test_a_step_packs_inputs_of_many_requests_up_to_the_budget():
    s = EmbeddingScheduler(max_batch_tokens=100, priority_aging_s=10.0)
    s.add("a", ids(30, 30), priority=1, now=0.0)
    s.add("b", ids(30, 30), priority=1, now=0.0)
    step = s.schedule(now=0.0)
    assert step.num_tokens == 90 and len(step.rows) == 3
    assert [rid for rid, _ in served(step)].count("a") == 2  # first come first served
    step = s.schedule(now=0.0)
    assert served(step) == [("b", 1)] and not s.has_pending()


def test_a_big_request_is_served_in_slices_and_a_later_query_of_higher_priority_goes_first():
    s = EmbeddingScheduler(max_batch_tokens=256, priority_aging_s=10.0)
    s.add("ingest", ids(*[64] * 40), priority=1, now=0.0)
    first = s.schedule(now=0.0)
    assert first.num_tokens == 256 and {rid for rid, _ in served(first)} == {"ingest"}
    s.add("query", ids(9), priority=0, now=0.1)
    nxt = s.schedule(now=0.1)
    # The query's step is its own: lower-priority slices never lengthen it.
    assert served(nxt) == [("query", 0)]
    rest = []
    while s.has_pending():
        step = s.schedule(now=0.2)
        assert step.num_tokens <= 256
        rest += served(step)
    assert sorted(i for _, i in rest) == list(range(4, 40))


def test_fifo_within_a_priority_and_lower_number_first():
    s = EmbeddingScheduler(max_batch_tokens=10, priority_aging_s=10.0)
    s.add("late-low", ids(10), priority=5, now=0.0)
    s.add("early", ids(10), priority=1, now=0.0)
    s.add("late", ids(10), priority=1, now=0.0)
    s.add("urgent", ids(10), priority=0, now=0.0)
    order = [served(s.schedule(now=0.0))[0][0] for _ in range(4)]
    assert order == ["urgent", "early", "late", "late-low"]


def test_inputs_go_shortest_first_and_a_step_is_sorted_by_length():
    s = EmbeddingScheduler(max_batch_tokens=60, priority_aging_s=10.0)
    s.add("r", ids(50, 5, 20, 30, 9), priority=0, now=0.0)
    step = s.schedule(now=0.0)
    assert served(step) == [("r", 1), ("r", 4), ("r", 2)]  # 5 + 9 + 20; 30 does not fit in 60
    assert [len(p.inputs[i]) for p, i in step.rows] == [5, 9, 20]
    assert served(s.schedule(now=0.0)) == [("r", 3)]
    assert served(s.schedule(now=0.0)) == [("r", 0)]


def test_an_input_over_the_budget_still_gets_a_step_of_its_own():
    s = EmbeddingScheduler(max_batch_tokens=8, priority_aging_s=10.0)
    s.add("r", ids(20, 3), priority=0, now=0.0)
    assert served(s.schedule(now=0.0)) == [("r", 1)]
    assert served(s.schedule(now=0.0)) == [("r", 0)]


def test_a_request_waiting_past_the_aging_time_gets_the_next_step():
    s = EmbeddingScheduler(max_batch_tokens=10, priority_aging_s=1.0)
    s.add("bulk", ids(10, 10, 10), priority=9, now=0.0)
    for t in range(5):  # a stream of higher-priority queries
        s.add(f"q{t}", ids(10), priority=0, now=t * 0.4)
    order = []
    now = 0.0
    while s.has_pending():
        step = s.schedule(now)
        order.append(served(step)[0][0])
        now += 0.4
        s.served(step, now)
    # bulk waited 1.2 s > 1.0 at its 4th look: served once, then its wait starts again.
    assert order[:4] == ["q0", "q1", "q2", "bulk"]
    assert order.count("bulk") == 3


def test_remove_drops_the_rest_of_a_request():
    s = EmbeddingScheduler(max_batch_tokens=10, priority_aging_s=10.0)
    s.add("r", ids(10, 10), priority=0, now=0.0)
    s.schedule(now=0.0)
    s.remove("r")
    assert not s.has_pending() and s.schedule(now=0.0).rows == []


def test_steps_are_short_while_better_priority_requests_keep_coming():
    s = EmbeddingScheduler(1024, 10.0, interactive_batch_tokens=256, interactive_window_s=5.0)
    s.add("bulk", [[1] * 100] * 50, priority=1, now=0.0)
    assert s.schedule(0.0).num_tokens == 1000  # no query seen: the full budget
    s.add("query", [[1] * 10], priority=0, now=1.0)
    assert [p.request_id for p, _ in s.schedule(1.0).rows] == ["query"]
    assert s.schedule(2.0).num_tokens == 200  # a query came 1 s ago: the bulk's steps are short
    assert s.schedule(6.1).num_tokens == 1000  # none for more than the window: full steps again
