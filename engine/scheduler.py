"""Decides, every step, which sequences run and how many tokens each computes.

The output is vLLM v1's shape: `{sequence: num_tokens}` under a token budget
(`max_num_batched_tokens`). Running decodes go first (one token each, so streams keep flowing), then
running prefills continue in chunks of at most `chunked_prefill_size`, then waiting requests are
admitted in order of rank: aged requests first (waiting longer than `priority_aging_s`, by arrival),
then by priority (lower number first), then by arrival. A preempted sequence keeps its arrival time,
so it goes back ahead of newer arrivals of its tier.

When blocks run out, the lowest-ranked running sequence is preempted (its blocks freed; its tokens
recomputed later, mostly from the prefix cache). A waiting request may preempt running ones of a
strictly worse priority, so pro traffic is never stuck behind standard traffic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SeqStatus


@dataclass
class SchedulerOutput:
    scheduled: dict[Sequence, int] = field(default_factory=dict)  # sequence -> tokens to compute this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, clock=time.time):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- bookkeeping -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Finish or abort: the sequence leaves at once and its blocks are released."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = SeqStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _aged(self, seq: Sequence, now: float) -> bool:
        return now - seq.arrival_time > self.config.priority_aging_s

    def _rank(self, seq: Sequence, now: float) -> tuple:
        aged = self._aged(seq, now)
        return (0, 0, seq.arrival_time, seq.order) if aged else (1, seq.priority, seq.arrival_time, seq.order)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, budget: list[int]) -> None:
        if seq in out.scheduled:
            budget[0] += out.scheduled.pop(seq)
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        out.preempted.append(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        if self.config.chunked_prefill_size > 0:
            n = min(n, self.config.chunked_prefill_size)
        return n

    # -- the step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        budget = [self.config.max_num_batched_tokens]

        # 1. Running sequences: decodes first, then prefill chunks, each group in rank order.
        for seq in sorted(self.running, key=lambda s: (s.is_prefilling, self._rank(s, now))):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget[0])
            if n == 0:
                continue
            while not self.bm.can_grow(seq, n):
                victims = [s for s in self.running if s is not seq]
                if not victims:
                    break
                victim = max(victims, key=lambda s: self._rank(s, now))
                if self._rank(victim, now) < self._rank(seq, now):
                    victim = seq  # everything else outranks this one: it yields
                self._preempt(victim, out, budget)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING or not self.bm.can_grow(seq, n):
                continue
            self.bm.grow(seq, n)
            out.scheduled[seq] = n
            budget[0] -= n

        # 2. Waiting sequences in rank order; stop at the first that cannot be admitted so a large
        #    request is not starved by a stream of small ones behind it.
        self.waiting.sort(key=lambda s: self._rank(s, now))
        while self.waiting and budget[0] > 0:
            seq = self.waiting[0]
            if seq in out.preempted:
                break  # was just preempted for memory: try again next step
            # Running sequences this one may preempt: strictly lower priority and not protected by aging.
            weaker = sorted((s for s in self.running if s.priority > seq.priority and not self._aged(s, now)),
                            key=lambda s: self._rank(s, now))
            if len(self.running) >= self.config.max_running_requests:
                if not weaker:
                    break
                self._preempt(weaker.pop(), out, budget)
            hits = self.bm.match_prefix(seq)
            n = min(seq.num_tokens - len(hits) * self.bm.block_size, budget[0])
            if self.config.chunked_prefill_size > 0:
                n = min(n, self.config.chunked_prefill_size)
            need = self.bm.blocks_needed(len(hits) * self.bm.block_size + n) - len(hits)
            reclaimable = sum(1 for b in hits if self.bm.blocks[b].ref_count == 0)
            while need > self.bm.num_free_blocks - reclaimable and weaker:
                self._preempt(weaker.pop(), out, budget)
            if need > self.bm.num_free_blocks - reclaimable or n <= 0:
                break
            self.waiting.pop(0)
            self.bm.allocate_prefix(seq, hits)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.bm.grow(seq, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled[seq] = n
            budget[0] -= n
        if out.preempted:
            self.waiting.sort(key=lambda s: self._rank(s, now))
        return out
