"""SiLU-and-multiply over a fused gate/up projection.

`silu_and_mul(gate_up)` with `gate_up = [..., 2 * I]` (gate first, then up) returns
`silu(gate) * up` of shape `[..., I]`, as the engine's `gate, up = x.chunk(2, -1)` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
