"""The weight formats a step reads, and how the model file's weights become them; the model itself
(engine/model.py) only says which layer multiplies by which weight (gpt-fast keeps its quantize.py
apart from its model.py the same way).

- `Linear`: y = x W^T (+ b), W in its own dtype, with an optional packed copy for small steps:
  `Int4Weight` (the GGUF's own Q4_0/Q4_1 blocks, torch's CPU int4 matmul) or `Int8Weight` (one scale
  per output row, for the output layer).
- The 4-bit blocks of the fused linears (`LAYER_LINEARS`), checked against the weights they stand for.
- `native_layers`: every layer in the native CPU step's tile layouts (kernels/cpu): 4-bit tiles for a
  fused matrix whose parts are all 4-bit (Q4_0, Q4_1, Q4_K), int8 group tiles for one with any other part
  (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0: a Q4_K_M file mixes them within a layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping

import torch
import torch.nn.functional as F

import kernels.cpu as cpu_kernels
from kernels.cpu.memory import empty_on_huge_pages

from . import batch_invariant
from .gguf_blocks import GroupBlocks, HalfWeights
from .loader import ModelArgs
from .token_rows import TokenRows

Q4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [N, K] 0..15, scale, min [N, K/32]
NativeBlocks = Q4Blocks | GroupBlocks | HalfWeights  # what the native step repacks
Q4_GROUP = 32
# The fused linears of a layer and the checkpoint weights each one concatenates along its rows.
LAYER_LINEARS = {
    "qkv": [f"self_attn.{n}_proj.weight" for n in "qkv"],
    "o": ["self_attn.o_proj.weight"],
    "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "down": ["mlp.down_proj.weight"],
}


def int4_available(device: torch.device) -> bool:
    """torch's CPU int4 matmul (group-wise scale and zero point, AVX-512 / AVX2 kernels)."""
    return device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")


def int8_available(device: torch.device) -> bool:
    """torch's CPU int8 weight-only matmul (one scale per output row)."""
    return device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")


class Int4Weight:
    """A GGUF Q4_0/Q4_1 weight as torch's packed int4 (`_weight_int4pack_mm_for_cpu`): the file's own
    4-bit codes, one (scale, zero) pair per 32 inputs, so it reads a quarter of bf16's bytes. The kernel
    computes in bf16: x is rounded to bf16 (as the bf16 path does) and the fp16 scales to bf16."""

    def __init__(self, blocks: Q4Blocks):
        codes, scale, mn = blocks
        self.shape = codes.shape
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        # The kernel's dequantisation is (code - 8) * scale + zero.
        zero = mn + 8 * scale
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, Q4_GROUP, self.scales_zeros)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as int8 with one scale per row: (q [N, K] int8, scale [N] fp32), w ~ q * scale."""
    w = w.float()
    s = w.abs().amax(1).clamp_min(1e-12) / 127
    return (w / s[:, None]).round_().clamp_(-127, 127).to(torch.int8), s


def q4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows as 4-bit codes with a scale and a min per 32 inputs, both fp16 (GGML Q4_1's rounding): (codes
    [N, K] uint8 in 0..15, d [N, K / 32], m [N, K / 32] fp32), w ~ code * d + m."""
    n, k = w.shape
    g = w.float().view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    m = lo.half().float()
    d = ((hi - m) / 15).half().float()
    codes = torch.where(d[..., None] > 0, (g - m[..., None]) / d[..., None].clamp_min(1e-30), 0.0)
    return codes.round_().clamp_(0, 15).to(torch.uint8).view(n, k), d, m


# From this many weights on (V x K: Llama 3.2's 128k x 2048, Qwen 2.5 0.5B's 152k x 896) the output layer's
# candidate pass reads a 4-bit copy: its int8 one is as many bytes as a third of a 1B model's layers, read
# by every decode step for the few candidates that are then recomputed exactly anyway. Below (SmolLM2's
# 49k x 576), int8: its values, which sampling takes for every token but the candidates, are 10x closer.
HEAD_4BIT_MIN_WEIGHTS = 1 << 26


