"""Decides, every step, which sequences run and how many tokens each computes.

The output is vLLM v1's shape: `{sequence: num_tokens}` under a token budget
(`max_num_batched_tokens`). Running decodes go first (one token each, so streams keep flowing), then
running prefills continue in chunks of at most `chunked_prefill_size`, then waiting requests are
admitted in order of rank: aged requests first (waiting longer than `priority_aging_s`, by arrival),
then by priority (lower number first), then by arrival. A preempted sequence keeps its arrival time,
so it goes back ahead of newer arrivals of its tier.

Steps are bounded by their cost, not only by their tokens (`StepCost`: rows and attended (row, key)
pairs): a chunk deep in a long context is cut to what the step's cost cap allows (the cost of
`max_num_batched_tokens` rows at position 0), so no prompt length can make one step take seconds.
While decodes run, prefill is fair (`fair_prefill`): a prefilling sequence spends a credit that grows
each step by `prefill_share` (default 0.7) times the cost one decode stream gets (processor sharing:
with four streams running, a long prompt takes 0.7 / 4.7 of the engine), starting with a burst of one
full chunk at position 0 so that short prompts still join in one step. Chunk costs are corrected by
what the steps really take (`observe`, `ChunkCalibration`), so the share is one of real time. A chunk
smaller than MIN_CHUNK waits for more credit. In a step that admits new requests, running prefills take at most what the
newcomers' first chunks cost, so a new stream's first token never waits out a full-cap chunk of someone
else's long prompt.

When blocks run out, the lowest-ranked running sequence is preempted (its blocks freed; its tokens
recomputed later, mostly from the prefix cache). A waiting request may preempt running ones of a
strictly worse priority, so pro traffic is never stuck behind standard traffic.

The scheduler is the only writer of a sequence's progress: after the model runner returns the sampled
tokens, `update_from_output` advances `num_computed_tokens`, registers newly full blocks in the prefix
cache, appends the tokens (which advances a guided sequence's grammar) and finishes sequences on a stop
token, a completed grammar or at their output limit (stop strings, found by the output processor,
arrive through `finish`). Questions about KV memory go to the
block manager (`can_grow`, `can_admit`); the scheduler never reads the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager, PrefixMatch
from .config import EngineConfig
from .request import FinishReason
from .sequence import SeqStatus, Sequence
from .step_cost import ChunkCalibration, StepCost

log = logging.getLogger(__name__)
Rank = tuple[int, int, float, int]
MIN_CHUNK = 16  # while decodes run, a prefill chunk smaller than this (and than the rest) waits for credit
MIN_STEP_CHUNK = 64  # max_step_seconds never caps a step below this chunk's cost: the base's share stays small


@dataclass
class SchedulerOutput:
    scheduled: dict[Sequence, int] = field(default_factory=dict)  # sequence -> tokens to compute this step
    preempted: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0  # sum of `scheduled`'s values
    cost: float = 0.0  # predicted cost of the scheduled rows (StepCost units, without the step's base)
    num_decodes: int = 0
    decode_cost: float = 0.0
    admitted_cost: float = 0.0  # the first chunks of sequences admitted this step
    chunk_bias: float = 1.0  # the calibration's bias when scheduled: prefill chunks' costs include it
    _costs: dict[Sequence, tuple[float, bool]] = field(default_factory=dict)  # seq -> (cost, is a decode)

    def add(self, seq: Sequence, n: int, cost: float = 0.0, decode: bool = False) -> None:
        self.scheduled[seq] = n
        self.num_tokens += n
        self._costs[seq] = (cost, decode)
        self.cost += cost
        if decode:
            self.num_decodes += 1
            self.decode_cost += cost

    def drop(self, seq: Sequence) -> None:
        self.num_tokens -= self.scheduled.pop(seq, 0)
        cost, decode = self._costs.pop(seq, (0.0, False))
        self.cost -= cost
        if decode:
            self.num_decodes -= 1
            self.decode_cost -= cost


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, clock: Callable[[], float] = time.time,
                 cost: StepCost | None = None):
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.cost = cost or StepCost()
        self.calibration = ChunkCalibration()
        self._logged_bias = 1.0
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._set_cost_limits()

    def _set_cost_limits(self) -> None:
        c = self.config
        chunk = c.chunked_prefill_size if c.chunked_prefill_size > 0 else c.max_num_batched_tokens
        self.step_cap = self.cost.chunk(c.max_num_batched_tokens, 0)  # the most one step may cost
        if self.cost.seconds and c.max_step_seconds > 0:  # (the costs scheduled leave the step's base out)
            floor = self.cost.chunk(min(MIN_STEP_CHUNK, c.max_num_batched_tokens), 0)
            self.step_cap = min(self.step_cap, max(c.max_step_seconds - self.cost.base, floor))
        self.burst = self.cost.chunk(chunk, 0)  # a prefill's credit when it starts (and its ceiling)

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
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.FINISHED

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends the sequence with `reason`. On an already finished one only the reason changes: a stop
        string found in the same token that reached the output limit makes it "stop", not "length"."""
        seq.finish_reason = reason
        if seq.status is not SeqStatus.FINISHED:
            self.remove(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _aged(self, seq: Sequence, now: float) -> bool:
        return now - seq.arrival_time > self.config.priority_aging_s

    def _rank(self, seq: Sequence, now: float) -> Rank:
        aged = self._aged(seq, now)
        return (0, 0, seq.arrival_time, seq.order) if aged else (1, seq.priority, seq.arrival_time, seq.order)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        out.drop(seq)  # its tokens go back to the step's budget
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.append(seq)
        out.preempted.append(seq)

    def _budget(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - out.num_tokens

    def _chunk(self, seq: Sequence, start: int, num_uncomputed: int, out: SchedulerOutput,
               beside_new: bool = False) -> int:
        """Tokens to compute this step from position `start`: what is left, within the step's token budget,
        the prefill chunk size, the step's cost cap and, while decodes run, the sequence's credit. A running
        prefill `beside_new` requests admitted this step costs at most what their first chunks cost: a
        newcomer's first token then waits for a step about twice its own, not for a full-cap chunk of
        someone's long prompt (with no decodes running, that chunk would otherwise take the whole cap)."""
        n = min(num_uncomputed, self._budget(out))
        if self.config.chunked_prefill_size > 0:
            n = min(n, self.config.chunked_prefill_size)
        if n <= 1:
            return n
        allowance = self.step_cap - out.cost
        if beside_new and out.admitted_cost > 0:
            allowance = min(allowance, out.admitted_cost)
        fair = self._fair(out)
        credit = min(seq.prefill_credit, self.burst)
        if fair:
            allowance = min(allowance, credit)
        fit = self.cost.max_chunk(start, allowance / self.calibration.bias, n)
        if fit < min(MIN_CHUNK, n):
            if fair and credit < self.burst:
                return 0  # wait for more credit
            if not fair and out.scheduled:
                return 0  # wait for a step with room
        return max(fit, 1)

    def _schedule_prefill(self, seq: Sequence, start: int, n: int, out: SchedulerOutput) -> None:
        cost = self.cost.chunk(n, start) * self.calibration.bias
        if self._fair(out):
            seq.prefill_credit = min(seq.prefill_credit, self.burst) - cost
        out.add(seq, n, cost)

    def _fair(self, out: SchedulerOutput) -> bool:
        """Prefills share the step with running decodes (the first rows scheduled are the decodes)."""
        return self.config.fair_prefill and out.num_decodes > 0

    # -- the step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(chunk_bias=self.calibration.bias)
        # Decodes, then new requests' first chunks, then the running prefills' next chunks: a prompt that
        # takes whole steps cannot keep a short request waiting behind it for its whole prefill.
        self._schedule_running(out, now, prefills=False)
        self._admit_waiting(out, now)
        self._schedule_running(out, now, prefills=True)
        if out.preempted:
            self.waiting.sort(key=lambda s: self._rank(s, now))
        self._earn_credit(out)
        return out

    def _earn_credit(self, out: SchedulerOutput) -> None:
        """Each prefilling sequence earns `prefill_share` times what one decode stream got this step (no
        decodes: a full burst)."""
        if not self.config.fair_prefill:
            return
        share = self.config.prefill_share * out.decode_cost / out.num_decodes if out.num_decodes else 0.0
        for seq in self.running:
            if seq.is_prefilling:
                seq.prefill_credit = min(self.burst, seq.prefill_credit + share) if out.num_decodes else self.burst

    def _schedule_running(self, out: SchedulerOutput, now: float, prefills: bool) -> None:
        """Running decodes (`prefills` false) or running prefills' next chunks, in rank order. A sequence
        that needs blocks takes them from the lowest-ranked running one, or yields its own."""
        for seq in sorted((s for s in self.running if s.is_prefilling == prefills), key=lambda s: self._rank(s, now)):
            if seq.status is not SeqStatus.RUNNING or seq in out.scheduled:
                continue  # preempted earlier in this loop, or admitted in this step
            start = seq.num_computed_tokens
            n = self._chunk(seq, start, seq.num_uncomputed, out, beside_new=prefills)
            if n == 0:
                continue
            while not self.bm.can_grow(seq, n):
                victims = [s for s in self.running if s is not seq]
                if not victims:
                    break
                victim = max(victims, key=lambda s: self._rank(s, now))
                if self._rank(victim, now) < self._rank(seq, now):
                    victim = seq  # everything else outranks this one: it yields
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING and self.bm.can_grow(seq, n):
                self.bm.grow(seq, n)
                if seq.is_prefilling:
                    self._schedule_prefill(seq, start, n, out)
                else:
                    out.add(seq, n, self.cost.of(1, start + 1) - self.cost.base, decode=True)

    def _admit_waiting(self, out: SchedulerOutput, now: float) -> None:
        """Waiting sequences in rank order; stops at the first that cannot be admitted, so a large
        request is not starved by a stream of small ones behind it."""
        self.waiting.sort(key=lambda s: self._rank(s, now))
        while self.waiting and self._budget(out) > 0 and out.cost < self.step_cap:
            seq = self.waiting[0]
            if seq in out.preempted:
                break  # was just preempted for memory: try again next step
            # Running sequences this one may preempt: strictly lower priority and not protected by aging.
            weaker = sorted((s for s in self.running if s.priority > seq.priority and not self._aged(s, now)),
                            key=lambda s: self._rank(s, now))
            if len(self.running) >= self.config.max_running_requests:
                if not weaker:
                    break
                self._preempt(weaker.pop(), out)
            match = self.bm.match_prefix(seq)
            n = self._chunk(seq, match.num_tokens, seq.num_tokens - match.num_tokens, out)
            if n == 0:
                break
            while not self.bm.can_admit(match, n) and weaker:
                self._preempt(weaker.pop(), out)
            if not self.bm.can_admit(match, n):
                break
            self.waiting.pop(0)
            self._admit(seq, match, n, out)

    def _admit(self, seq: Sequence, match: PrefixMatch, n: int, out: SchedulerOutput) -> None:
        self.bm.allocate_prefix(seq, match)
        seq.num_computed_tokens = match.num_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = match.num_tokens
        self.bm.grow(seq, n)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        cost = out.cost
        self._schedule_prefill(seq, match.num_tokens, n, out)
        out.admitted_cost += out.cost - cost

    # -- after the step ----------------------------------------------------------------------------
    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """How long a step took: chunk costs are calibrated against it (`ChunkCalibration`)."""
        if self.config.fair_prefill:
            self.calibration.observe(self.cost.base, sched.decode_cost,
                                     (sched.cost - sched.decode_cost) / sched.chunk_bias, seconds)
            bias = self.calibration.bias
            if abs(bias / self._logged_bias - 1) > 0.25:
                log.info("prefill chunks cost %.2fx the step cost model's prediction (decode steps %.2fx); "
                         "chunks are charged that", bias, self.calibration.decode_scale)
                self._logged_bias = bias

    def update_from_output(self, sched: SchedulerOutput, sampled: dict[Sequence, int]) -> None:
        """Applies a finished step: every scheduled sequence's tokens now have K/V in the cache (its
        full blocks join the prefix cache), and each sequence that sampled gets its token and
        finishes on a stop token or at its output limit. Sequences that left during the step (a
        request whose step failed on its own is aborted) are skipped."""
        for seq, n in sched.scheduled.items():
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed_tokens += n
            self.bm.commit(seq)
        for seq, token in sampled.items():
            seq.append_output(token)
            reason = seq.stop_reason()
            if reason is not None:
                self.finish(seq, reason)
