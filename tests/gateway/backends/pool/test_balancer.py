"""Which replica: least loaded, unless another holds a long prefix of the request and is not much busier."""

from __future__ import annotations

from gateway.backends.pool.balancer import (
    BALANCE_ABS,
    BLOCK_CHARS,
    MIN_MATCH_BLOCKS,
    fallback_order,
    pick,
    prefix_hashes,
)
from gateway.backends.pool.load import ReplicaLoad
from gateway.backends.pool.replica import Replica
from gateway.settings import EngineReplicaSettings, RoutingSettings


def _replicas(n: int, max_in_flight: int = 16) -> list[Replica]:
    return [Replica(EngineReplicaSettings(name=f"r{i}", base_url=f"http://127.0.0.1:{9000 + i}/v1", kind="vllm",
                                          models=["m"], max_in_flight=max_in_flight), RoutingSettings())
            for i in range(n)]


def test_prefix_hashes_equal_for_equal_prefixes_only():
    a = "x" * BLOCK_CHARS * 3 + "tail a"
    b = "x" * BLOCK_CHARS * 3 + "tail b"
    c = "y" + "x" * (BLOCK_CHARS * 3 - 1)
    assert prefix_hashes(a) == prefix_hashes(b) and len(prefix_hashes(a)) == 3
    assert prefix_hashes(c)[0] != prefix_hashes(a)[0]
    # a block's hash covers everything before it: the same second block after a different first one differs
    d = "z" * BLOCK_CHARS + "x" * BLOCK_CHARS
    assert prefix_hashes(d)[1] != prefix_hashes(a)[1]
    assert prefix_hashes("short") == []


def test_least_loaded_with_room():
    a, b, c = _replicas(3)
    a.in_flight, b.in_flight, c.in_flight = 5, 2, 9
    assert pick([a, b, c], []) is b
    b.in_flight = 16  # at its cap: no room
    assert pick([a, b, c], []) is a
    for r in (a, c):
        r.in_flight = 16
    assert pick([a, b, c], []) is None


def test_load_is_measured_against_each_replicas_room():
    a, b = _replicas(2)
    a.level, b.level = 4, 16  # a queues at 4, b at 16
    a.learnt = b.learnt = True
    a.in_flight, b.in_flight = 2, 6
    assert pick([a, b], []) is b  # 6/16 busy beats 2/4
    c = _replicas(3, max_in_flight=256)[2]  # not learnt: measured against the others' largest level
    c.in_flight = 7
    assert pick([a, b, c], []) is b  # 7/16, not 7/256


def test_ties_go_round_the_replicas():
    rs = _replicas(4)
    assert {pick(rs, []).name for _ in range(8)} == {"r0", "r1", "r2", "r3"}


def test_prefix_affinity_unless_much_busier():
    a, b = _replicas(2, max_in_flight=64)
    hashes = prefix_hashes("s" * BLOCK_CHARS * 4)
    b.remember(hashes)
    a.in_flight, b.in_flight = 1, 1 + BALANCE_ABS
    assert pick([a, b], hashes) is b  # holds the prefix, busier within the absolute threshold
    b.in_flight = 30
    assert pick([a, b], hashes) is a  # much busier: the prefix is not worth the queue
    short = _replicas(2)
    short[1].remember(hashes[:MIN_MATCH_BLOCKS - 1])
    short[1].in_flight = 1
    assert pick(short, hashes) is short[0]  # too little shared to follow


def test_kv_usage_breaks_ties():
    a, b = _replicas(2)
    a.observe(ReplicaLoad(running=0, waiting=0, kv_usage=0.9))
    b.observe(ReplicaLoad(running=0, waiting=0, kv_usage=0.1))
    assert pick([a, b], []) is b


def test_fallback_order_keeps_the_pick_first_then_least_loaded():
    a, b, c = _replicas(3)
    a.in_flight, b.in_flight, c.in_flight = 9, 1, 5
    assert fallback_order([a, b, c], a) == [a, b, c]


def test_round_robin_takes_each_live_replica_in_turn():
    from gateway.backends.pool.balancer import round_robin
    a, b, c = _replicas(3)
    a.in_flight = 15  # busy or not: its turn comes
    got = [round_robin([a, b, c]).name for _ in range(6)]
    assert sorted(got) == ["r0", "r0", "r1", "r1", "r2", "r2"] and got[:3] == got[3:]
    for _ in range(5):
        b.breaker.failure()
    assert {round_robin([a, b, c]).name for _ in range(4)} == {"r0", "r2"}
