"""Property-based tests of the block manager and scheduler (no model: a fake runner advances sequences).

Under any sequence of add, step, finish, abort and preemption: no block leaks, no block is used
without a reference, reference counts equal the block-table references, every scheduled sequence has
room for its tokens, and all blocks are free again once every request has ended.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings, strategies as st

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import EngineRequest, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqStatus

BLOCK = 4


def check_invariants(bm: BlockManager, sched: Scheduler) -> None:
    refs = Counter(b for s in sched.running for b in s.block_table)
    for s in sched.waiting:
        assert not s.block_table, "a waiting sequence holds blocks"
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), "reference count differs from block-table references"
        assert (block.ref_count == 0) == (block.block_id in bm.free), "free list disagrees with reference counts"
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h
    for s in sched.running:
        assert len(s.block_table) * BLOCK >= s.num_computed_tokens
        assert len(set(s.block_table)) == len(s.block_table)
    assert len(sched.running) <= sched.config.max_running_requests


def fake_step(bm: BlockManager, sched: Scheduler, rng: st.DataObject) -> None:
    out = sched.schedule()
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    for seq, n in out.scheduled.items():
        assert seq.status is SeqStatus.RUNNING
        assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n, "scheduled without room"
        assert 1 <= n <= seq.num_uncomputed
        seq.num_computed_tokens += n
        bm.commit(seq)
    for seq in out.scheduled:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(rng.draw(st.integers(0, 3), label="token"))
            if len(seq.output_token_ids) >= seq.max_tokens:
                sched.remove(seq)
    check_invariants(bm, sched)


ops = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=20), st.integers(1, 12),
              st.integers(0, 2)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(8, 40), max_running=st.integers(1, 6), budget=st.integers(6, 40),
       chunk=st.integers(0, 12), caching=st.booleans(), script=st.lists(ops, max_size=60), data=st.data())
def test_no_leaks_and_consistent_refcounts(num_blocks, max_running, budget, chunk, caching, script, data):
    cfg = EngineConfig(max_running_requests=max_running, max_num_batched_tokens=max(budget, max_running),
                       chunked_prefill_size=chunk, block_size=BLOCK, enable_prefix_caching=caching)
    bm = BlockManager(num_blocks, BLOCK, caching)
    clock = [0.0]
    sched = Scheduler(cfg, bm, clock=lambda: clock[0])
    live: list[Sequence] = []
    for i, op in enumerate(script):
        clock[0] += 1.0
        if op[0] == "add":
            _, prompt, max_tokens, prio = op
            if chunk <= 0 and len(prompt) > cfg.max_num_batched_tokens:
                continue  # the engine refuses such configs at start
            if -(-(len(prompt) + max_tokens) // BLOCK) > num_blocks:
                continue  # the engine refuses requests that can never fit
            seq = Sequence.from_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens),
                                                      priority=prio, arrival_time=clock[0]), max_tokens)
            sched.add(seq)
            live.append(seq)
        elif op[0] == "step":
            fake_step(bm, sched, data)
        else:
            alive = [s for s in live if s.status is not SeqStatus.FINISHED]
            if alive:
                sched.remove(alive[op[1] % len(alive)])
        check_invariants(bm, sched)
    # Drain: everything finishes, nothing hangs, all blocks come back.
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        clock[0] += 1.0
        fake_step(bm, sched, data)
    assert not sched.has_unfinished(), "scheduler stopped making progress"
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def _seq(rid, prompt, prio, t, max_tokens=4):
    return Sequence.from_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=prio,
                                               arrival_time=t), max_tokens)


def test_priority_then_arrival_then_aging():
    cfg = EngineConfig(max_running_requests=1, max_num_batched_tokens=64, block_size=BLOCK, priority_aging_s=100)
    bm = BlockManager(64, BLOCK)
    now = [1000.0]
    sched = Scheduler(cfg, bm, clock=lambda: now[0])
    old_std = _seq("old-standard", [1, 2], 1, t=850.0)  # waited 150 s > aging bound
    std = _seq("standard", [1, 2], 1, t=990.0)
    pro_late = _seq("pro-late", [1, 2], 0, t=995.0)
    pro = _seq("pro", [1, 2], 0, t=992.0)
    for s in (std, pro_late, pro, old_std):
        sched.add(s)
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        for seq, n in out.scheduled.items():
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(0)
                if len(seq.output_token_ids) >= seq.max_tokens:
                    order.append(seq.request_id)
                    sched.remove(seq)
    assert order == ["old-standard", "pro", "pro-late", "standard"]


def test_waiting_pro_preempts_running_standard_which_keeps_its_place():
    cfg = EngineConfig(max_running_requests=2, max_num_batched_tokens=64, block_size=BLOCK)
    bm = BlockManager(64, BLOCK)
    now = [0.0]
    sched = Scheduler(cfg, bm, clock=lambda: now[0])
    s1, s2 = _seq("std1", [1] * 5, 1, 1.0, 50), _seq("std2", [2] * 5, 1, 2.0, 50)
    sched.add(s1)
    sched.add(s2)
    out = sched.schedule()
    assert set(out.scheduled) == {s1, s2}
    for seq, n in out.scheduled.items():
        seq.num_computed_tokens += n
        seq.output_token_ids.append(0)
    now[0] = 3.0
    pro = _seq("pro", [3] * 5, 0, 3.0, 50)
    std3 = _seq("std3", [4] * 5, 1, 3.5, 50)
    sched.add(std3)
    sched.add(pro)
    out = sched.schedule()
    assert pro in out.scheduled and s2 in out.preempted  # the most recent standard yields
    assert s1.status is SeqStatus.RUNNING
    assert [s.request_id for s in sched.waiting][:2] == ["std2", "std3"]  # std2 keeps its place ahead of std3
    assert s2.block_table == [] and s2.output_token_ids == [0]  # blocks freed, output kept for recompute


def test_memory_pressure_preempts_lowest_rank_and_recovers():
    cfg = EngineConfig(max_running_requests=4, max_num_batched_tokens=64, block_size=BLOCK)
    bm = BlockManager(6, BLOCK, enable_prefix_caching=False)  # 24 tokens of KV
    sched = Scheduler(cfg, bm, clock=lambda: 0.0)
    seqs = [_seq(f"s{i}", [i] * 6, 1, float(i), 6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    finished, preempted = [], 0
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        preempted += len(out.preempted)
        for seq, n in out.scheduled.items():
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(0)
                if len(seq.output_token_ids) >= seq.max_tokens:
                    finished.append(seq.request_id)
                    sched.remove(seq)
    assert sorted(finished) == ["s0", "s1", "s2"]
    assert preempted > 0
    assert bm.num_free_blocks == 6


def test_prefix_cache_hit_skips_cached_tokens():
    cfg = EngineConfig(max_running_requests=4, max_num_batched_tokens=256, block_size=BLOCK)
    bm = BlockManager(64, BLOCK)
    sched = Scheduler(cfg, bm, clock=lambda: 0.0)
    shared = list(range(100, 120))  # 5 full blocks
    a = _seq("a", shared + [1, 2], 0, 1.0, 1)
    sched.add(a)
    out = sched.schedule()
    assert out.scheduled[a] == 22
    a.num_computed_tokens += 22
    bm.commit(a)
    sched.remove(a)
    b = _seq("b", shared + [7, 8, 9], 0, 2.0, 1)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled[b] == 3  # only the uncached tail is computed
    assert b.num_cached_tokens == 20
