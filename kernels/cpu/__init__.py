"""The forward step for CPUs (`forward.c` and the parts it includes, built by `build.py`): every layer of a
flat batch of tokens (decodes and prefill chunks) in one native call over the model file's own 4-bit weights.

`ForwardStep.run` takes what the torch path takes (embeddings, positions, slots, block tables, the
bf16 KV cache) and leaves each row's residual stream after the last layer in place, so the caller's
final norm and output layer are shared with the torch path.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import build
from .abi import Dims as _Dims  # the structs the step takes (checked against each build)
from .abi import Layer as _Layer
from .abi import Tiles as _Tiles
from .memory import on_huge_pages

GROUP = 32  # inputs per scale and min
TILE_N = 16  # output rows per block
BLOCK_BYTES = 320  # a TILES_Q4 block: 256 bytes of codes, 16 fp16 scales d, 16 fp16 mins m




TILES_Q4, TILES_Q8G, TILES_F16, TILES_BF16, TILES_Q8G6, TILES_Q5, TILES_Q8 = 0, 1, 2, 3, 4, 5, 6  # sluice_forward.h's
TILES_Q4K, TILES_Q5K, TILES_Q6 = 7, 8, 9
QK_K = 256  # a K type's super-block: TILES_Q4K / TILES_Q5K share D and M over 8 blocks
Q8G6_MAX_CODE = 32  # TILES_Q8G6: TILES_Q8G with every code in [-32, 32] (AVX2's int8 matmul reads it)


@dataclass(frozen=True)
class LayerTiles:
    """A layer's weight [N, K] as the kernel reads it (sluice_forward.h, `layer_tiles`): blocks of 16 output
    rows by 32 inputs with the codes in the order of an AMX bf16 tile (two input positions of all 16 rows
    per 32 codes). TILES_Q4: 256 bytes of 4-bit codes, then the 16 rows' fp16 scales d and mins m
    (w = code * d + m; GGML Q4_0, Q4_1, Q4_K; 0.625 bytes per weight, Q4_1's own). TILES_Q8G: 512 bytes
    of int8 codes, the rows' fp16 d for inputs 0-15 and for 16-31, then their fp16 m (Q6_K and others;
    1.19 bytes per weight); TILES_Q8G6 the same with every code in [-32, 32] (the Q5 and Q6 types');
    TILES_Q8: the codes and one fp16 d per row (Q8_0; 1.0625 bytes). TILES_F16 / TILES_BF16: the weights as
    fp16 / bf16 in the codes' order (2 bytes). TILES_Q5: TILES_Q4's nibbles, then each code's fifth bit
    (64 bytes), then d and m (Q5_0, Q5_1, Q5_K; 0.75 bytes). TILES_Q4K / TILES_Q5K: TILES_Q4's / TILES_Q5's
    codes with a K type's own scales (Q4_K, Q5_K; `pack_kq`): 0.58 / 0.70 bytes, d and m exact. TILES_Q6:
    codes in [-32, 31] (Q6_K's) plus 32: TILES_Q4's nibbles, then bits 4-5 two to a tile row in the byte of
    the nibble (`pack_q6`), then d per 16 inputs as TILES_Q8G (no m; 0.875 bytes), read by the AVX2 build
    only (`reads_tiles`)."""

    blocks: torch.Tensor  # [N / 16, K / 32, 296, 320, 360, 384, 448, 544, 608 or 1024] uint8
    shape: tuple[int, int]  # of these blocks' rows (a tail's come after them)
    format: int = TILES_Q4
    tail: LayerTiles | None = None  # the matrix's last rows in their own format (`layer_tiles`' tail)

    def nbytes(self) -> int:
        return self.blocks.numel() + (self.tail.nbytes() if self.tail is not None else 0)

    def formats(self) -> list[int]:
        return [self.format] + (self.tail.formats() if self.tail is not None else [])


def _per_block(t: torch.Tensor, nb: int, g: int, parts: int = 1) -> torch.Tensor:
    """[N, G * parts] fp16 -> [block, group, parts * 32 bytes]: part p's 16 rows, then part p + 1's."""
    return t.view(nb, TILE_N, g, parts).permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(nb, g, -1)


def pack_q4_1(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
              round_scales: bool = False) -> LayerTiles | None:
    """The kernel's TILES_Q4 layout of codes [N, K] in 0..15 with fp32 scale and min [N, K / 32]; None when
    K is not a multiple of 32, N not one of 16, or (unless `round_scales`: Q4_K's products of two scales)
    a scale or min is not exactly an fp16 (the matrix would not hold the same weights)."""
    n, k = codes.shape
    if k % GROUP or n % TILE_N:
        return None
    d16, m16 = scale.to(torch.float16).contiguous(), mn.to(torch.float16).contiguous()
    if not round_scales and not (torch.equal(d16.float(), scale.float()) and torch.equal(m16.float(), mn.float())):
        return None
    nb, g = n // TILE_N, k // GROUP
    return LayerTiles(torch.cat([_nibbles(codes, nb, g), _per_block(d16, nb, g), _per_block(m16, nb, g)], -1)
                      .contiguous(), (n, k))


def _nibbles(codes: torch.Tensor, nb: int, g: int) -> torch.Tensor:
    """The low 4 bits of codes [N, K] as the 4-bit tiles hold them: [block, group, 256 bytes]."""
    # codes[n, 32 g + 2 r + j] -> [block, group, pair p, r % 2, lane 2 n + j], with r = 2 p + r % 2
    c = (codes.to(torch.uint8) & 0x0F).view(nb, TILE_N, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 8, 2, 32)
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(nb, g, 256)


def _fifth_bits(codes: torch.Tensor, nb: int, g: int) -> torch.Tensor:
    """Bit 4 of codes [N, K] as the 5-bit tiles hold them: [block, group, 64 bytes]."""
    # the fifth bits of pair p: bit 32 h + 2 n + j for input 4 p + 2 h + j of row n, 8 bytes little-endian
    top = ((codes.to(torch.uint8) >> 4) & 1).view(nb, TILE_N, g, 8, 2, 2).permute(0, 2, 3, 4, 1, 5)
    weights = (1 << torch.arange(8, dtype=torch.int32))
    return (top.reshape(nb, g, 8, 8, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8).reshape(nb, g, 64)


def pack_q5(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> LayerTiles | None:
    """The kernel's TILES_Q5 layout of codes [N, K] in 0..31 with a scale and min per 32 [N, K / 32] (rounded
    to fp16); None when K is not a multiple of 32 or N not one of 16."""
    n, k = codes.shape
    if k % GROUP or n % TILE_N:
        return None
    nb, g = n // TILE_N, k // GROUP
    low = pack_q4_1(codes.to(torch.uint8) & 0x0F, scale, mn, round_scales=True)
    assert low is not None
    blocks = low.blocks.view(nb, g, BLOCK_BYTES)
    return LayerTiles(torch.cat([blocks[..., :256], _fifth_bits(codes, nb, g), blocks[..., 256:]], -1).contiguous(),
                      (n, k), TILES_Q5)


def pack_q6(codes: torch.Tensor, scale16: torch.Tensor) -> LayerTiles | None:
    """The kernel's TILES_Q6 layout of codes [N, K] in [-32, 31] with a scale per 16 inputs [N, K / 16] (rounded
    to fp16; w = code * scale, no min: Q6_K's); None when K is not a multiple of 32, N not one of 16, or a
    code outside that range."""
    n, k = codes.shape
    if k % GROUP or n % TILE_N or int(codes.min()) < -32 or int(codes.max()) > 31:
        return None
    nb, g = n // TILE_N, k // GROUP
    u = (codes.to(torch.int16) + 32).to(torch.uint8)
    # bits 4-5 of codes[n, 32 g + 2 r + j] -> [block, group, r // 4, lane 2 n + j] at bits 2 (r % 4)
    top = (u >> 4).view(nb, TILE_N, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 4, 4, 32).to(torch.int32)
    crumbs = (top << (2 * torch.arange(4, dtype=torch.int32)).view(4, 1)).sum(3).to(torch.uint8).reshape(nb, g, 128)
    parts = [_nibbles(u, nb, g), crumbs, _per_block(scale16.to(torch.float16).contiguous(), nb, g, 2)]
    return LayerTiles(torch.cat(parts, -1).contiguous(), (n, k), TILES_Q6)


def pack_kq(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor,
            dmin: torch.Tensor) -> LayerTiles | None:
    """The kernel's TILES_Q4K (codes in 0..15) or TILES_Q5K (0..31) layout of a K type's blocks: codes [N, K],
    the 6-bit scale and min of each 32 inputs `sc`, `mn` [N, K / 32], the super-block's fp16 `d`, `dmin`
    [N, K / 256]: w = d sc code - dmin mn, exactly (TILES_Q4 rounds each product to one fp16). None when K is
    not a multiple of 256 or N not one of 16."""
    n, k = codes.shape
    if k % QK_K or n % TILE_N:
        return None
    nb, g = n // TILE_N, k // GROUP
    five = int(codes.max()) > 15

    def rows(t: torch.Tensor, per: int) -> torch.Tensor:  # [N, per] -> [block, per, 16 rows]
        return t.reshape(nb, TILE_N, per).permute(0, 2, 1)

    # each super-block's 16 D (fp16) and 16 M = -dmin, 64 bytes, 8 of them in each of its 8 blocks
    sup = torch.cat([rows(d.to(torch.float16), g // 8).contiguous().view(torch.uint8),
                     rows((-dmin).to(torch.float16), g // 8).contiguous().view(torch.uint8)], -1).reshape(nb, g, 8)
    parts = [_nibbles(codes, nb, g), *([_fifth_bits(codes, nb, g)] if five else []),
             rows(sc.to(torch.uint8), g), rows(mn.to(torch.uint8), g), sup]
    return LayerTiles(torch.cat(parts, -1).contiguous(), (n, k), TILES_Q5K if five else TILES_Q4K)


def pack_f16(weight: torch.Tensor) -> LayerTiles | None:
    """The kernel's TILES_F16 (TILES_BF16) layout of fp16 (bf16) weights [N, K], kept as they are; None when
    K is not a multiple of 32, N not one of 16, or the weights another dtype."""
    n, k = weight.shape
    fmt = {torch.float16: TILES_F16, torch.bfloat16: TILES_BF16}.get(weight.dtype)
    if k % GROUP or n % TILE_N or fmt is None:
        return None
    nb, g = n // TILE_N, k // GROUP
    # weight[16 nb + n, 32 g + 2 r + j] -> [block, group, tile row r, lane 2 n + j]
    w = weight.view(nb, TILE_N, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 512).contiguous()
    return LayerTiles(w.view(torch.uint8), (n, k), fmt)


def pack_q8g(codes: torch.Tensor, scale16: torch.Tensor, mn: torch.Tensor) -> LayerTiles | None:
    """The kernel's TILES_Q8G layout of int8 codes [N, K] with a scale per 16 inputs [N, K / 16] and a min
    per 32 [N, K / 32] (w = code * scale + min), both rounded to fp16; None when K is not a multiple of 32
    or N not one of 16. TILES_Q8G6 where every code lies in [-32, 32]; else TILES_Q8 (the codes and one
    scale per group: 544 bytes a block) where each group's two scales are equal and every min zero (Q8_0's)."""
    n, k = codes.shape
    if k % GROUP or n % TILE_N:
        return None
    nb, g = n // TILE_N, k // GROUP
    # codes[16 nb + n, 32 g + 2 r + j] -> [block, group, tile row r, lane 2 n + j]
    q = codes.to(torch.int8).view(nb, TILE_N, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 512)
    d16 = scale16.to(torch.float16).contiguous()
    m16 = mn.to(torch.float16).contiguous()
    halves = d16.view(n, g, 2)
    if int(codes.abs().max()) > Q8G6_MAX_CODE and torch.equal(halves[..., 0], halves[..., 1]) and not m16.any():
        return LayerTiles(torch.cat([q.view(torch.uint8), _per_block(halves[..., 0].contiguous(), nb, g)], -1)
                          .contiguous(), (n, k), TILES_Q8)
    return LayerTiles(torch.cat([q.view(torch.uint8), _per_block(d16, nb, g, 2), _per_block(m16, nb, g)], -1)
                      .contiguous(), (n, k),
                      TILES_Q8G6 if int(codes.abs().max()) <= Q8G6_MAX_CODE else TILES_Q8G)


@dataclass
class LayerBlocks:
    """One layer's weights as the kernel reads them (fp32 norms, tiled matrices of either format, optional QKV bias)."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: LayerTiles
    o: LayerTiles
    gate_up: LayerTiles
    down: LayerTiles
    qkv_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.attn_norm = self.attn_norm.float().contiguous()
        self.mlp_norm = self.mlp_norm.float().contiguous()
        if self.qkv_bias is not None:
            self.qkv_bias = self.qkv_bias.float().contiguous()

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in (self.qkv, self.o, self.gate_up, self.down))

    def _struct(self) -> _Layer:
        bias = None if self.qkv_bias is None else self.qkv_bias.data_ptr()
        def tiles(m: LayerTiles) -> _Tiles:
            if m.tail is None:
                return _Tiles(m.blocks.data_ptr(), m.format, 0, None, 0)
            assert m.tail.tail is None  # (one tail: the kernel's layer_tiles)
            return _Tiles(m.blocks.data_ptr(), m.format, m.shape[0], m.tail.blocks.data_ptr(), m.tail.format)

        return _Layer(self.attn_norm.data_ptr(), self.mlp_norm.data_ptr(), tiles(self.qkv), tiles(self.o),
                      tiles(self.gate_up), tiles(self.down), bias)


