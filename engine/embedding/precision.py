"""The forward's dtype when the configuration says `auto`: bf16 only where this machine multiplies it
faster than float32.

The CPU's flags say whether bf16 dot-product units exist (AVX512-BF16, AMX); without them oneDNN
emulates bf16 in float32 and a step takes about five times longer. The flags alone are not enough:
a cap on the instruction sets oneDNN may use (ONEDNN_MAX_CPU_ISA) or a hypervisor that hides state
leaves the units unused while /proc/cpuinfo still lists them. So where the flags allow bf16, one
matmul of the encoder's shape is timed in both dtypes at start (tens of milliseconds), and bf16 must
win clearly; on CUDA bf16 always does.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..cpu_plan import cpu_has_bf16_units

BF16_MARGIN = 1.3  # bf16 must be this much faster than float32 (it is ~2x where the units work)


def bf16_measured_faster(hidden: int = 384, rows: int = 256) -> bool:
    """A [rows, hidden] x [hidden, 4 * hidden] matmul, best of five, in bf16 against float32."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, hidden, generator=g), torch.randn(4 * hidden, hidden, generator=g)

    def best(dtype: torch.dtype) -> float:
        xd, wd = x.to(dtype), w.to(dtype)
        F.linear(xd, wd)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            F.linear(xd, wd)
            times.append(time.perf_counter() - t)
        return min(times)

    return best(torch.bfloat16) * BF16_MARGIN < best(torch.float32)


def resolve_dtype(name: str, device: torch.device, hidden: int = 384) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16_units() and bf16_measured_faster(hidden) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
