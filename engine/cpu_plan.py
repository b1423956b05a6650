"""How a step runs on a CPU, by its size: packed low-bit weights or dense ones, and how many threads.

Two facts of small CPU boxes decide it. A decode step of a few rows is bound by the bytes of weights
it reads, so the packed weights (int4 layers, int8 output layer) win there, while at larger steps the
dense bf16 matmul (AMX / AVX512-BF16) beats dequantising. And with `OMP_WAIT_POLICY=PASSIVE` (no
busy-waiting, which starves everything else on a 2-core box) every parallel region wakes sleeping
threads, which costs tens of microseconds on a VM: a 576x576 int4 matmul takes ~20 us on one thread
and ~95 us on two. So the ~120 small matmuls of a batch-1 step run on one thread, while the output
layer (49k rows) and larger steps use every thread.

Nothing here is guessed: `measure_plan` times each choice on this machine at start, per step size,
on all the weights of a group (so caches do not flatter either side), and the model looks the
choice up per step (`Plan.for_rows`).

Which CPU kernels run at all (native or torch), with how many threads, and from how many rows the
native step multiplies on AMX, is one decision (`CpuKernels`): the model runner makes it once at start
and hands the same object to the model and the sampler.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.cpu.cpuinfo import cpu_info
from kernels.dispatch import native_cpu_allowed

ROW_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # a CPU with these multiplies bf16 in hardware
# Fewer threads than all must be this much faster to be chosen (timing noise at start aside, the
# attention and elementwise ops of larger steps, which are not timed, gain from all threads).
FEWER_THREADS_MARGIN = 1.1


@dataclass
class CpuKernels:
    """The engine's CPU kernel choice, made once by the model runner (`decide`) and shared, as one object,
    by the model and the sampler, so no op picks an implementation or a thread count on its own.

    `native`: kernels/cpu runs the forward step (where the model's weights allow it), its int8 output
    layer and sampling; only where `SLUICE_KERNELS` allows native code and it built here
    (kernels.dispatch.native_cpu_allowed). `threads`: what every native call uses, and the most a torch
    step's plan takes. `wide_min_rows`: native steps of at least this many rows take int8 dot products, and
    of at least `amx_min_rows` AMX tiles (0: never); configured or timed by the runner at start, before the
    first step."""

    native: bool = False
    threads: int = 1
    wide_min_rows: int = 0
    amx_min_rows: int = 0
    # The CPU multiplies bf16 in hardware (AVX512-BF16, AMX); without it oneDNN emulates a bf16 matmul
    # ~5x slower than float32, so the deterministic path multiplies bf16 weights in float32 instead.
    bf16_units: bool = False

    @staticmethod
    def decide(device: torch.device) -> CpuKernels:
        """Native kernels where the device is a CPU and they are allowed; this process's torch threads."""
        return CpuKernels(native=device.type == "cpu" and native_cpu_allowed(), threads=torch.get_num_threads(),
                          bf16_units=device.type == "cpu" and cpu_has_bf16_units())


@dataclass(frozen=True)
class Choice:
    packed: bool  # the low-bit weights (else the dense bf16 ones)
    threads: int

    def __str__(self) -> str:
        return f"{'packed' if self.packed else 'dense'}/{self.threads}t"


@dataclass(frozen=True)
class Plan:
    """Steps of up to `rows[i]` rows run `choices[i]`; larger steps run `above`."""

    rows: tuple[int, ...]
    choices: tuple[Choice, ...]
    above: Choice

    def for_rows(self, n: int) -> Choice:
        i = bisect.bisect_left(self.rows, n)
        return self.choices[i] if i < len(self.rows) else self.above

    def packed_max_rows(self) -> int:
        """The largest measured step size that runs the packed weights (0: none)."""
        return max((r for r, c in zip(self.rows, self.choices) if c.packed), default=0)

    def describe(self) -> str:
        return ", ".join(f"<={r}: {c}" for r, c in zip(self.rows, self.choices)) + f", above: {self.above}"

    def to_json(self) -> dict[str, object]:
        """For the tuning cache (engine/tuning_cache.py)."""
        return {"rows": list(self.rows), "choices": [[c.packed, c.threads] for c in self.choices],
                "above": [self.above.packed, self.above.threads]}

    @staticmethod
    def from_json(d: dict) -> Plan:
        return Plan(tuple(int(r) for r in d["rows"]), tuple(Choice(bool(p), int(t)) for p, t in d["choices"]),
                    Choice(bool(d["above"][0]), int(d["above"][1])))

    @staticmethod
    def fixed(threads: int, packed_max_rows: int = 0) -> Plan:
        """No measurement: packed weights up to `packed_max_rows`, `threads` threads throughout."""
        if packed_max_rows <= 0:
            return Plan((), (), Choice(False, threads))
        return Plan((packed_max_rows,), (Choice(True, threads),), Choice(False, threads))


def cpu_has_bf16_units() -> bool:
    """The CPU's flags list bf16 dot-product units (what oneDNN may use; see engine/embedding/precision.py
    for why the embedding engine also times them)."""
    return not cpu_info().flags.isdisjoint(NATIVE_BF16_FLAGS)


def thread_candidates(max_threads: int) -> list[int]:
    """1, the powers of two in between, and all threads (at most four counts to time)."""
    counts = {1, max_threads}
    t = 2
    while t < max_threads and len(counts) < 4:
        counts.add(t)
        t *= 2
    return sorted(counts)


def _best_time(fn: Callable[[], object], threads: int, reps: int = 2) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best
    finally:
        torch.set_num_threads(previous)


def measure_plan(run: Callable[[int, bool], Callable[[], object]], max_threads: int, can_pack: bool,
                 forced_packed_rows: int | None = None, rows: Sequence[int] = ROW_CANDIDATES,
                 all_threads_only: bool = False) -> tuple[Plan, dict[int, dict[str, float]]]:
    """Times `run(rows, packed)()` (a group's matmuls for a step of `rows` rows) for every choice of
    weights and threads at each row count, and keeps the fastest. `forced_packed_rows`: the packed
    weights up to that many rows whatever the timing (configured); only threads are measured.
    Assumes that what loses at one size loses at all larger ones (the packed weights, fewer threads),
    and stops once the dense weights on all threads win twice in a row: larger steps run that.
    `all_threads_only`: time only the weights, on all threads (one large matmul always gains from them).
    Returns the plan and the times {rows: {choice: seconds}} for the log."""
    threads = [max_threads] if all_threads_only else thread_candidates(max_threads)
    if forced_packed_rows is not None and 0 < forced_packed_rows < max(rows):
        rows = sorted({*rows, forced_packed_rows})  # the configured boundary is a bucket edge
    dense_all = Choice(False, max_threads)
    kept_rows: list[int] = []
    kept: list[Choice] = []
    times: dict[int, dict[str, float]] = {}
    dense_wins = 0
    packed_in_play = can_pack  # once the packed weights lose at some size they lose at all larger ones
    fewest_threads = {True: threads[0], False: threads[0]}  # likewise fewer threads, once all threads win
    for m in rows:
        if forced_packed_rows is not None:
            paths = [m <= forced_packed_rows and can_pack]
        else:
            paths = [True, False] if packed_in_play else [False]
        options = [Choice(p, t) for p in paths for t in threads if t >= fewest_threads[p]]
        with torch.inference_mode():
            measured = {c: _best_time(run(m, c.packed), c.threads) for c in options}
        best = min(measured, key=measured.__getitem__)
        all_threads = Choice(best.packed, max_threads)
        if all_threads in measured and measured[all_threads] <= measured[best] * FEWER_THREADS_MARGIN:
            best = all_threads  # only the matmuls were timed: the step's other ops like all threads
        times[m] = {str(c): s for c, s in measured.items()}
        kept_rows.append(m)
        kept.append(best)
        if forced_packed_rows is None and not best.packed:
            packed_in_play = False
        if best.threads == max_threads:
            fewest_threads[best.packed] = max_threads
        dense_wins = dense_wins + 1 if best == dense_all else 0
        if dense_wins >= 2 and (forced_packed_rows is None or m > forced_packed_rows):
            break
    above_packed = forced_packed_rows is not None and forced_packed_rows > kept_rows[-1] and can_pack
    above = Choice(above_packed, max_threads)
    return Plan(tuple(kept_rows), tuple(kept), above), times


WIDE_MODES = ("int16", "int8", "amx")  # the native step's matmuls, as `wide_thresholds` names them


def wide_thresholds(time_step: Callable[[int, str], float], modes: Sequence[str],
                    rows: Sequence[int] = ROW_CANDIDATES,
                    repeats: int = 3) -> tuple[int, int, dict[int, dict[str, float]]]:
    """From how many rows the native step's int8 matmul, and from how many its AMX one, beat the others at
    every larger size measured: `time_step(rows, mode)` times one step with `mode` (of WIDE_MODES; `modes`:
    those this build and CPU have, "int16" always). A size's winner is the fastest mode there (best of
    `repeats`, the modes taking turns: with each mode's two runs back to back, a one-row SmolLM2 step on
    the AVX2 build (its int8 columns then through a decoded buffer) read int16 5.30 / int8 5.27 ms, where
    30 alternating runs gave 4.78 / 5.27 at best, 5.07 / 5.63 at the median). Stops once the last mode of
    `modes` (AMX where there is one, else int8) has won twice in a row. Returns (int8 from, AMX from; 0:
    never) and the times {rows: {mode: seconds}}.

    Why three ways: int8 dot products cost per row, AMX a widening of every weight block per 32 rows and
    little per row, so on a CPU with both int8 wins the middle sizes and AMX the large ones."""
    assert modes and modes[0] == "int16" and set(modes) <= set(WIDE_MODES)
    times: dict[int, dict[str, float]] = {}
    best: list[tuple[int, str]] = []
    with torch.inference_mode():
        for mode in modes:  # warm: the first step of each mode pays for cold caches and page faults
            time_step(rows[0], mode)
        for m in rows:
            runs: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(repeats):
                for mode in modes:
                    runs[mode].append(time_step(m, mode))
            times[m] = {mode: min(t) for mode, t in runs.items()}
            best.append((m, min(times[m], key=times[m].__getitem__)))
            if len(modes) > 1 and [b for _, b in best[-2:]] == [modes[-1]] * 2:
                break

    def from_rows(wins: Callable[[str], bool]) -> int:
        """The smallest size from which every measured size's winner passes `wins` (0: the last fails)."""
        first = 0
        for m, b in best:
            first = (first or m) if wins(b) else 0
        return first

    amx = from_rows(lambda b: b == "amx")
    int8 = from_rows(lambda b: b != "int16")
    # int8 from where it stops losing to int16, unless it never wins at all (then AMX takes those sizes)
    if not any(b == "int8" for m, b in best if m >= int8):
        int8 = 0
    return int8, amx, times
