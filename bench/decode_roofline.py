"""Decode step time at several batch sizes against this machine's memory-bandwidth bound, and where it goes.

Bound = bytes a decode step must read (every weight once, as the step reads it: the 4-bit blocks at
batches on the int4 path, bf16 above; plus each sequence's K/V) divided by the read bandwidth measured
here, in this process, just before.

Breakdown of a step (wall time, without the profiler): the forward (`ModelRunner._forward`), sampling
(`sample`), and the rest of `LLMEngine.step` (scheduling, output processing, Python). With the native
CPU forward step (one call torch's profiler cannot see into) the layers are split by the step's own
phase timers (kernels/cpu `profile`): linear layers (matmuls), attention (the kernel over the paged
cache), norms/rotary/activation (with the KV write and quantising the matmuls' inputs), and its
threads' waits at barriers; the native output layer is timed around its call. On the torch path a
second, profiled run of the same steps splits the forward into its ops' own time: linear layers,
attention (KV write, gather and the attention kernel), norms/rotary/activation (elementwise), and the
rest of the forward (other ops, dispatch and Python between ops).

    python -m bench.decode_roofline [--batches 1,16,64] [--context 256]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import profile

import engine.model_runner as model_runner
import kernels.cpu as cpu_kernels
from bench.common import machine
from engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams

CATEGORIES = {
    "linear": ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
               "aten::bmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select", "aten::index_copy_",
                  "aten::_scaled_dot_product_attention_math"),
    "norms/rotary/act": ("aten::pow", "aten::mean", "aten::rsqrt", "aten::mul", "aten::add", "aten::sub",
                         "aten::cat", "aten::silu", "aten::neg", "aten::div", "aten::copy_", "aten::index"),
}


def read_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """Bytes/s of a large streaming read (a sum over a buffer far bigger than the caches)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = max(best, nbytes / (time.perf_counter() - t))
    return best


def weight_bytes(engine: LLMEngine, batch: int) -> int:
    """Bytes of weights a decode step of `batch` rows reads (the native step's 4-bit matrices, or packed
    or dense as the model's plan says)."""
    m = engine.runner.model
    if m.native is not None:  # its layers' tiles and, with them, its output layer's int8 or 4-bit copy
        head = m.head_tiles if m.head_tiles is not None else m.head_rows if m.head_rows is not None else m.lm_head
        assert head is not None
        return m.native.nbytes() + head.nbytes()
    layers_packed = m.layer_plan.for_rows(batch).packed if m.layer_plan else False
    head = m.lm_head_fast or m.lm_head  # the output layer actually read each step
    assert head is not None
    head_packed = m.head_plan.for_rows(batch).packed if m.head_plan and m.lm_head_fast else False
    return head.nbytes(head_packed) + sum(lin.nbytes(layers_packed) for lin in m.linears())


class Timers:
    """Wall time spent in the runner's forward and in sampling, by patching both in place."""

    def __init__(self, engine: LLMEngine):
        self.t: dict[str, float] = defaultdict(float)
        runner = engine.runner
        self._forward = runner._forward
        self._sample = model_runner.sample
        runner._forward = self._timed("forward", self._forward)  # type: ignore[method-assign]
        model_runner.sample = self._timed("sampling", self._sample)
        if runner.model.native is not None:  # native calls: the profiler sees no ops inside them
            native = runner.model.native
            native.run = self._timed("native", native.run)  # type: ignore[method-assign]
            cpu_kernels.head_logits = self._timed("output layer", cpu_kernels.head_logits)

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[key] += time.perf_counter() - t
        return wrapper

    def reset(self) -> None:
        self.t.clear()


