"""A GGUF matrix's blocks as integer codes and per-group scales, the form the native CPU step repacks
(kernels/cpu, `pack_q4_1` and `pack_q8g`): w = code * scale + min, with a scale per 16 inputs and a min
per 32. Every type listed in `DECODERS` fits it exactly but for one rounding: the K types' group scale is a
product of two numbers (the super-block's fp16 d times a 6-bit or 8-bit sub-block scale), which the 4-bit,
5-bit and int8 group tiles hold as one fp16 (a relative error of at most 2^-12 per group). Q4_K and Q5_K
also keep the factors themselves (`KScales`): a matrix made of them alone is packed with its own scales
(`pack_kq`), exact and in fewer bytes.

Q4_0 and Q4_1 are read by `engine/loader.py` itself (`_q4_blocks`): torch's int4 matmul reads them too.
F16 and BF16 stay 16-bit weights as they are (`HalfWeights`, the kernel's fp16 and bf16 tiles).
The decoders follow gguf-py's dequantisers (gguf/quants.py), keeping the codes instead of multiplying them
out; the tests compare both on files llama.cpp's `llama-quantize` wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256  # a K type's super-block
_ROWS = 2048  # rows decoded at once


@dataclass(frozen=True)
class KScales:
    """A Q4_K / Q5_K matrix's scales as the file holds them (w = d sc code - dmin mn for each 32 inputs):
    sc, mn uint8 [N, K / 32] (6-bit), d, dmin fp16 [N, K / 256] (the super-block's)."""

    sc: torch.Tensor
    mn: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor


@dataclass(frozen=True)
class GroupBlocks:
    """codes [N, K] int8; scale [N, K / 16] fp32; mn [N, K / 32] fp32. `four_bit`: codes in 0..15 with one
    scale per 32 (Q4_K): the 4-bit tiles hold it. `exact`: every scale and min is exactly an fp16. `k`: a K
    type's own factors of scale and mn (Q4_K, Q5_K)."""

    codes: torch.Tensor
    scale: torch.Tensor
    mn: torch.Tensor
    type_name: str
    four_bit: bool = False
    exact: bool = True
    k: KScales | None = None


@dataclass(frozen=True)
class HalfWeights:
    """A 16-bit matrix as the file holds it: F16 as fp16 [N, K], BF16 as bf16 [N, K]."""

    weight: torch.Tensor
    type_name: str


def half_weights(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> HalfWeights | None:
    """An F16 or BF16 matrix [N, K] as it is (None for another type). `data`: its values or bytes as
    gguf-py maps them. A BF16 file's weights stay bf16: fp16 would flush the tiny ones (below 2^-14) and
    overflow beyond 65504, so converting them would change the model."""
    raw = np.ascontiguousarray(data)
    if type_name == "F16":
        return HalfWeights(torch.from_numpy(raw.view(np.float16).reshape(shape).copy()), type_name)
    if type_name == "BF16":
        bits = torch.from_numpy(raw.view(np.int16).reshape(shape).copy())
        return HalfWeights(bits.view(torch.bfloat16), type_name)
    return None


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row of `b` [n, 2] as fp16 -> fp32 [n]."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0].astype(np.float32)


def _halves(per32: np.ndarray) -> np.ndarray:
    """A scale per 32 inputs [n, g] -> per 16 [n, 2 g]."""
    return np.repeat(per32, 2, axis=-1)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, ...]:  # 34 bytes: fp16 d, 32 int8
    d = _f16(b[:, 0:2])[:, None]
    return b[:, 2:].view(np.int8), _halves(d), np.zeros_like(d)


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31: qs's nibbles (elements 0-15 low, 16-31 high) and bit j of qh as bit 4."""
    high = (np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8)


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, ...]:  # fp16 d, 4 bytes qh, 16 bytes qs; w = (q - 16) d
    d = _f16(b[:, 0:2])[:, None]
    return _five_bit(b[:, 2:6], b[:, 6:22]) - np.int8(16), _halves(d), np.zeros_like(d)


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, ...]:  # fp16 d, fp16 m, 4 bytes qh, 16 bytes qs; w = q d + m
    d, m = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    return _five_bit(b[:, 4:8], b[:, 8:24]), _halves(d), m


