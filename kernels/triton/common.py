"""Helpers shared by the Triton ops: block sizes, dot precision, the device's SM count."""

from __future__ import annotations

import functools
import os

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get a true fp32 dot (no TF32) so the fp32 path matches the reference closely."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Under the interpreter, `tl.dot` on bf16 returns garbage (numpy has no bf16): the kernels then round
    their dot inputs to bf16 exactly as on the GPU and multiply in fp32. Never on a real GPU."""
    return dtype == torch.bfloat16 and interpret_mode()


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
