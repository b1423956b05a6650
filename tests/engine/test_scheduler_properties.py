"""Property-based tests of the block manager and scheduler (no model: a fake runner samples tokens).

Under any sequence of add, step, finish, abort and preemption: no block leaks, no block is used
without a reference, reference counts equal the block-table references, every scheduled sequence has
room for its tokens, and all blocks are free again once every request has ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import EngineRequest, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SeqStatus, Sequence

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


def sample_all(out: SchedulerOutput, token: Callable[[Sequence], int] = lambda seq: 0) -> dict[Sequence, int]:
    """A fake model runner: every sequence whose last uncomputed token was scheduled samples a token."""
    return {seq: token(seq) for seq, n in out.scheduled.items() if n == seq.num_uncomputed}


def run_step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, sample_all(out))
    return out


def fake_step(bm: BlockManager, sched: Scheduler, rng: st.DataObject) -> None:
    out = sched.schedule()
    assert out.num_tokens == sum(out.scheduled.values()) <= sched.config.max_num_batched_tokens
    for seq, n in out.scheduled.items():
        assert seq.status is SeqStatus.RUNNING
        assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n, "scheduled without room"
        assert 1 <= n <= seq.num_uncomputed
    computed = {seq: seq.num_computed_tokens + n for seq, n in out.scheduled.items()}
    sampled = sample_all(out, lambda seq: rng.draw(st.integers(0, 3), label="token"))
    sched.update_from_output(out, sampled)
    for seq in out.scheduled:
        if seq.status is SeqStatus.RUNNING:
            assert seq.num_computed_tokens == computed[seq]
        else:  # no stop tokens here: only the output limit ends a sequence
            assert seq.finish_reason == "length" and len(seq.output_token_ids) == seq.max_tokens
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
        out = run_step(sched)
        order += [seq.request_id for seq in out.scheduled if seq.status is SeqStatus.FINISHED]
    assert order == ["old-standard", "pro", "pro-late", "standard"]


def test_waiting_pro_preempts_running_standard_which_keeps_its_place():
    cfg = EngineConfig(max_running_requests=2, max_num_batched_tokens=64, block_size=BLOCK)
    bm = BlockManager(64, BLOCK)
    now = [0.0]
    sched = Scheduler(cfg, bm, clock=lambda: now[0])
    s1, s2 = _seq("std1", [1] * 5, 1, 1.0, 50), _seq("std2", [2] * 5, 1, 2.0, 50)
    sched.add(s1)
    sched.add(s2)
    out = run_step(sched)
    assert set(out.scheduled) == {s1, s2}
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
        out = run_step(sched)
        preempted += len(out.preempted)
        finished += [seq.request_id for seq in out.scheduled if seq.status is SeqStatus.FINISHED]
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
    out = run_step(sched)
    assert out.scheduled[a] == 22
    assert a.finish_reason == "length" and len(bm.cached) == 5  # finished; its full blocks stay cached
    b = _seq("b", shared + [7, 8, 9], 0, 2.0, 1)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled[b] == 3  # only the uncached tail is computed
    assert b.num_cached_tokens == 20


def test_update_from_output_advances_commits_appends_and_stops():
    cfg = EngineConfig(max_running_requests=4, max_num_batched_tokens=8, chunked_prefill_size=8, block_size=BLOCK)
    bm = BlockManager(16, BLOCK)
    sched = Scheduler(cfg, bm, clock=lambda: 0.0)
    req = EngineRequest("s", list(range(10)), SamplingParams(max_tokens=5, stop_token_ids=[7]))
    seq = Sequence.from_request(req, 5, eos_token_ids=[9])
    assert seq.stop_token_ids == {7, 9}
    sched.add(seq)
    out = sched.schedule()
    assert out.scheduled[seq] == 8
    sched.update_from_output(out, {})  # a partial prefill chunk samples nothing
    assert seq.num_computed_tokens == 8 and not seq.output_token_ids and len(bm.cached) == 2
    out = sched.schedule()
    assert out.scheduled[seq] == 2
    sched.update_from_output(out, {seq: 3})
    assert seq.num_computed_tokens == 10 and seq.output_token_ids == [3] and seq.finish_reason is None
    out = sched.schedule()
    sched.update_from_output(out, {seq: 9})  # eos
    assert seq.finish_reason == "stop" and seq.status is SeqStatus.FINISHED and not sched.has_unfinished()
    assert bm.num_free_blocks == 16


def test_ignore_eos_keeps_only_the_requested_stop_ids():
    req = EngineRequest("s", [1], SamplingParams(stop_token_ids=[7], ignore_eos=True))
    assert Sequence.from_request(req, 5, eos_token_ids=[9]).stop_token_ids == {7}


def _fair_setup(prompt_len: int, decodes: int = 4, fair: bool = True, share: float = 1.0):
    from engine.step_cost import StepCost

    cfg = EngineConfig(max_running_requests=16, max_num_batched_tokens=512, chunked_prefill_size=256,
                       block_size=16, fair_prefill=fair, prefill_share=share)
    bm = BlockManager(4096, 16)
    cost = StepCost(base=0.002, per_row=0.0004, per_pair=3e-7)
    sched = Scheduler(cfg, bm, clock=lambda: 0.0, cost=cost)
    for i in range(decodes):
        sched.add(Sequence.from_request(EngineRequest(f"d{i}", [1, 2, 3], SamplingParams(max_tokens=100_000)),
                                        100_000))
    for _ in range(3):
        run_step(sched)
    long = Sequence.from_request(EngineRequest("long", list(range(prompt_len)), SamplingParams(max_tokens=1)), 1)
    sched.add(long)
    return sched, long, cost


@pytest.mark.parametrize("share,low,high", [(1.0, 0.17, 0.23), (0.7, 0.12, 0.165)])
def test_a_long_prompt_gets_prefill_share_streams_shares_while_decodes_run(share, low, high):
    """Processor sharing: with four streams decoding, a prompt deep into its prefill takes share / (4 +
    share) of the predicted step time (a fifth at one share, 0.149 at 0.7), in chunks whose cost never
    exceeds the burst (one full chunk at 0)."""
    sched, long, cost = _fair_setup(8000, share=share)
    decode_cost = prefill_cost = 0.0
    while long.status is not SeqStatus.FINISHED:
        out = run_step(sched)
        for seq, n in out.scheduled.items():
            start = seq.num_computed_tokens - n  # (already advanced by the step)
            c = cost.chunk(n, start)
            if seq is long:
                assert c <= sched.burst + 1e-12 or n == 1
                if start > 256:  # past its first full chunk
                    prefill_cost += c
            elif start > 256 or long.num_computed_tokens > 256:
                decode_cost += c
        assert sched.has_unfinished()
    got = prefill_cost / (prefill_cost + decode_cost)
    assert low < got < high, got


@pytest.mark.parametrize("calibrate,low,high", [(True, 0.17, 0.23), (False, 0.24, 0.32)])
def test_the_share_holds_in_real_time_when_chunks_cost_more_than_predicted(calibrate, low, high):
    """Deep chunks that really cost 1.6x their prediction (fewer rows reuse the weights and keys than in
    the timing at start, the served process takes its slice): observing the steps' times, the scheduler
    charges chunks what they cost, and the prompt keeps a fifth of the real step time; without it, 0.28."""
    sched, long, cost = _fair_setup(8000)
    real = {"decode": 0.0, "prefill": 0.0}
    while long.status is not SeqStatus.FINISHED:
        out = run_step(sched)
        seconds = cost.base
        for seq, n in out.scheduled.items():
            start = seq.num_computed_tokens - n
            c = cost.chunk(n, start) * (1.6 if seq is long else 1.0)
            seconds += c
            if start > 256 or long.num_computed_tokens > 256:
                real["prefill" if seq is long else "decode"] += c
        if calibrate:
            sched.observe(out, seconds)
    got = real["prefill"] / (real["prefill"] + real["decode"])
    assert low < got < high, got
    if calibrate:
        assert 1.45 < sched.calibration.bias < 1.7, sched.calibration.bias


def test_a_short_prompt_joins_running_streams_in_one_step():
    sched, short, _ = _fair_setup(200)
    out = run_step(sched)
    assert out.scheduled[short] == 200


def test_alone_a_chunk_deep_in_a_context_is_cut_to_the_step_cap():
    sched, long, cost = _fair_setup(8000, decodes=0)
    sizes = []
    while long.status is not SeqStatus.FINISHED:
        out = run_step(sched)
        n = out.scheduled[long]
        done = long.num_computed_tokens if long.status is not SeqStatus.FINISHED else len(long.prompt_token_ids)
        start = done - n
        sizes.append(n)
        assert cost.chunk(n, start) <= sched.step_cap + 1e-12
    assert sizes[0] == 256 and sizes[-1] < 64  # full chunks early, cost-bounded ones deep in the context


def test_a_short_request_is_not_kept_waiting_behind_a_long_prefill():
    """With no decodes running, a long prompt's chunks fill whole steps; a request that arrives meanwhile
    gets its first chunk in the next step, not after the long prompt's prefill."""
    sched, long, _ = _fair_setup(8000, decodes=0)
    for _ in range(3):
        run_step(sched)
    short = Sequence.from_request(EngineRequest("short", [5, 6, 7], SamplingParams(max_tokens=4)), 4)
    sched.add(short)
    out = run_step(sched)
    assert out.scheduled.get(short) == 3 and long.is_prefilling