def op_times(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Seconds per step of each category's ops (self CPU time) inside the forward, from the profiler."""
    with profile() as prof:
        for _ in range(steps):
            engine.step()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        for cat, names in CATEGORIES.items():
            if ev.key in names:
                out[cat] += ev.self_cpu_time_total / 1e6 / steps
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=256, help="tokens of context per sequence")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--model", default=None, help="a GGUF file or model folder (default: the packaged model)")
    ap.add_argument("--wide-min-rows", type=int, default=None,
                    help="native steps of at least this many rows take the wide matmul (0: never; default: measured)")
    ap.add_argument("--amx-min-rows", type=int, default=None,
                    help="CPUs with AMX: steps of at least this many rows on AMX tiles (0: never; default: measured)")
    ap.add_argument("--output-layer-bits", type=int, choices=(4, 8), default=None,
                    help="the native output layer's candidate copy (default: by its size)")
    a = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=a.model, max_running_requests=64, kv_cache_tokens=65536,
                                    enable_prefix_caching=False, weight_dtype=a.weight_dtype,
                                    output_layer_bits=a.output_layer_bits, wide_min_rows=a.wide_min_rows,
                                    amx_min_rows=a.amx_min_rows))
    runner = engine.runner
    bw = read_bandwidth()
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}")
    m = runner.model
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; weights {runner.describe_weights()}; "
          f"KV cache {str(runner.kv_dtype).removeprefix('torch.')}")
    if m.native is not None:
        k = m.kernels
        amx = "; ".join(([f"{m.native.wide} matmuls from {k.wide_min_rows} rows"] if k.wide_min_rows else []) +
                        ([f"AMX from {k.amx_min_rows} rows"] if k.amx_min_rows else [])) or "no wide matmuls"
        print(f"native CPU forward step ({m.native.isa}, {m.kernels.threads} threads) for every step; {amx}; "
              f"its layer weights {m.native.nbytes() / 2**20:.0f} MiB")
    if m.layer_plan is not None and m.head_plan is not None:
        print(f"CPU step plan (weights/threads by step size): layers {m.layer_plan.describe()}; "
              f"output layer {m.head_plan.describe()}")
    timers = Timers(engine)
    for b in [int(x) for x in a.batches.split(",")]:
        # Long enough that no sequence finishes while prefills of the others run or while measuring: each
        # prefill step takes at least one prompt token (max_step_seconds can cut its chunks far below
        # max_num_batched_tokens: 16 x 512 tokens on the native build ran out), within the context length.
        budget = min(a.steps * 3 + 10 + b * a.context, engine.max_model_len - a.context)
        reqs = [EngineRequest(f"{b}-{i}", [(i * 7 + j) % 1000 + 100 for j in range(a.context)],
                              SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)) for i in range(b)]
        for r in list(engine.scheduler.running):  # the previous batch size's sequences: this one runs alone
            engine.abort(r.request_id)
        for r in reqs:
            engine.add_request(r)
        while any(s.is_prefilling for s in engine.scheduler.running) or engine.num_waiting:
            engine.step()
        engine.step()
        timers.reset()
        cpu_kernels.profile(True)
        cpu_kernels.profile_read()
        t = time.perf_counter()
        for _ in range(a.steps):
            engine.step()  # (a step may emit no text for a sequence whose new token ends mid-character)
        step = (time.perf_counter() - t) / a.steps
        phases = {k: v / a.steps for k, v in cpu_kernels.profile_read().items()}
        cpu_kernels.profile(False)
        assert len(engine.scheduler.running) == b and not engine.num_waiting  # all b decoded every step
        fwd, smp = timers.t["forward"] / a.steps, timers.t["sampling"] / a.steps
        native, head = timers.t["native"] / a.steps, timers.t["output layer"] / a.steps
        ops = op_times(engine, a.steps) if m.native is None else {}
        wbytes = weight_bytes(engine, b)
        kv = b * (a.context + a.steps) * runner.kv_bytes_per_token
        bound = (wbytes + kv) / bw
        print(f"batch {b:3d}: step {step * 1000:7.1f} ms  {b / step:7.1f} tok/s   reads {(wbytes + kv) / 2**20:5.0f} MiB "
              f"(weights {wbytes / 2**20:.0f})  bound {bound * 1000:6.1f} ms   fraction of bound {bound / step:5.2f}   "
              f"step / weight-read time {step / (wbytes / bw):5.1f}x")
        if m.native is not None:
            head_kind = "4-bit" if isinstance(m.head_tiles, cpu_kernels.LayerTiles) else "int8"
            # the layers by the native step's own timers (its first thread's view), the rest of its call
            # (entry, copies) with them; then the output layer's call
            mm, att, wait = phases["matmuls"], phases["attention"], phases["waits at barriers"]
            parts = {"linear": mm, "attention": att, "norms/rotary/act": max(0.0, native - mm - att - wait),
                     "thread waits": wait, f"output layer ({head_kind})": head}
        else:
            parts = {k: ops.get(k, 0.0) for k in CATEGORIES}
        parts["other ops + dispatch in forward"] = max(0.0, fwd - sum(parts.values()))
        parts["sampling"] = smp
        parts["scheduling/Python"] = max(0.0, step - fwd - smp)
        print("           " + "  ".join(f"{k} {v * 1000:.1f} ms ({v / step:.0%})" for k, v in parts.items()))
        for r in reqs:
            engine.abort(r.request_id)


if __name__ == "__main__":
    main()
