"""The room rule: a replica takes requests while those on it stay below the level at which its waiting
queue grows, a level learnt from its metrics."""

from __future__ import annotations

from gateway.backends.pool.load import ReplicaLoad
from gateway.backends.pool.replica import HEADROOM, KV_FULL, PROBE_HOLD_S, START_LEVEL, Replica
from gateway.settings import EngineReplicaSettings, RoutingSettings
from tests.fixtures.clock import Clock


def _replica(max_in_flight: int = 64, on_room=lambda: None, clock: Clock | None = None) -> Replica:
    s = EngineReplicaSettings(name="a", base_url="http://127.0.0.1:9/v1", kind="vllm", models=["m"],
                              max_in_flight=max_in_flight)
    return Replica(s, RoutingSettings(breaker_failures=2), on_room, clock=clock or Clock())


def test_until_a_queue_is_seen_the_level_is_the_hard_cap():
    r = _replica(max_in_flight=3)
    assert r.level == 3 and not r.learnt
    r.in_flight = 2
    assert r.has_room()
    r.reserved = 1
    assert not r.has_room()  # admitted but not yet sent counts


def test_a_queue_on_the_engine_sets_the_level_to_the_most_it_was_seen_running():
    r = _replica()
    r.in_flight = 10
    r.observe(ReplicaLoad(running=8, waiting=2, kv_usage=0.5))
    assert r.learnt and r.level == 8 + HEADROOM  # its batch, and one waiting to start the moment a slot frees
    assert r.others == 0  # all 10 on it are ours
    assert not r.has_room()
    r.in_flight = 8
    assert r.has_room()
    # A poll that catches requests between two of its steps (5 running, 2 waiting): still 8, not 5.
    r.observe(ReplicaLoad(running=5, waiting=2, kv_usage=0.3))
    assert r.level == 8 + HEADROOM
    r.observe(ReplicaLoad(running=8, waiting=HEADROOM, kv_usage=0.3))
    assert r.level == 8 + HEADROOM  # the headroom waiting is no queue (and no reason to probe)


def test_at_its_level_with_no_queue_the_level_is_probed_upward_to_the_cap():
    clock = Clock()
    r = _replica(max_in_flight=12, clock=clock)
    r.in_flight = 6
    r.observe(ReplicaLoad(running=4, waiting=2, kv_usage=None))
    assert r.level == 4 + HEADROOM
    r.in_flight = 5
    clock.t += PROBE_HOLD_S - 0.5
    r.observe(ReplicaLoad(running=5, waiting=0, kv_usage=None))
    assert r.level == 5  # 6 in flight queued moments ago: no probe up to 6 yet
    clock.t += 0.5
    r.observe(ReplicaLoad(running=5, waiting=0, kv_usage=None))
    assert r.level == 6  # up by a quarter, at least one
    r.in_flight = 3  # below its level and nothing waiting in Sluice: nothing to learn
    r.observe(ReplicaLoad(running=3, waiting=0, kv_usage=None))
    assert r.level == 6
    r.in_flight = 10
    r.level = 10
    r.observe(ReplicaLoad(running=10, waiting=0, kv_usage=None))
    assert r.level == 12  # never past max_in_flight
    r.in_flight = 12
    r.observe(ReplicaLoad(running=10, waiting=2, kv_usage=None))
    assert r.level == 10 + HEADROOM  # the probe went too far: back to the most it ran
    r.in_flight = 11
    r.observe(ReplicaLoad(running=11, waiting=0, kv_usage=None))
    assert r.level == 11  # not up to the 12 in flight that queued just now


def test_a_level_caught_low_is_probed_back_up_to_below_the_load_that_queued():
    """A poll that caught the engine between steps (6 running, 3 waiting, though it runs 8) sets the level
    to 6 (+ headroom); probes may go back up to 8 at once, not to the 9 that queued, until the hold is over."""
    clock = Clock()
    r = _replica(max_in_flight=64, clock=clock)
    r.in_flight = 9
    r.observe(ReplicaLoad(running=6, waiting=3, kv_usage=None))
    assert r.level == 6 + HEADROOM == 7
    r.observe(ReplicaLoad(running=8, waiting=0, kv_usage=None))
    assert r.level == 8
    r.observe(ReplicaLoad(running=8, waiting=0, kv_usage=None))
    assert r.level == 8  # 9 queued moments ago
    clock.t += PROBE_HOLD_S
    r.observe(ReplicaLoad(running=8, waiting=0, kv_usage=None))
    assert r.level == 10