@pytest.mark.parametrize("decodes", [0, 4])
def test_a_newcomers_step_is_not_filled_with_a_long_prefill(decodes):
    """The step that admits new requests gives a running long prefill at most what the newcomers' first
    chunks cost: their first token waits for a step about twice their own, not a full-cap chunk."""
    sched, long, cost = _fair_setup(8000, decodes=decodes)
    for _ in range(6):
        run_step(sched)
    new = [Sequence.from_request(EngineRequest(f"n{i}", list(range(13)), SamplingParams(max_tokens=4)), 4)
           for i in range(4)]
    for seq in new:
        sched.add(seq)
    out = run_step(sched)
    assert all(out.scheduled.get(seq) == 13 for seq in new)
    newcomers = sum(cost.chunk(13, 0) for _ in new)
    long_cost = cost.chunk(out.scheduled.get(long, 0), long.num_computed_tokens - out.scheduled.get(long, 0))
    assert long_cost <= newcomers + 1e-12
    assert out.cost < sched.step_cap / 2
    assert any(long in run_step(sched).scheduled for _ in range(100))  # then it takes its share again


def _burst(max_step_seconds: float, per_row: float, prompts: int = 16, prompt_len: int = 30):
    """`prompts` prompts arriving together at an idle engine whose measured steps cost 50 ms + per_row."""
    from engine.step_cost import StepCost

    cfg = EngineConfig(max_running_requests=32, max_num_batched_tokens=512, chunked_prefill_size=256,
                       block_size=16, max_step_seconds=max_step_seconds)
    cost = StepCost(base=0.05, per_row=per_row, seconds=True)
    sched = Scheduler(cfg, BlockManager(4096, 16), clock=lambda: 0.0, cost=cost)
    seqs = [Sequence.from_request(EngineRequest(f"p{i}", list(range(prompt_len)), SamplingParams(max_tokens=50)), 50)
            for i in range(prompts)]
    for seq in seqs:
        sched.add(seq)
    return sched, seqs, cost