def _k_factors(b: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K blocks [n, bytes]: their 6-bit scales and mins [n, 8] uint8, fp16 d and dmin [n]."""
    import gguf

    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    halves = np.ascontiguousarray(b[:, 0:4]).view(np.float16)
    return sc.reshape(-1, 8).astype(np.uint8), mn.reshape(-1, 8).astype(np.uint8), halves[:, 0], halves[:, 1]


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (scale, min) per 32 [n, 8] from fp16 d, fp16 dmin and 12 bytes of 6-bit scales/mins."""
    sc, mn, d, dmin = _k_factors(b)
    scale = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    return scale, -(dmin.astype(np.float32)[:, None] * mn.astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, ...]:  # 144 bytes: d, dmin, scales, 128 bytes of nibbles
    scale, mn = _k_scales(b)
    qs = b[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(-1, QK_K).astype(np.int8), _halves(scale), mn


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, ...]:  # 176 bytes: d, dmin, scales, 32 bytes qh, 128 qs
    scale, mn = _k_scales(b)
    ql = b[:, 48:176].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 1) << 4)
    return q.reshape(-1, QK_K).astype(np.int8), _halves(scale), mn


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, ...]:  # 210 bytes: 128 ql, 64 qh, 16 int8 scales, fp16 d
    d = _f16(b[:, 208:210])[:, None]
    scale = d * b[:, 192:208].view(np.int8).astype(np.float32)  # per 16
    ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(-1, QK_K), scale, np.zeros((b.shape[0], QK_K // 32), np.float32)


# type -> (elements per block, bytes per block, decoder of [blocks, bytes] -> codes, scale per 16, min per 32)
DECODERS: dict[str, tuple[int, int, Callable[[np.ndarray], tuple[np.ndarray, ...]]]] = {
    "Q8_0": (32, 34, _q8_0), "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
    "Q4_K": (QK_K, 144, _q4_k), "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k),
}


def group_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> GroupBlocks | None:
    """The codes and scales of a matrix [N, K] of one of `DECODERS`' types (`data`: its bytes, [N, bytes per
    row] as gguf-py maps them); None for another type or a K that is not a whole number of blocks."""
    if type_name not in DECODERS:
        return None
    n, k = shape
    per, size, decode = DECODERS[type_name]
    if k % per:
        return None
    raw = np.asarray(data, dtype=np.uint8).reshape(n, (k // per) * size)
    codes, scale, mn = np.empty((n, k), np.int8), np.empty((n, k // 16), np.float32), np.empty((n, k // 32), np.float32)
    for a in range(0, n, _ROWS):  # in slices of rows: the decoders' temporaries are several times the codes' size
        b = min(a + _ROWS, n)
        c, s, m = decode(np.ascontiguousarray(raw[a:b]).reshape((b - a) * (k // per), size))
        codes[a:b], scale[a:b], mn[a:b] = c.reshape(b - a, k), s.reshape(b - a, k // 16), m.reshape(b - a, k // 32)
    exact = bool(np.array_equal(scale.astype(np.float16).astype(np.float32), scale)
                 and np.array_equal(mn.astype(np.float16).astype(np.float32), mn))
    k_scales = None
    if type_name in ("Q4_K", "Q5_K"):
        sc, kmn, d, dmin = _k_factors(raw.reshape(n * (k // per), size))
        k_scales = KScales(*(torch.from_numpy(np.ascontiguousarray(x).reshape(n, -1)) for x in (sc, kmn, d, dmin)))
    return GroupBlocks(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(mn), type_name,
                       four_bit=type_name == "Q4_K", exact=exact, k=k_scales)


def dequantize(b: GroupBlocks) -> torch.Tensor:
    """The float64 weights the blocks hold (code * scale + min)."""
    n, k = b.codes.shape
    w = (b.codes.double().view(n, k // 16, 16) * b.scale.double()[..., None]).view(n, k // 32, 32)
    return (w + b.mn.double()[..., None]).view(n, k)