def test_requests_waiting_in_sluice_probe_a_replica_that_others_keep_at_its_level():
    waiting = [True]
    s = EngineReplicaSettings(name="a", base_url="http://127.0.0.1:9/v1", kind="vllm", models=["m"])
    clock = Clock()
    r = Replica(s, RoutingSettings(), wanted=lambda: waiting[0], clock=clock)
    r.in_flight = 2
    r.observe(ReplicaLoad(running=4, waiting=2, kv_usage=None))  # learnt 4 (+ headroom; 4 are another client's)
    assert r.level == 5 and r.others == 4
    clock.t += PROBE_HOLD_S
    r.observe(ReplicaLoad(running=2, waiting=0, kv_usage=None))
    assert r.level == 5  # 2 in flight of 5: it has room, nothing to probe (a breaker-open replica idles so)
    r.observe(ReplicaLoad(running=5, waiting=0, kv_usage=None))
    assert r.level == 6  # at its level with ours and others', no queue, Sluice waiting: probed


def test_others_load_on_the_engine_takes_room():
    r = _replica()
    r.in_flight = 2
    r.observe(ReplicaLoad(running=6, waiting=2, kv_usage=None))  # 6 of the 8 are another client's
    assert r.others == 6 and r.level == 6 + HEADROOM
    assert r.busy() == 8 and not r.has_room()


def test_a_full_kv_cache_or_an_open_breaker_leaves_no_room():
    r = _replica()
    r.in_flight = 3
    r.observe(ReplicaLoad(running=3, waiting=0, kv_usage=KV_FULL))
    assert not r.has_room()
    r.in_flight = 2  # one of ours ended since that poll: its KV is free again
    assert r.has_room()
    r.observe(ReplicaLoad(running=1, waiting=0, kv_usage=0.5))
    assert r.has_room()
    r.breaker.failure()
    r.breaker.failure()
    assert not r.has_room()


def test_a_request_ending_and_a_poll_that_opens_room_wake_the_waiters():
    woken: list[str] = []
    r = _replica(on_room=lambda: woken.append("room"))
    r.in_flight = 3
    assert woken == []
    r.in_flight = 2
    assert woken == ["room"]
    r.observe(ReplicaLoad(running=2, waiting=0, kv_usage=None))
    assert woken == ["room", "room"]


def test_prefix_blocks_match_from_the_start_only():
    r = _replica()
    r.remember([1, 2, 3])
    assert r.matched_blocks([1, 2, 3, 4]) == 3
    assert r.matched_blocks([9, 2, 3]) == 0


def test_a_replica_starts_at_a_few_requests_and_is_probed_up_while_kept_full():
    """A slow start: a burst before the first poll sends at most START_LEVEL to an engine whose limit
    is unknown; one without metrics (kind openai) has only max_in_flight to go by."""
    r = _replica(max_in_flight=64)
    assert r.level == START_LEVEL
    r.in_flight = START_LEVEL
    r.observe(ReplicaLoad(running=START_LEVEL, waiting=0, kv_usage=None))
    assert r.level == START_LEVEL + START_LEVEL // 4
    s = EngineReplicaSettings(name="o", base_url="http://127.0.0.1:9/v1", kind="openai", models=["m"], max_in_flight=64)
    assert Replica(s, RoutingSettings()).level == 64


def test_the_headroom_is_left_empty_while_requests_wait_in_sluice():
    """One request may wait in the engine beyond its batch while Sluice has nothing waiting; under
    overload it would wait there for a slot too, so room stops at the batch."""
    waiting = [False]
    s = EngineReplicaSettings(name="a", base_url="http://127.0.0.1:9/v1", kind="vllm", models=["m"])
    r = Replica(s, RoutingSettings(), wanted=lambda: waiting[0], clock=Clock())
    r.in_flight = 10
    r.observe(ReplicaLoad(running=8, waiting=2, kv_usage=None))
    assert r.level == 8 + HEADROOM
    r.in_flight = 8
    assert r.has_room()
    waiting[0] = True
    assert not r.has_room()
    r.in_flight = 7
    assert r.has_room()