def test_a_burst_of_prompts_is_prefilled_over_steps_of_at_most_max_step_seconds():
    """16 prompts of 30 tokens (480, within the token budget) at 10 ms a row: one 4.85 s step by tokens
    alone; with max_step_seconds 1 s, steps of at most 1 s, the first prompts streaming after the first."""
    sched, seqs, cost = _burst(0.0, 0.01)
    out = run_step(sched)
    assert all(out.scheduled.get(s) == 30 for s in seqs)  # by tokens alone: all of them at once

    sched, seqs, cost = _burst(1.0, 0.01)
    first_token_step: dict[Sequence, int] = {}
    for step in range(40):
        out = run_step(sched)
        assert cost.base + out.cost <= 1.0 + 1e-9
        for s in seqs:
            if s not in first_token_step and not s.is_prefilling and s.status is not SeqStatus.WAITING:
                first_token_step[s] = step
        if len(first_token_step) == len(seqs):
            break
    assert len(first_token_step) == len(seqs)  # every prompt got through
    steps = sorted(first_token_step.values())
    assert steps[0] == 0 and steps[len(steps) // 2] >= 1 and steps[-1] > steps[len(steps) // 2]


def test_max_step_seconds_never_caps_a_step_below_a_64_token_chunk():
    """A model so slow that 1 s holds 9 rows still prefills 64 tokens a step (the base's share stays small)."""
    sched, seqs, cost = _burst(1.0, 0.1, prompts=1, prompt_len=300)
    out = run_step(sched)
    assert out.scheduled[seqs[0]] == 64 and sched.step_cap == cost.chunk(64, 0)


def test_max_step_seconds_leaves_the_default_cost_model_alone():
    """The default model counts rows, not seconds: no time cap applies to it."""
    cfg = EngineConfig(max_num_batched_tokens=512, max_step_seconds=0.001)
    assert Scheduler(cfg, BlockManager(4096, 16), clock=lambda: 0.0).step_cap == 512