def native_head(weight: torch.Tensor | TokenRows, chunk_rows: int = 1024,
                bits: int | None = None) -> cpu_kernels.Q8Tiles | cpu_kernels.LayerTiles | None:
    """The output layer's copy for the native kernel's candidate pass, in its tiles: int8 (as `Int8Weight`,
    bf16-rounded scales), or with `bits` 4 (None: 4 from HEAD_4BIT_MIN_WEIGHTS weights on) 4-bit codes with
    a scale and min per 32 (`q4_rows`, the layers' TILES_Q4). Quantised and packed a slice of rows at a
    time: at load, no full-size copy beside the tiles. None when the shape is not whole tiles."""
    v, k = weight.shape
    if v % 16 or k % 32:
        return None
    if bits is None:
        bits = 4 if v * k >= HEAD_4BIT_MIN_WEIGHTS else 8
    step = chunk_rows - chunk_rows % 16
    if bits == 4:  # (on 2 MiB pages, as the layers': kernels/cpu/memory.py)
        tiles = empty_on_huge_pages((v // 16, k // 32, cpu_kernels.BLOCK_BYTES), torch.uint8)
    else:
        blocks, scales = empty_on_huge_pages((v // 16, k // 32, 512), torch.int8), torch.empty(v)
    for a in range(0, v, step):
        rows = weight[a:a + step]
        if bits == 4:
            packed = cpu_kernels.pack_q4_1(*q4_rows(rows))
            assert packed is not None
            tiles[a // 16:(a + rows.shape[0]) // 16] = packed.blocks
        else:
            q, s = int8_rows(rows)
            part = cpu_kernels.pack_int8(q, s.to(torch.bfloat16).float())
            assert part is not None
            blocks[a // 16:(a + q.shape[0]) // 16], scales[a:a + q.shape[0]] = part.blocks, part.scales
        if isinstance(weight, TokenRows):
            weight.release(a, a + rows.shape[0])  # the file's pages of these rows: read, not needed resident
    if isinstance(weight, TokenRows):
        weight.release()  # and the pages the slices share
    if bits == 4:
        return cpu_kernels.LayerTiles(tiles, (v, k), cpu_kernels.TILES_Q4)
    return cpu_kernels.Q8Tiles(blocks, scales, (v, k))


class Int8Weight:
    """A weight as int8 with one scale per output row (`_weight_int8pack_mm`): half of bf16's bytes.
    Used for the output layer, whose rows a decode step reads in full while only each row's top
    candidates matter (and those are recomputed at full precision, see `LlamaModel.logits`)."""

    def __init__(self, weight: torch.Tensor | TokenRows, chunk_rows: int = 4096):
        n = weight.shape[0]
        self.q = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(n)
        for a in range(0, n, chunk_rows):  # in slices: no full-size float temporaries at load
            self.q[a:a + chunk_rows], scales[a:a + chunk_rows] = int8_rows(weight[a:a + chunk_rows])
        self.scales = scales.to(torch.bfloat16)

    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 2

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scales)


PackedWeight = Int4Weight | Int8Weight


class Linear:
    """y = x W^T (+ b), with W stored in its own dtype (bf16 halves the bytes a CPU decode step reads);
    the activations stay in the model's dtype, so the residual stream and the norms keep full precision.

    `packed`: the same weight in fewer bytes (the GGUF's own 4-bit blocks, or int8), which a caller
    asks for per call: small steps are bound by the bytes they read, larger ones run faster on the
    CPU's bf16 matmul (AMX / AVX512-BF16) than dequantising (see engine/cpu_plan.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: torch.dtype,
                 invariant: bool = False, packed: PackedWeight | None = None,
                 multiply_dtype: torch.dtype | None = None):
        self.weight = weight.to(weight_dtype).contiguous()
        self.bias = bias
        self.invariant = invariant  # fixed-shape matmuls: a row's result ignores the rest of the batch
        self.multiply_dtype = multiply_dtype  # invariant only: the dtype its chunks multiply in (None: the weight's)
        self.packed = packed

    def __call__(self, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
        if packed and self.packed is not None:
            y = self.packed.mm(x).to(x.dtype)
        elif self.invariant:
            y = batch_invariant.linear(x.to(self.weight.dtype), self.weight, self.multiply_dtype).to(x.dtype)
        else:
            y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def nbytes(self, packed: bool = False) -> int:
        """Bytes of weights one call reads."""
        if packed and self.packed is not None:
            return self.packed.nbytes()
        return self.weight.numel() * self.weight.element_size()


def q4_matches(blocks: Q4Blocks, weight: torch.Tensor) -> bool:
    """The first row of the blocks dequantizes to the weight's first row."""
    codes, scale, mn = (b[:1] for b in blocks)
    row = (codes.float().unflatten(-1, (-1, Q4_GROUP)) * scale[..., None] + mn[..., None]).flatten(-2)
    return torch.allclose(row, weight[:1].float(), rtol=0, atol=1e-6)


def fused_blocks(parts: list[Q4Blocks | None]) -> Q4Blocks | None:
    """The 4-bit blocks of weights fused along their output rows (Q/K/V, gate/up), if all are 4-bit."""
    if any(b is None for b in parts):
        return None
    return tuple(torch.cat([b[j] for b in parts if b is not None]) for j in range(3))


def native_fits(args: ModelArgs, blocks: Mapping[str, object], *more: Mapping[str, object]) -> bool:
    """Every linear weight of every layer has blocks the native step reads (in any of the mappings), and
    the shapes are ones it takes (checked before anything is built, so a model it cannot run gets the torch
    path whole)."""
    q_n, kv_n = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    shapes_ok = (args.hidden_size % 32 == 0 and args.intermediate_size % 32 == 0 and q_n % 32 == 0
                 and (q_n + 2 * kv_n) % 16 == 0 and args.head_dim % 16 == 0 and args.head_dim <= 256
                 and args.num_heads % args.num_kv_heads == 0 and args.num_heads <= 256)
    maps = (blocks, *more)
    return shapes_ok and all(any(f"model.layers.{i}.{n}" in m for m in maps) for i in range(args.num_layers)
                             for names in LAYER_LINEARS.values() for n in names)


def _as_groups(b: Q4Blocks | GroupBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantised blocks as (int8 codes, scale per 16, min per 32)."""
    if isinstance(b, GroupBlocks):
        return b.codes, b.scale, b.mn
    codes, scale, mn = b
    return codes.to(torch.int8), scale.repeat_interleave(2, dim=-1), mn


def _five_bit(b: Q4Blocks | GroupBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Quantised blocks as (codes 0..31, scale per 32, min per 32) where they are 5-bit ones (Q5_0 with
    its codes moved up by 16 and its min down by 16 scales, Q5_1, Q5_K, and the 4-bit types), else None."""
    if not isinstance(b, GroupBlocks):
        codes, scale, mn = b
        return codes.to(torch.uint8), scale, mn
    scale = b.scale[:, ::2]
    if not torch.equal(scale, b.scale[:, 1::2]):  # a scale per 16 (Q6_K)
        return None
    lo, hi = int(b.codes.min()), int(b.codes.max())
    if lo >= 0 and hi <= 31:
        return b.codes.to(torch.uint8), scale, b.mn
    if lo >= -16 and hi <= 15:  # Q5_0: w = (q - 16) d
        return (b.codes + 16).to(torch.uint8), scale, b.mn - 16 * scale
    return None


def pack_native(parts: list[NativeBlocks | None], k_scales: bool = True,
                six_bit: bool = False) -> cpu_kernels.LayerTiles | None:
    """`_pack_fused`, with the last part in tiles of its own (a tail) where that holds the matrix in fewer bytes:
    a Q4_K_M file's Q6_K attn_v would otherwise put its Q4_K q and k in int8 group tiles too (1.19 bytes a
    weight for 0.58-0.625; Llama-3.2-1B shape: 24 MiB)."""
    whole = _pack_fused(parts, k_scales, six_bit)
    if whole is None or len(parts) < 2 or whole.format in (cpu_kernels.TILES_Q4, cpu_kernels.TILES_Q4K,
                                                             cpu_kernels.TILES_F16, cpu_kernels.TILES_BF16):
        return whole
    head, tail = _pack_fused(parts[:-1], k_scales, six_bit), _pack_fused(parts[-1:], k_scales, six_bit)
    if head is None or tail is None or head.nbytes() + tail.nbytes() >= whole.nbytes():
        return whole
    return dataclasses.replace(head, tail=tail)


def _pack_fused(parts: list[NativeBlocks | None], k_scales: bool = True,
                six_bit: bool = False) -> cpu_kernels.LayerTiles | None:
    """A fused matrix's parts (rows stacked) in the native step's tiles: the file's Q4_0/Q4_1 blocks as
    they are; Q4_K and Q5_K alone with their own scales (4-bit or 5-bit K tiles, unless not `k_scales`:
    see `k_tiles_pay`); 4-bit ones with a K type
    among them (Q4_K: a scale that is a product, rounded to fp16) in 4-bit tiles too; 5-bit ones (Q5_0,
    Q5_1, Q5_K, beside 4-bit ones) in 5-bit tiles; codes in [-32, 31] with no min (Q6_K, and Q5_0 beside
    it) in 6-bit tiles where `six_bit` (see `six_bit_tiles_pay`); with any other type, int8 group tiles for all; F16
    (BF16) ones in fp16 (bf16) tiles. None when a part is missing, or 16-bit parts are mixed with quantised
    ones or with the other 16-bit type."""
    if any(p is None for p in parts):
        return None
    if any(isinstance(p, HalfWeights) for p in parts):  # 16-bit weights stay 16-bit: all of them or none
        halves = [p for p in parts if isinstance(p, HalfWeights)]
        if len(halves) != len(parts) or len({p.weight.dtype for p in halves}) != 1:
            return None
        return cpu_kernels.pack_f16(torch.cat([p.weight for p in halves]))
    if all(isinstance(p, tuple) for p in parts):
        return cpu_kernels.pack_q4_1(*(torch.cat([p[j] for p in parts]) for j in range(3)))  # type: ignore[index]
    ks = [p.k for p in parts if isinstance(p, GroupBlocks) and p.k is not None]
    if k_scales and len(ks) == len(parts):  # Q4_K and Q5_K alone: their own scales, exact
        tiles = cpu_kernels.pack_kq(torch.cat([p.codes for p in parts]),  # type: ignore[union-attr]
                                    *(torch.cat([getattr(k, f) for k in ks]) for f in ("sc", "mn", "d", "dmin")))
        if tiles is not None:
            return tiles
    if all(isinstance(p, tuple) or p.four_bit for p in parts):  # type: ignore[union-attr]
        four = [p if isinstance(p, tuple) else (p.codes.to(torch.uint8), p.scale[:, ::2], p.mn)  # type: ignore[union-attr]
                for p in parts]
        codes, scale, mn = (torch.cat([p[j] for p in four]) for j in range(3))
        return cpu_kernels.pack_q4_1(codes, scale, mn, round_scales=True)
    quantised = [p for p in parts if p is not None and not isinstance(p, HalfWeights)]
    five = [_five_bit(p) for p in quantised]
    if all(f is not None for f in five):
        return cpu_kernels.pack_q5(*(torch.cat([f[j] for f in five]) for j in range(3)))  # type: ignore[index]
    groups = [_as_groups(p) for p in quantised]
    codes, scale, mn = (torch.cat([g[j] for g in groups]) for j in range(3))
    if six_bit and not mn.any() and (tiles := cpu_kernels.pack_q6(codes, scale)) is not None:
        return tiles
    return cpu_kernels.pack_q8g(codes, scale, mn)


def six_bit_tiles_pay() -> bool:
    """Whether Q6_K's codes take the 6-bit tiles (0.875 bytes a weight) rather than int8 group ones (1.19):
    where the build reads them, the AVX2 one. Its int8 matmul decodes them in registers for a decode step's
    few rows, where that step's time is its bytes. The AVX-512 builds keep the int8 tiles (their int8 and
    AMX matmuls read those without a decode)."""
    return cpu_kernels.reads_tiles(cpu_kernels.TILES_Q6)


def k_tiles_pay() -> bool:
    """Whether Q4_K/Q5_K matrices take the K tiles (their own 6-bit scales, 0.58 / 0.70 bytes a weight, exact)
    rather than fp16 d and m per group (0.625 / 0.75): everywhere but on a CPU with AMX. The AMX matmul widens
    every block to bf16 just before it multiplies it, and the K tiles' d = D sc (a multiply per block, D read
    once per 8) lengthen that: Llama-3.2-1B-shape Q4_K_M linear layers at 16 / 32 rows 51-55 -> 57-59 / 60 ->
    68 ms (Xeon, AMX), against the AVX2 build's gain on the same machine (batch 1 35.8-36.1 -> 33.0-34.6 ms,
    16 rows 150-154 -> 144-149) and 35 MiB less."""
    return not cpu_kernels.amx_usable()


def native_layers(args: ModelArgs, weights: MutableMapping[str, torch.Tensor],
                  blocks: Callable[[str], NativeBlocks | None], drop_layer: Callable[[int], None],
                  k_scales: bool = True, six_bit: bool = False) -> list[cpu_kernels.LayerBlocks] | None:
    """Every layer in the native step's layouts (each layer's entries dropped once it is packed), or None
    when the first layer's blocks do not match its weights (nothing dropped then: the torch path builds
    the model). `blocks(name)`: a weight's blocks (4-bit or group) if they match it."""
    layers: list[cpu_kernels.LayerBlocks] = []
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        packed = {name: pack_native([blocks(p + n) for n in names], k_scales, six_bit)
                  for name, names in LAYER_LINEARS.items()}
        # on 2 MiB pages as each layer is packed (one layer's copy at a time, not all of them at once)
        packed = {name: None if t is None else cpu_kernels.tiles_on_huge_pages(t) for name, t in packed.items()}
        if any(b is None for b in packed.values()):
            if i:
                raise RuntimeError(f"layer {i}'s blocks do not match its weights (the layers before it "
                                   "matched); the model file is inconsistent")
            return None
        bias = (torch.cat([weights[p + f"self_attn.{n}_proj.bias"].float() for n in "qkv"])
                if args.attention_bias else None)
        layers.append(cpu_kernels.LayerBlocks(
            attn_norm=weights[p + "input_layernorm.weight"],
            mlp_norm=weights[p + "post_attention_layernorm.weight"], qkv_bias=bias, **packed))  # type: ignore[arg-type]
        drop_layer(i)
    return layers
