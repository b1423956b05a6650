"""Pooling: one vector per input from its tokens' last hidden states, as sentence-transformers pools.

`mean` averages every token of the input ([CLS] and [SEP] included: they are not padding), `cls` takes
the first token, `lasttoken` the last one. Inputs are packed end to end (`cu_seqlens`), so each is a
contiguous run of rows and no mask is needed.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

PoolingMode = Literal["mean", "cls", "lasttoken"]
POOLING_MODES: tuple[PoolingMode, ...] = ("mean", "cls", "lasttoken")


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: PoolingMode, normalize: bool) -> torch.Tensor:
    """hidden [num_tokens, hidden] -> float32 [inputs, hidden]; unit length when `normalize`."""
    if mode == "cls":
        out = hidden.index_select(0, cu_seqlens[:-1])
    elif mode == "lasttoken":
        out = hidden.index_select(0, cu_seqlens[1:] - 1)
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths)
        out = hidden.new_zeros(lengths.numel(), hidden.shape[1]).index_add_(0, rows, hidden)
        out = out / lengths.unsqueeze(1).to(out.dtype)
    return F.normalize(out, p=2.0, dim=1) if normalize else out