def available() -> bool:
    return build.load() is not None


def tiles_on_huge_pages(t: LayerTiles) -> LayerTiles:
    """t with its blocks (and its tail's) on 2 MiB pages (memory.py)."""
    tail = None if t.tail is None else tiles_on_huge_pages(t.tail)
    return dataclasses.replace(t, blocks=on_huge_pages(t.blocks), tail=tail)


def reads_tiles(fmt: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build's matmuls read layer tiles of `fmt` (TILES_Q6: the AVX2 build only)."""
    return bool(_library(lib, "native CPU step").sluice_reads_tiles(fmt))


def amx_usable(lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build and the OS let steps multiply on AMX tiles."""
    return bool(_library(lib, "native CPU step").sluice_amx_available())


def _library(lib: ctypes.CDLL | None, what: str) -> ctypes.CDLL:
    """`lib`, or this machine's build of forward.c."""
    lib = lib or build.load()
    if lib is None:
        raise RuntimeError(f"the {what} could not be built (see the log)")
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed ({'out of memory' if rc == -1 else 'bad shapes'})")


class ForwardStep:
    """The model's layers, bound once to the native step; `run` per step."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 block_size: int, layers: list[LayerBlocks], cos: torch.Tensor, sin: torch.Tensor,
                 lib: ctypes.CDLL | None = None):
        """`lib`: a build of forward.c (default: this machine's, `build.load()`)."""
        lib = _library(lib, "native CPU forward step")
        self._fn = lib.sluice_forward
        self.isa: str = lib.sluice_forward_isa().decode()  # avx512-vnni, avx512, avx2+avx-vnni, avx2 or scalar
        self.library: str = Path(lib._name).name  # the build (its name hashes its sources and flags)
        self.amx: bool = bool(lib.sluice_amx_available())  # the AMX matmul (bf16 tiles) for steps of many rows
        # the int8 matmul for steps of several rows: "int8" (AVX-512 VNNI), "int8+bf16" (with AVX-512 BF16:
        # the F16/BF16 tiles in bf16 dot products), "int8 4-6 bit" (AVX2 without AVX-512: int8 inputs for
        # the 4-bit, 5-bit, TILES_Q6 and TILES_Q8G6 tiles, int16 ones for the others), "int8 avx-vnni" (AVX2
        # with AVX-VNNI: int8 inputs for the int8-range tiles too; the 16-bit ones int16) or "" (none)
        self.wide: str = lib.sluice_wide_matmul().decode()
        self._dims = _Dims(hidden, heads, kv_heads, head_dim, inter, len(layers), block_size, eps)
        # on 2 MiB pages (memory.py), which also keeps the tensors that the structs point to alive
        layers = [dataclasses.replace(lw, **{m: tiles_on_huge_pages(getattr(lw, m))
                                            for m in ("qkv", "o", "gate_up", "down")}) for lw in layers]
        self._layers = layers
        self._structs = (_Layer * len(layers))(*[lw._struct() for lw in layers])
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        self.hidden = hidden

    def nbytes(self) -> int:
        return sum(lw.nbytes() for lw in self._layers)

    def tile_formats(self) -> dict[str, int]:
        """How many of the layers' matrices each tile format holds ("4-bit", "6-bit", "int8 group", "fp16", ...)."""
        names = {TILES_Q4: "4-bit", TILES_Q5: "5-bit", TILES_Q4K: "4-bit K", TILES_Q5K: "5-bit K",
                 TILES_Q8G: "int8 group", TILES_Q8G6: "int8 group", TILES_Q6: "6-bit",
                 TILES_Q8: "int8 group",
                 TILES_F16: "fp16", TILES_BF16: "bf16"}
        out: dict[str, int] = {}
        for lw in self._layers:
            for m in (lw.qkv, lw.o, lw.gate_up, lw.down):
                for f in m.formats():  # (a matrix with a tail: each part)
                    out[names[f]] = out.get(names[f], 0) + 1
        return out

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
            row_seq: torch.Tensor, kv_cache: torch.Tensor, threads: int, wide_min_rows: int = 0,
            amx_min_rows: int = 0, num_layers: int | None = None) -> torch.Tensor:
        """x [T, hidden] fp32 embeddings -> the residual streams after the last layer (x, updated in
        place). Row t is the token at positions[t] of the sequence whose block table is
        block_tables[row_seq[t]] ([S, n] int32); it attends to that sequence's positions 0..positions[t]
        (its own key included: every row's K/V are written first). kv_cache [layers, 2, slots,
        kv_heads, head_dim] bf16. Steps of at least `amx_min_rows` rows multiply on AMX tiles (`amx`), else of
        at least `wide_min_rows` in int8 dot products (`wide`); 0: never. `num_layers`: only the first
        layers (timing)."""
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == self.hidden
        assert kv_cache.dtype == torch.bfloat16 and kv_cache.is_contiguous()
        t = x.shape[0]
        pos = positions.to(torch.int64).contiguous()
        sl = slots.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        rows = row_seq.to(torch.int32).contiguous()
        assert pos.shape[0] == sl.shape[0] == rows.shape[0] == t
        dims = self._dims
        if num_layers is not None and num_layers < dims.layers:
            dims = _Dims.from_buffer_copy(dims)
            dims.layers = num_layers
        rc = self._fn(ctypes.byref(dims), self._structs, ctypes.c_int(t), ctypes.c_void_p(x.data_ptr()),
                      ctypes.c_void_p(pos.data_ptr()), ctypes.c_void_p(sl.data_ptr()),
                      ctypes.c_void_p(tables.data_ptr()), ctypes.c_int(tables.shape[1]),
                      ctypes.c_void_p(rows.data_ptr()), ctypes.c_void_p(kv_cache.data_ptr()),
                      ctypes.c_int64(kv_cache.stride(0)), ctypes.c_int64(kv_cache.stride(1)),
                      ctypes.c_void_p(self.cos.data_ptr()), ctypes.c_void_p(self.sin.data_ptr()),
                      ctypes.c_int(threads), ctypes.c_int(wide_min_rows), ctypes.c_int(amx_min_rows))
        _check(rc, "native CPU forward step")
        return x


def rms_norm_rows(x: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """rms_norm(x[rows]) * weight ([len(rows), H] fp32; rows None: every row of x), natively: the native
    step's final norm of the rows that sample in one call (torch's takes five ops and an index)."""
    lib = _library(lib, "native CPU kernels")
    assert x.dtype == torch.float32 and x.is_contiguous()
    weight = weight.float().contiguous()  # (itself where it is already)
    idx = None if rows is None else rows.to(torch.int64).contiguous()
    n = x.shape[0] if idx is None else idx.shape[0]
    assert weight.shape == (x.shape[1],)
    out = torch.empty(n, x.shape[1])
    rc = lib.sluice_rms_norm(ctypes.c_void_p(x.data_ptr()), ctypes.c_int(x.shape[0]),
                             ctypes.c_void_p(None if idx is None else idx.data_ptr()), ctypes.c_int(n),
                             ctypes.c_int(x.shape[1]), ctypes.c_void_p(weight.data_ptr()),
                             ctypes.c_float(eps), ctypes.c_void_p(out.data_ptr()))
    _check(rc, "native RMS norm")  # (-2: a row outside x, or a width not a multiple of 16)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, threads: int,
                     lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Paged attention of one-token decodes, natively: q [B, H, D] fp32 (rows may be strided, as slices of
    a fused QKV output are), one layer's bf16 caches [slots, Hkv, D] holding this step's keys and values
    already; block_tables [B, n] int32 (or int64), seq_lens [B]. Returns [B, H, D] fp32."""
    lib = _library(lib, "native CPU kernels")
    b, heads, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    assert q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == torch.bfloat16
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty(b, heads, d)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    rc = lib.sluice_decode_attention(
        ctypes.c_int(b), ctypes.c_int(heads), ctypes.c_int(k_cache.shape[1]), ctypes.c_int(d),
        ctypes.c_void_p(q.data_ptr()), ctypes.c_int64(q.stride(0)), ctypes.c_void_p(out.data_ptr()),
        ctypes.c_void_p(k_cache.data_ptr()), ctypes.c_void_p(v_cache.data_ptr()), ctypes.c_int(block_size),
        ctypes.c_void_p(tables.data_ptr()), ctypes.c_int(tables.shape[1]), ctypes.c_void_p(lens.data_ptr()),
        ctypes.c_int(threads))
    _check(rc, "native decode attention")
    return out


@dataclass(frozen=True)
class Q8Tiles:
    """An int8 weight [V, K] with one scale per row (w = q * scale) as the kernel's output layer reads it
    (forward.c, `tile_weights`): blocks of 16 rows by 32 inputs in tile order, 512 bytes each."""

    blocks: torch.Tensor  # [V / 16, K / 32, 512] int8
    scales: torch.Tensor  # [V] fp32
    shape: tuple[int, int]

    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel() * 4


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> Q8Tiles | None:
    """The kernel's layout of int8 rows q [V, K] with per-row scales [V]; None when V is not a multiple
    of 16 or K of 32."""
    v, k = q.shape
    if v % TILE_N or k % GROUP:
        return None
    nb, g = v // TILE_N, k // GROUP
    # q[16 nb + n, 32 g + 2 r + j] -> [block, group, tile row r, lane 2 n + j]
    blocks = q.view(nb, TILE_N, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 512).contiguous()
    return Q8Tiles(blocks, scales.float().contiguous(), (v, k))


@dataclass(frozen=True)
class GGUFRows:
    """A GGUF matrix [V, K] as the file holds it, for the kernels that decode its rows (gguf_rows.c):
    `data` [V, bytes per row] uint8 (a view of the memory-mapped file: nothing is copied), `type` GGML's
    type number (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K)."""

    data: np.ndarray
    type: int
    shape: tuple[int, int]

    def check(self, lib: ctypes.CDLL) -> None:
        v, k = self.shape
        row = int(lib.sluice_gguf_row_bytes(ctypes.c_int(self.type), ctypes.c_int(k)))
        if row == 0 or k % GROUP:
            raise ValueError(f"GGML type {self.type} with {k} columns: not rows the native kernels decode")
        if self.data.dtype != np.uint8 or self.data.shape != (v, row) or not self.data.flags.c_contiguous:
            raise ValueError(f"GGUF rows: data {self.data.dtype} {self.data.shape}, expected uint8 ({v}, {row})")

    def pointer(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.data.ctypes.data)


def gguf_rows(rows: GGUFRows, ids: torch.Tensor, threads: int = 1, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The rows `ids` ([n] int64, each in [0, V)) of `rows` as fp32 [n, K], decoded from the file's blocks
    exactly as ggml dequantises them."""
    lib = _library(lib, "native CPU kernels")
    rows.check(lib)
    v, k = rows.shape
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k)
    rc = lib.sluice_gguf_rows(rows.pointer(), ctypes.c_int(rows.type), ctypes.c_int(k), ctypes.c_int(v),
                              ctypes.c_void_p(ids.data_ptr()), ctypes.c_int(ids.numel()),
                              ctypes.c_void_p(out.data_ptr()), ctypes.c_int(threads))
    if rc == -3:  # (checked there, in the loop that reads them anyway)
        raise IndexError(f"row ids out of range for {v} rows")
    _check(rc, "GGUF row decoding")
    return out


def gguf_rows_product(x: torch.Tensor, rows: GGUFRows, threads: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [B, K] @ W^T at full precision for W the GGUF matrix `rows`, each of its rows decoded once and
    multiplied with every row of x: for a few rows of x (a step's logprobs); a GEMM does many better.
    Returns [B, V] fp32."""
    lib = _library(lib, "native CPU kernels")
    rows.check(lib)
    v, k = rows.shape
    b = x.shape[0]
    assert x.shape[1] == k
    x = x.float().contiguous()
    out = torch.empty(b, v)
    rc = lib.sluice_gguf_rows_product(ctypes.c_int(b), ctypes.c_int(k), ctypes.c_void_p(x.data_ptr()), rows.pointer(),
                                      ctypes.c_int(rows.type), ctypes.c_int(v), ctypes.c_void_p(out.data_ptr()),
                                      ctypes.c_int(threads))
    _check(rc, "native exact output layer")
    return out


def head_logits(x: torch.Tensor, head: Q8Tiles | LayerTiles, threads: int, exact: torch.Tensor | None = None,
                refine: int = 0, wide_min_rows: int = 0, lib: ctypes.CDLL | None = None,
                amx_min_rows: int = 0,
                exact_rows: GGUFRows | None = None) -> torch.Tensor:
    """x [B, K] fp32 times the output layer `head`, natively: int8 rows (`Q8Tiles`) or a layer's tiles (a
    4-bit copy, for a large vocabulary), in int16 activations' integer dot products, from `wide_min_rows`
    rows on in int8 ones, from `amx_min_rows` on AMX bf16 tiles (0: never). With `exact` ([V, K] fp32), each row's
    `refine` largest outputs are recomputed against it at full precision; `exact_rows` instead: the same
    weights as the file's rows (engine/token_rows.py), decoded as they are needed. Returns [B, V] fp32."""
    lib = _library(lib, "native CPU kernels")
    b, k = x.shape
    assert k == head.shape[1]
    x = x.float().contiguous()
    if exact is not None:
        assert exact.dtype == torch.float32 and exact.is_contiguous() and tuple(exact.shape) == head.shape
    use_rows = exact is None and exact_rows is not None
    if use_rows:
        assert exact_rows is not None and exact_rows.shape == head.shape
        exact_rows.check(lib)
    has_exact = exact is not None or use_rows
    assert not isinstance(head, LayerTiles) or head.tail is None  # (one format: the head takes no tail)
    scales, fmt = (head.scales.data_ptr(), 0) if isinstance(head, Q8Tiles) else (None, head.format)
    out = torch.empty(b, head.shape[0])
    rc = lib.sluice_head_logits(ctypes.c_int(b), ctypes.c_int(k), ctypes.c_void_p(x.data_ptr()),
                                ctypes.c_void_p(head.blocks.data_ptr()), ctypes.c_void_p(scales), ctypes.c_int(fmt),
                                ctypes.c_int(head.shape[0]), ctypes.c_void_p(out.data_ptr()),
                                ctypes.c_void_p(None if exact is None else exact.data_ptr()),
                                exact_rows.pointer() if use_rows and exact_rows is not None else ctypes.c_void_p(None),
                                ctypes.c_int(exact_rows.type if use_rows and exact_rows is not None else 0),
                                ctypes.c_int(refine if has_exact else 0), ctypes.c_int(threads),
                                ctypes.c_int(wide_min_rows), ctypes.c_int(amx_min_rows))
    _check(rc, "native output layer")
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, offsets: torch.Tensor, threads: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """kernels.sampling.sample_tokens natively, row by row (the same semantics and noise): logits [B, V]
    fp32; temperature, top_p [B] fp32; top_k, seeds, offsets [B] int64. Returns the tokens [B] int64."""
    lib = _library(lib, "native CPU kernels")
    b, v = logits.shape
    logits = logits.float().contiguous()
    args = [temperature.float().contiguous(), top_k.to(torch.int64).contiguous(), top_p.float().contiguous(),
            seeds.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous()]
    assert all(a.shape == (b,) for a in args)
    out = torch.empty(b, dtype=torch.int64)
    rc = lib.sluice_sample(ctypes.c_int(b), ctypes.c_int(v), ctypes.c_void_p(logits.data_ptr()),
                           *[ctypes.c_void_p(a.data_ptr()) for a in args], ctypes.c_void_p(out.data_ptr()),
                           ctypes.c_int(threads))
    _check(rc, "native sampling")  # (its only failure: out of memory)
    return out


def sample_masked(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor, temperature: torch.Tensor,
                  seeds: torch.Tensor, offsets: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`sample` of logits[rows] with each row's forbidden tokens at -inf, for greedy or plain-temperature rows
    (no top-k, no top-p): masks int32 [R, ceil(V / 32)] (bit t % 32 of word t // 32 = token t allowed);
    temperature [R] fp32; rows, seeds, offsets [R] int64. The same tokens, without copying and masking the
    rows: only the groups of tokens a mask allows are raced. Returns the tokens [R] int64."""
    lib = _library(lib, "native CPU kernels")
    b, v = logits.shape
    r = rows.shape[0]
    logits = logits.float().contiguous()
    masks = masks.to(torch.int32).contiguous()
    assert masks.shape == (r, (v + 31) // 32) and bool(((rows >= 0) & (rows < b)).all())
    args = [rows.to(torch.int64).contiguous(), masks, temperature.float().contiguous(),
            seeds.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous()]
    assert all(a.shape[0] == r for a in args)
    out = torch.empty(r, dtype=torch.int64)
    rc = lib.sluice_sample_masked(ctypes.c_int(r), ctypes.c_int(v), ctypes.c_void_p(logits.data_ptr()),
                                  *[ctypes.c_void_p(a.data_ptr()) for a in args], ctypes.c_void_p(out.data_ptr()))
    if rc != 0:
        raise ValueError("a grammar mask allows no token")
    return out


PHASES = ("matmuls", "attention", "waits at barriers", "step")


def profile(on: bool, lib: ctypes.CDLL | None = None) -> None:
    """Turns on (or off) the forward step's own timing of its phases, as its first thread sees them."""
    lib = lib or build.load()
    if lib is not None:
        lib.sluice_profile(ctypes.c_int(int(on)))


def profile_read(lib: ctypes.CDLL | None = None) -> dict[str, float]:
    """Seconds spent since the last read in each of PHASES ("step": whole forward steps; the rest of a
    step is norms, rotary, the KV write, activations and quantising inputs), then zeroed."""
    lib = lib or build.load()
    out = (ctypes.c_double * len(PHASES))()
    if lib is not None:
        lib.sluice_profile_read(out)
    return dict(zip(PHASES, out))
