"""gateway/backends/pool/slo.py: the first-token time learnt per replica, the completion rate, and the
wait they allow."""

from __future__ import annotations

import pytest

from gateway.backends.latency import FirstTokenTimes
from gateway.backends.pool.slo import Durations, expected_wait, wait_budget


def test_first_token_times_estimate_a_high_quantile_not_the_mean():
    t = FirstTokenTimes()
    assert t.estimate() is None
    for s in [0.1, 0.3, 0.1]:
        t.observe(s)
    est = t.estimate()
    assert est is not None and 0.2 < est < 0.4  # few seen: the mean plus twice the mean deviation
    for i in range(200):  # a skewed tail: 1 in 20 waits 1 s (behind a request in the engine's queue)
        t.observe(1.0 if i % 20 == 0 else 0.1)
    assert t.estimate() == 1.0  # the 98th percentile of the last 100; mean + 2 dev would say ~0.3


def test_durations_give_the_rate_room_opens_at_when_the_replicas_are_full():
    d = Durations()
    d.ended(0.5)
    d.ended(0.5)
    assert d.drain_rate(16) is None  # too few seen
    d.ended(0.5)
    assert d.drain_rate(16) == pytest.approx(32.0)  # 16 slots each freed every 0.5 s
    assert d.drain_rate(0) is None


def test_the_wait_allowed_is_the_target_less_the_first_token_time():
    assert wait_budget(2.0, 0.5) == 1.5 and wait_budget(2.0, None) == 2.0 and wait_budget(0.3, 0.5) == 0.0
    assert expected_wait(4, 2.0) == 2.5 and expected_wait(0, None) is None
