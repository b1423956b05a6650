"""The native CPU forward step (kernels/cpu) against a float64 Llama layer stack written out here.

Random Q4_1 weights, a paged bf16 KV cache holding earlier context in shuffled blocks, steps that mix
one-token decodes with prefill chunks (rows in shuffled order), odd group counts, a QKV bias, row
counts around the 8 rows of one int16 weight pass and the 16-row AMX tiles, one and two threads,
and every build of forward.c that this CPU can run (native, AVX2, plain C), with and without AMX.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import kernels.cpu as cpu_kernels
from kernels.cpu import (
    TILES_BF16,
    TILES_F16,
    TILES_Q4,
    TILES_Q4K,
    TILES_Q5,
    TILES_Q5K,
    TILES_Q6,
    TILES_Q8,
    TILES_Q8G,
    TILES_Q8G6,
    ForwardStep,
    LayerBlocks,
    pack_f16,
    pack_kq,
    pack_q4_1,
    pack_q5,
    pack_q6,
    pack_q8g,
)
from kernels.cpu import build as cpu_build
from kernels.cpu.cpuinfo import cpu_info

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="no C compiler to build kernels/cpu/forward.c")


FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-kquants.gguf"
# "no-bf16": the native build without AVX-512 BF16 (where the CPU has it: the int8 wide matmul's 16-bit tiles
# then take fp32 FMAs, as on a CPU with VNNI and no BF16)
BUILDS = {"native": ("-march=native",), "no-bf16": ("-march=native", "-mno-avx512bf16"),
          "avx2": ("-march=x86-64-v3",), "plain": ("-march=x86-64",)}


def _library(build: str):
    if build == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_info().flags:
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    if build == "no-bf16" and "avx512_bf16" not in cpu_info().flags:
        pytest.skip("this CPU has no AVX-512 BF16: the native build is this one")
    lib = cpu_build.compile_library(BUILDS[build])
    assert lib is not None
    return lib


def _q4(n: int, k: int, gen: torch.Generator, levels: int = 16):
    """Codes, and fp16-exact scales and mins, of a random Q4_1 matrix (levels=32: Q5_1's); and its
    dequantised float64 value."""
    codes = torch.randint(0, levels, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.005).half().float()
    mn = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    dense = (codes.double().view(n, k // 32, 32) * scale.double()[..., None] + mn.double()[..., None]).view(n, k)
    return (codes, scale, mn), dense


def _q8g(n: int, k: int, gen: torch.Generator, max_code: int = 127):
    """Int8 codes over the full range (Q8_0's; Q5/Q6 codes are a part of it) or [-max_code, max_code], a
    scale per 16 inputs and a min per 32 (fp16-exact, signed: Q6_K's sub-block scales are); and the
    dequantised float64 value."""
    codes = torch.randint(-max_code, max_code + 1, (n, k), generator=gen, dtype=torch.int8)
    scale = ((torch.rand(n, k // 16, generator=gen) - 0.3) * 0.001).half().float()
    mn = (-torch.rand(n, k // 32, generator=gen) * 0.05).half().float()
    dense = (codes.double().view(n, k // 16, 16) * scale.double()[..., None]).view(n, k // 32, 32)
    dense = (dense + mn.double()[..., None]).view(n, k)
    return (codes, scale, mn), dense


def _q8_0(n: int, k: int, gen: torch.Generator):
    """_q8g as Q8_0 is: one scale per 32 inputs (both halves' equal), no min: TILES_Q8."""
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = ((torch.rand(n, k // 32, generator=gen) - 0.3) * 0.001).half().float()
    dense = (codes.double().view(n, k // 32, 32) * scale.double()[..., None]).view(n, k)
    return (codes, scale.repeat_interleave(2, 1), torch.zeros(n, k // 32)), dense


def _q5(n: int, k: int, gen: torch.Generator):
    """_q4 with 5-bit codes (0..31): TILES_Q5."""
    return _q4(n, k, gen, levels=32)


def _kq(n: int, k: int, gen: torch.Generator, levels: int = 16):
    """A K type's blocks (Q4_K: 16 levels, Q5_K: 32): codes, a 6-bit scale and min per 32 inputs, fp16 d and
    dmin per 256 (w = d sc q - dmin mn), as `pack_kq` takes them; and the dequantised float64 value."""
    codes = torch.randint(0, levels, (n, k), generator=gen, dtype=torch.uint8)
    sc = torch.randint(0, 64, (n, k // 32), generator=gen, dtype=torch.uint8)
    mn = torch.randint(0, 64, (n, k // 32), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 256, generator=gen) * 4e-4 + 1e-4).half()
    dmin = (torch.rand(n, k // 256, generator=gen) * 2e-3).half()
    scale, mins = _k_factors(sc, mn, d, dmin)
    dense = (codes.double().view(n, k // 32, 32) * scale[..., None] + mins[..., None]).view(n, k)
    return (codes, sc, mn, d, dmin), dense


def _k_factors(sc, mn, d, dmin) -> tuple[torch.Tensor, torch.Tensor]:
    """A K type's scale and min per 32 inputs (float64, exact) from its factors."""
    return (d.double().repeat_interleave(8, 1) * sc.double(), -(dmin.double().repeat_interleave(8, 1) * mn.double()))


def _q8g6(n: int, k: int, gen: torch.Generator):
    """_q8g with codes in [-32, 32] (the Q5 and Q6 types' range): TILES_Q8G6."""
    return _q8g(n, k, gen, max_code=32)


def _q6(n: int, k: int, gen: torch.Generator):
    """Q6_K's codes ([-32, 31]) with a signed scale per 16 inputs and no min: TILES_Q6 (pack_q6 takes the
    codes and scales; the zero mins are for the reference)."""
    codes = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    scale = ((torch.rand(n, k // 16, generator=gen) - 0.3) * 0.002).half().float()
    dense = (codes.double().view(n, k // 16, 16) * scale.double()[..., None]).view(n, k)
    return (codes, scale, torch.zeros(n, k // 32)), dense


def _f16(n: int, k: int, gen: torch.Generator):
    """fp16 weights (an F16 file's); and their float64 value."""
    w = (torch.randn(n, k, generator=gen) * 0.05).half()
    return (w,), w.double()


def _bf16w(n: int, k: int, gen: torch.Generator):
    """bf16 weights (a BF16 file's, tiny ones among them that fp16 could not hold); and their float64 value."""
    w = (torch.randn(n, k, generator=gen) * 0.05)
    w[::3, ::5] *= 1e-4  # down to ~1e-7: fp16 subnormals would round these
    w = w.to(torch.bfloat16)
    return (w,), w.double()


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _int16_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row rounded to int16 steps of its own scale (max |x| / 32767), as the int16 matmul takes its inputs."""
    d = t.abs().amax(-1, keepdim=True) / 32767
    return torch.round(t / torch.where(d > 0, d, 1)) * d


def _int8_groups(t: torch.Tensor) -> torch.Tensor:
    """Each 32 inputs of a row (a weight group) rounded to int8 steps of their own scale (max |x| / 127),
    as the int8 matmul takes its inputs."""
    g = t.view(*t.shape[:-1], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(d > 0, d, 1)) * d).view(t.shape)


class TinyModel:
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, layers: int,
                 bias: bool, seed: int = 0, q8g: tuple[str, ...] = (), f16: tuple[str, ...] = (),
                 bf16: tuple[str, ...] = (), q8g6: tuple[str, ...] = (), q5: tuple[str, ...] = (),
                 q8: tuple[str, ...] = (), q4k: tuple[str, ...] = (), q5k: tuple[str, ...] = (),
                 q6: tuple[str, ...] = ()):
        """`q8g`, `f16`, `bf16`, `q8g6`, `q5`, `q8`, `q4k`, `q5k`: the matrices (qkv, o, gate_up, down) held as
        Q8G (codes over the int8 range), F16, BF16, Q8G6 (Q8G with codes in [-32, 32]), Q5, Q8 (Q8_0's), or
        Q4K / Q5K (Q4_K's / Q5_K's own scales) tiles, `q6` as Q6 (Q6_K's codes in 6 bits; the AVX2 build's),
        the others as Q4."""
        gen = torch.Generator().manual_seed(seed)
        self.dims = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter, eps=1e-5)
        qkv_n = (heads + 2 * kv_heads) * head_dim
        self.layers = []
        self.blocks = []
        self.sixteen_bit = set(f16) | set(bf16)  # matrices whose matmuls take the fp32 inputs on every path
        self.q8g = [set(q8g) | set(q8) for _ in range(layers)]  # each layer's full-range int8-group matrices
        self.mins = []  # each layer's {matrix: the part of its weights that is the groups' mins (m), float64}
        self.args = []  # each layer's {matrix: what its pack function took}
        for _ in range(layers):
            mats = {name: (_q8g if name in q8g else _q8g6 if name in q8g6 else _q8_0 if name in q8 else
                           _q6 if name in q6 else
                           _kq if name in q4k else functools.partial(_kq, levels=32) if name in q5k else
                           _f16 if name in f16 else
                           _bf16w if name in bf16 else _q5 if name in q5 else _q4)(n, k, gen)
                    for name, (n, k) in {
                "qkv": (qkv_n, hidden), "o": (hidden, heads * head_dim), "gate_up": (2 * inter, hidden),
                "down": (hidden, inter)}.items()}
            norms = (1 + 0.1 * torch.randn(hidden, generator=gen), 1 + 0.1 * torch.randn(hidden, generator=gen))
            b = 0.05 * torch.randn(qkv_n, generator=gen) if bias else None
            self.layers.append(({k: v[1] for k, v in mats.items()}, norms, b))
            # (4-bit and 5-bit codes: the kernel's int8 matmul centres them on 8 or 16, which moves that
            # many scales of each group into the part taken with the exact inputs)
            centre = {k: 16 if k in q5 + q5k else 0 if k in q8g + q8g6 + q8 + q6 else 8 for k in mats}
            scale_mn = {k: _k_factors(*v[0][1:]) if k in q4k + q5k else (v[0][1].double(), v[0][2].double())
                        for k, v in mats.items() if k not in self.sixteen_bit}
            self.mins.append({k: (mn + centre[k] * scale if centre[k] else mn).repeat_interleave(32, 1)
                              for k, (scale, mn) in scale_mn.items()})
            self.args.append({k: v[0] for k, v in mats.items()})
            packed = {k: (pack_q8g if k in q8g + q8g6 + q8 else pack_q5 if k in q5 else pack_f16 if k in f16 + bf16
                          else pack_kq if k in q4k + q5k else (lambda c, s, _: pack_q6(c, s)) if k in q6
                          else pack_q4_1)(*v[0]) for k, v in mats.items()}
            self.blocks.append(LayerBlocks(attn_norm=norms[0], mlp_norm=norms[1], qkv_bias=b, **packed))  # type: ignore[arg-type]
        pos = torch.arange(1024, dtype=torch.float64)
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(pos, inv)
        self.cos, self.sin = freqs.cos().float(), freqs.sin().float()

    def reference(self, x, positions, slots, tables, row_seq, kv, block_size, matmuls="exact"):
        """float64 forward of a flat batch of tokens: row b is position positions[b] of the sequence with
        block table tables[row_seq[b]]; every row's K/V are written into `kv` (bf16, like the kernel)
        before any row attends to its sequence's positions 0..positions[b]. `matmuls`: "exact", "bf16" (each
        matmul's input and weights rounded to bf16 first: what the AMX path and torch's bf16 path compute)
        or "int8" (the int8 matmul's: the inputs of the 4-bit and int8-group matrices' q * d parts rounded to
        int8 in 32s, their m parts (with c d: their codes centred on c, 8 or 16, for the 4-bit and 5-bit
        ones) multiplied by the exact inputs; the 16-bit matrices exact), "int8+bf16"
        (the same, the 16-bit matrices' inputs and weights rounded to bf16) or "int8 4-6 bit" (AVX2's: only
        the 4-bit matrices' inputs and those of the int8-group ones with codes in [-32, 32] in int8, the
        other int8-group ones' in int16; "int8 avx-vnni", AVX2 with AVX-VNNI, as "int8")."""
        d = self.dims
        D, nh, nkv, eps = d["head_dim"], d["heads"], d["kv_heads"], d["eps"]
        x = x.double().clone()
        q_n, kv_n = nh * D, nkv * D

        def norm(v, w):
            return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.double()

        def rope(v, p):  # v [heads, D]
            c, s = self.cos[p].double(), self.sin[p].double()
            v1, v2 = v[:, :D // 2], v[:, D // 2:]
            return torch.cat([v1 * c - v2 * s, v2 * c + v1 * s], -1)

        def mm(v, w, name):
            weight = w[name]
            if matmuls == "bf16":
                return _bf16(v) @ _bf16(weight).T
            if matmuls.startswith("int8") and name not in self.sixteen_bit:  # q * d with int8 inputs, m exact
                mins = self.mins[li][name]
                # (AVX2's int8 4-6 bit: the full-range int8-group matrices' inputs in int16, modelled here
                # too, or the int8 roundings of the matmuls after them would fall at other points than the
                # kernel's)
                rounded = _int16_rows(v) if matmuls == "int8 4-6 bit" and name in self.q8g[li] else _int8_groups(v)
                return rounded @ (weight - mins).T + v @ mins.T
            if matmuls == "int8+bf16":  # the 16-bit tiles in bf16 dot products
                return _bf16(v) @ _bf16(weight).T
            return v @ weight.T

        for li, (w, (n1, n2), bias) in enumerate(self.layers):
            qkv = mm(norm(x, n1), w, "qkv")
            if bias is not None:
                qkv = qkv + bias.double()
            att = torch.empty(x.shape[0], q_n, dtype=torch.float64)
            for b in range(x.shape[0]):
                p = int(positions[b])
                q = rope(qkv[b, :q_n].view(nh, D), p)
                k = rope(qkv[b, q_n:q_n + kv_n].view(nkv, D), p)
                kv[li, 0, slots[b]] = k.to(torch.bfloat16)
                kv[li, 1, slots[b]] = qkv[b, q_n + kv_n:].view(nkv, D).to(torch.bfloat16)
            for b in range(x.shape[0]):
                n, table = int(positions[b]) + 1, tables[int(row_seq[b])]
                ctx = torch.tensor([int(table[t // block_size]) * block_size + t % block_size for t in range(n)])
                keys, vals = kv[li, 0, ctx].double(), kv[li, 1, ctx].double()  # [n, nkv, D]
                q = rope(qkv[b, :q_n].view(nh, D), int(positions[b]))
                for h in range(nh):
                    g = h // (nh // nkv)
                    s = keys[:, g] @ q[h] / math.sqrt(D)
                    att[b, h * D:(h + 1) * D] = torch.softmax(s, 0) @ vals[:, g]
            x = x + mm(att, w, "o")
            gu = mm(norm(x, n2), w, "gate_up")
            g, u = gu.chunk(2, -1)
            x = x + mm(torch.nn.functional.silu(g) * u, w, "down")
        return x


CONFIGS = {
    # hidden 96 / q 96 / inter 160: odd group counts (3, 3, 5); GQA 3:1; a QKV bias
    "odd-groups": dict(hidden=96, heads=3, kv_heads=1, head_dim=32, inter=160, layers=2, bias=True),
    # even group counts, four query heads per KV head, no bias
    "even-groups": dict(hidden=128, heads=4, kv_heads=1, head_dim=32, inter=256, layers=2, bias=False),
}


def _step(rows: int, gen: torch.Generator, block_size: int, blocks_per_seq: int):
    """A step of `rows` tokens: one-token decodes and prefill chunks (1-12 tokens, starting anywhere in
    their sequence), in shuffled row order. Returns positions, slots, tables [S, n], row_seq."""
    chunks = []
    left = rows
    while left:
        n = min(left, int(torch.randint(1, 13, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.5 else 1)
        chunks.append(n)
        left -= n
    seqs = len(chunks)
    num_blocks = seqs * blocks_per_seq + 3
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * blocks_per_seq].view(seqs, blocks_per_seq).int()
    positions, row_seq = [], []
    for s, n in enumerate(chunks):
        start = int(torch.randint(0, blocks_per_seq * block_size - n + 1, (1,), generator=gen))
        positions += range(start, start + n)
        row_seq += [s] * n
    order = torch.randperm(rows, generator=gen)
    positions, row_seq = torch.tensor(positions)[order], torch.tensor(row_seq, dtype=torch.int32)[order]
    slots = torch.stack([tables[int(s), int(p) // block_size].long() * block_size + int(p) % block_size
                         for s, p in zip(row_seq, positions)])
    return positions, slots, tables, row_seq, num_blocks


def _matmul_modes(lib) -> list[tuple[tuple[int, int], str]]:
    """((wide_min_rows, amx_min_rows), the reference's matmuls) to run: (0, 0) (the int16 matmul, against
    exact products); (1, 0) (every step on the build's int8 matmul: int8 dot products, with bf16 ones on the
    16-bit tiles where the build has them: "int8+bf16", or on the 4-bit tiles and the int8 ones with small
    codes only: AVX2's "int8 4-6 bit") where it has one; and (0, 1) (every step on AMX's bf16 tiles) where
    the build and the CPU have AMX."""
    lib.sluice_wide_matmul.restype = ctypes.c_char_p
    wide = lib.sluice_wide_matmul().decode()
    return ([((0, 0), "exact")] + ([((1, 0), wide)] if wide else []) +
            ([((0, 1), "bf16")] if lib.sluice_amx_available() else []))


def _assert_step_close(got: torch.Tensor, want: torch.Tensor, matmuls: str, where: tuple,
                       int8_max: float = 1e-2) -> None:
    """Every row within 2e-3 of the largest output. The int8 matmul against its own rounding: the median row
    within 1e-4, and every row within 1e-2 (an input the kernel's fp32 puts on the other side of a rounding
    boundary than float64 does moves by a whole int8 step, and the layers after carry it on; a wrong scale
    or min moves every row by ~1e-2). A step of one or two rows has no other rows for a median: each row
    within 1e-3 there (one such input moved a row by 5e-4). `int8_max`: every row's bound with int8 inputs,
    for a model whose reference moves more than these random ones for a small move of its inputs."""
    scale = want.abs().max().item()
    rows = (got.double() - want).abs().amax(-1) / scale
    if matmuls.startswith("int8"):
        typical = 1e-4 if len(rows) >= 3 else 1e-3
        assert rows.median().item() < typical and rows.max().item() < int8_max, (*where, rows.tolist())
    else:
        assert rows.max().item() < 2e-3, (*where, rows.max().item())


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 17, 40])
def test_forward_step_matches_a_float64_reference(build, config, rows):
    lib = _library(build)
    model = TinyModel(**CONFIGS[config])
    d = model.dims
    block_size, blocks_per_seq = 4, 8
    gen = torch.Generator().manual_seed(rows)
    step = ForwardStep(**d, block_size=block_size, layers=model.blocks, cos=model.cos, sin=model.sin, lib=lib)
    positions, slots, tables, row_seq, num_blocks = _step(rows, gen, block_size, blocks_per_seq)
    kv = (torch.randn(len(model.layers), 2, num_blocks * block_size, d["kv_heads"], d["head_dim"], generator=gen)
          .to(torch.bfloat16))  # earlier context already in the cache
    x = torch.randn(rows, d["hidden"], generator=gen)
    for (wide, amx), matmuls in _matmul_modes(lib):
        # int16 activations keep ~15 bits: against exact matmuls; the AMX path multiplies bf16 activations
        # by bf16 weights: against a reference that rounds both the same way
        kv_ref = kv.clone()
        want = model.reference(x, positions, slots, tables, row_seq, kv_ref, block_size, matmuls)
        for threads in (1, 2):
            kv_ours = kv.clone()
            got = step.run(x.clone(), positions, slots, tables, row_seq, kv_ours, threads, wide_min_rows=wide,
                           amx_min_rows=amx)
            _assert_step_close(got, want, matmuls, (step.isa, wide, amx, threads))
            # The new K/V landed in their slots (bf16; a last-bit difference from rounding allowed) ...
            torch.testing.assert_close(kv_ours.float(), kv_ref.float(), rtol=1e-2, atol=1e-2)
            # ... and nothing else in the cache changed.
            others = torch.ones(kv.shape[2], dtype=torch.bool)
            others[slots] = False
            assert torch.equal(kv_ours[:, :, others], kv[:, :, others])


def assert_step_matches_reference(model: TinyModel, lib, rows: int, seed: int, wide: bool = True,
                                  int8_max: float = 1e-2) -> None:
    """One step of `rows` mixed decode/prefill rows through `lib`'s native step (int16, and with `wide` its
    wide matmul where the build has one) against the model's float64 reference (with the wide matmul's
    roundings), as _assert_step_close holds them."""
    d = model.dims
    gen = torch.Generator().manual_seed(seed)
    step = ForwardStep(**d, block_size=4, layers=model.blocks, cos=model.cos, sin=model.sin, lib=lib)
    positions, slots, tables, row_seq, num_blocks = _step(rows, gen, 4, 8)
    kv = torch.randn(len(model.layers), 2, num_blocks * 4, d["kv_heads"], d["head_dim"], generator=gen).to(
        torch.bfloat16)
    x = torch.randn(rows, d["hidden"], generator=gen)
    for (int8, amx), matmuls in _matmul_modes(lib)[:None if wide else 1]:
        want = model.reference(x, positions, slots, tables, row_seq, kv.clone(), 4, matmuls)
        got = step.run(x.clone(), positions, slots, tables, row_seq, kv.clone(), 2, wide_min_rows=int8,
                       amx_min_rows=amx)
        _assert_step_close(got, want, matmuls, (step.isa, int8, amx), int8_max)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("q8g", [("qkv", "down"), ("o", "gate_up"), ("qkv", "o", "gate_up", "down")])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_int8_group_tiles_and_mixed_formats_match_the_float64_reference(build, q8g, rows):
    """Q8G tiles (the Q5/Q6/Q8 types' layout: a scale per 16 inputs) alone and mixed with Q4 tiles in a
    layer, as a Q4_K_M file mixes block types, on every build's int16 matmul and on AMX."""
    lib = _library(build)
    model = TinyModel(**CONFIGS["odd-groups"], q8g=q8g)
    layer = model.blocks[0]
    assert [m for m in ("qkv", "o", "gate_up", "down") if getattr(layer, m).format == TILES_Q8G] == list(q8g)
    assert_step_matches_reference(model, lib, rows, seed=100 + rows)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("q8g6, q8g", [(("qkv", "o", "gate_up", "down"), ()), (("o", "down"), ("qkv",))])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_small_code_int8_tiles_match_the_float64_reference(build, q8g6, q8g, rows):
    """Q8G tiles whose codes lie in [-32, 32] (a Q5 or Q6 type's: TILES_Q8G6, which AVX2's int8 matmul
    reads with its codes offset to unsigned bytes), alone and beside full-range Q8G and Q4 tiles."""
    lib = _library(build)
    model = TinyModel(**CONFIGS["odd-groups"], q8g=q8g, q8g6=q8g6)
    layer = model.blocks[0]
    assert {m: getattr(layer, m).format for m in q8g6 + q8g} == {**dict.fromkeys(q8g6, TILES_Q8G6),
                                                                 **dict.fromkeys(q8g, TILES_Q8G)}
    assert_step_matches_reference(model, lib, rows, seed=200 + rows)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("q8, q8g", [(("qkv", "o", "gate_up", "down"), ()), (("qkv", "down"), ("o",))])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_q8_0_tiles_match_the_float64_reference(build, q8, q8g, rows):
    """Q8 tiles (Q8_0's: one scale per group and no min, which the VNNI int8 matmul takes in one integer
    sum per group), alone and beside Q8G tiles of the same codes' range and Q4 ones."""
    lib = _library(build)
    model = TinyModel(**CONFIGS["odd-groups"], q8g=q8g, q8=q8)
    assert {m: getattr(model.blocks[0], m).format for m in q8 + q8g} == {**dict.fromkeys(q8, TILES_Q8),
                                                                        **dict.fromkeys(q8g, TILES_Q8G)}
    assert_step_matches_reference(model, lib, rows, seed=400 + rows)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("q4k, q5k", [(("qkv", "o", "gate_up", "down"), ()), (("o", "down"), ("qkv", "gate_up"))])
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 40])
def test_k_scale_tiles_match_the_float64_reference(build, q4k, q5k, rows):
    """Q4K and Q5K tiles (a K type's own 6-bit scales and mins and its super-blocks' fp16 d and dmin, shared
    by 8 blocks), alone and beside Q4 tiles, on every build's int16 matmul and its wide one (AMX included:
    its tiles widen a block at a time, reading the super-block's scales from the blocks around it)."""
    lib = _library(build)
    model = TinyModel(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, layers=2, bias=True, q4k=q4k, q5k=q5k)
    assert {m: getattr(model.blocks[0], m).format for m in q4k + q5k} == {
        **dict.fromkeys(q4k, TILES_Q4K), **dict.fromkeys(q5k, TILES_Q5K)}
    assert_step_matches_reference(model, lib, rows, seed=500 + rows)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_a_matrix_with_a_tail_in_another_format_matches_the_float64_reference(build, rows):
    """A fused QKV whose V rows are int8 group tiles (Q8G6) after 4-bit Q and K rows (a Q4_K_M file's attn_v
    beside its q and k), and a gate/up whose up rows are 5-bit: each part multiplied in its own format into
    its rows of the output, on every build's int16 matmul and its wide one, AMX included."""
    lib = _library(build)
    d = CONFIGS["even-groups"]
    model = TinyModel(**d)
    qk = (d["heads"] + d["kv_heads"]) * d["head_dim"]
    for i, layer in enumerate(model.blocks):
        codes, scale, mn = model.args[i]["qkv"]
        v = pack_q8g(codes[qk:].to(torch.int8), scale[qk:].repeat_interleave(2, 1), mn[qk:])
        assert v is not None and v.format == TILES_Q8G6
        layer.qkv = dataclasses.replace(pack_q4_1(codes[:qk], scale[:qk], mn[:qk]), tail=v)  # type: ignore[arg-type]
        model.mins[i]["qkv"][qk:] = mn[qk:].double().repeat_interleave(32, 1)  # (int8 groups: codes not centred)
        codes, scale, mn = model.args[i]["gate_up"]
        half = codes.shape[0] // 2
        up = pack_q5(codes[half:], scale[half:], mn[half:])  # (4-bit codes in the 5-bit tiles: the same weights)
        layer.gate_up = dataclasses.replace(pack_q4_1(codes[:half], scale[:half], mn[:half]), tail=up)  # type: ignore[arg-type]
        model.mins[i]["gate_up"][half:] += 8 * scale[half:].double().repeat_interleave(32, 1)  # (centred on 16)
    assert model.blocks[0].qkv.formats() == [TILES_Q4, TILES_Q8G6]
    assert_step_matches_reference(model, lib, rows, seed=600 + rows)


def test_k_scale_tiles_hold_the_factors_in_fewer_bytes():
    """TILES_Q4K: the nibbles, each row's scale and min byte, 8 bytes of the super-block's d and -dmin: 296 bytes
    a block (TILES_Q4: 320); TILES_Q5K adds the fifth bits (360, TILES_Q5: 384); K not a multiple of 256: None."""
    gen = torch.Generator().manual_seed(1)
    (codes, sc, mn, d, dmin), _ = _kq(32, 512, gen)
    t = pack_kq(codes, sc, mn, d, dmin)
    assert t is not None and t.format == TILES_Q4K and tuple(t.blocks.shape) == (2, 16, 296)
    blk = t.blocks[1, 9]  # rows 16..31, inputs 288..319: super-block 1, its block 1
    assert torch.equal(blk[256:272], sc[16:32, 9]) and torch.equal(blk[272:288], mn[16:32, 9])
    assert torch.equal(blk[288:296].view(torch.float16), d[20:24, 1])  # block 1 of 8: d of rows 4..7
    assert torch.equal(t.blocks[1, 13, 288:296].view(torch.float16), -dmin[20:24, 1])  # block 5: -dmin of rows 4..7
    (codes5, *rest), _ = _kq(32, 512, gen, levels=32)
    t5 = pack_kq(codes5, *rest)
    assert t5 is not None and t5.format == TILES_Q5K and tuple(t5.blocks.shape) == (2, 16, 360)
    assert pack_kq(codes[:, :288], sc[:, :9], mn[:, :9], d[:, :1], dmin[:, :1]) is None


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("q5, q8g", [(("qkv", "o", "gate_up", "down"), ()), (("o", "gate_up"), ("qkv",))])
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 40])
def test_five_bit_tiles_match_the_float64_reference(build, q5, q8g, rows):
    """Q5 tiles (Q5_0/Q5_1/Q5_K codes: 4-bit tiles' nibbles and a plane of fifth bits), alone and beside
    Q8G and Q4 tiles, on every build's int16 matmul and its wide one."""
    lib = _library(build)
    model = TinyModel(**CONFIGS["odd-groups"], q8g=q8g, q5=q5)
    assert {m: getattr(model.blocks[0], m).format for m in q5} == dict.fromkeys(q5, TILES_Q5)
    assert_step_matches_reference(model, lib, rows, seed=300 + rows)


@pytest.mark.parametrize("q6, q8g", [(("qkv", "o", "gate_up", "down"), ()), (("o", "down"), ("qkv",))])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 40])
def test_six_bit_tiles_match_the_float64_reference_on_the_avx2_build(q6, q8g, rows):
    """Q6 tiles (Q6_K's codes: nibbles, two bit planes, a scale per 16 inputs) alone and beside Q8G and Q4
    tiles, on the AVX2 build's int16 matmul (columns decoded to int8 groups) and its int8 one (decoded in
    registers up to 8 rows, then decoded once per column for passes of 8)."""
    lib = _library("avx2")
    model = TinyModel(**CONFIGS["odd-groups"], q8g=q8g, q6=q6)
    assert {m: getattr(model.blocks[0], m).format for m in q6} == dict.fromkeys(q6, TILES_Q6)
    assert_step_matches_reference(model, lib, rows, seed=700 + rows)


def _avx_vnni_library():
    """The AVX2 build with AVX-VNNI (`vpdpbusd` on 256-bit vectors, as a CPU with AVX-VNNI and no AVX-512 builds)."""
    if not {"avx2", "fma", "f16c", "avx_vnni"} <= cpu_info().flags:
        pytest.skip("this CPU has no AVX-VNNI")
    lib = cpu_build.compile_library(("-march=x86-64-v3", "-mavxvnni"))
    assert lib is not None
    return lib


@pytest.mark.parametrize("formats", [
    dict(q8g6=("qkv",), q5=("o",), q6=("down",)),  # Q4 gate_up
    dict(q4k=("qkv", "down"), q5k=("o", "gate_up")),
])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 40])
def test_the_avx_vnni_build_sums_as_the_avx2_one(formats, rows):
    """AVX-VNNI's `vpdpbusd` takes the place of `vpmaddubsw` + `vpmaddwd` in AVX2's int8 matmul: the same
    products to the same int32 sums, so the step's output is bit-identical to the AVX2 build's, for every
    tile format both read with int8 inputs (4-bit, 5-bit, K scales, 6-bit, small-code int8 groups), decoded
    in registers (up to 8 rows) and through the column buffer (more); the int16 matmul (wide_min_rows 0) as
    well."""
    avx2, vnni = _library("avx2"), _avx_vnni_library()
    assert vnni.sluice_forward_isa().decode() == "avx2+avx-vnni" and avx2.sluice_forward_isa().decode() == "avx2"
    d = (dict(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, layers=2, bias=True) if "q4k" in formats
         else CONFIGS["odd-groups"])
    model = TinyModel(**d, **formats)
    gen = torch.Generator().manual_seed(800 + rows)
    positions, slots, tables, row_seq, num_blocks = _step(rows, gen, 4, 8)
    kv = torch.randn(len(model.layers), 2, num_blocks * 4, d["kv_heads"], d["head_dim"], generator=gen).to(
        torch.bfloat16)
    x = torch.randn(rows, d["hidden"], generator=gen)
    for wide in (1, 0):
        out = [ForwardStep(**model.dims, block_size=4, layers=model.blocks, cos=model.cos, sin=model.sin, lib=lib)
               .run(x.clone(), positions, slots, tables, row_seq, kv.clone(), 2, wide_min_rows=wide)
               for lib in (avx2, vnni)]
        assert torch.equal(out[0], out[1]), (wide, (out[0] - out[1]).abs().max().item())


@pytest.mark.parametrize("formats", [dict(q8g=("qkv", "down"), q8=("o",)), dict(q8=("qkv", "gate_up"), q6=("down",))])
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 40])
def test_the_avx_vnni_build_takes_int8_inputs_for_the_int8_range_tiles(formats, rows):
    """With AVX-VNNI the AVX2 build's int8 matmul also reads the tiles of full-range int8 codes (Q8G, Q8_0's
    TILES_Q8: `vpdpbusd` sums in int32, where `vpmaddubsw`'s int16 pairs would saturate), offset by 128,
    against the float64 reference with int8 inputs for those matrices too ("int8 avx-vnni")."""
    lib = _avx_vnni_library()
    lib.sluice_wide_matmul.restype = ctypes.c_char_p
    assert lib.sluice_wide_matmul().decode() == "int8 avx-vnni"
    model = TinyModel(**CONFIGS["odd-groups"], **formats)
    assert_step_matches_reference(model, lib, rows, seed=900 + rows)


@pytest.mark.parametrize("rows", [1, 9, 17])
def test_the_avx_vnni_build_takes_int8_inputs_for_the_int8_output_layer(rows):
    """The output layer's int8 copy (one scale per row) on the AVX-VNNI build's wide matmul: int8 inputs in 32s
    (AVX2 without VNNI keeps int16 ones), and its top candidates still made exact by the refine."""
    from kernels.cpu import head_logits, pack_int8

    lib = _avx_vnni_library()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(4992, 96, generator=gen) * 0.05
    scales = weight.abs().amax(-1) / 127
    q = torch.round(weight / scales[:, None]).to(torch.int8)
    x = torch.randn(rows, 96, generator=gen)
    groups = x.double().view(rows, -1, 32)
    steps = groups.abs().amax(-1, keepdim=True) / 127
    want = (torch.round(groups / steps) * steps).view(rows, -1) @ (q.double() * scales.double()[:, None]).T
    for threads in (1, 2):
        got = head_logits(x, pack_int8(q, scales), threads, wide_min_rows=1, lib=lib)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        refined = head_logits(x, pack_int8(q, scales), threads, exact=weight, refine=8, wide_min_rows=1, lib=lib)
        assert torch.equal(refined.argmax(-1), (x @ weight.T).argmax(-1))


@pytest.mark.parametrize("build", ["native", "plain"])
def test_builds_without_six_bit_tiles_refuse_them(build):
    """The AVX-512 and plain builds read no TILES_Q6 (the loader gives them TILES_Q8G6): a step with such a
    matrix computes nothing and says so, and the output layer refuses the format as well."""
    from kernels.cpu import head_logits, reads_tiles

    lib = _library(build)
    if reads_tiles(TILES_Q6, lib):
        pytest.skip("this CPU has no AVX-512: its native build is the AVX2 one")
    assert reads_tiles(TILES_Q8G6, lib)
    model = TinyModel(**CONFIGS["odd-groups"], q6=("down",))
    with pytest.raises(RuntimeError, match="bad shapes"):
        assert_step_matches_reference(model, lib, 1, seed=1)
    with pytest.raises(RuntimeError, match="bad shapes"):
        head_logits(torch.randn(1, 160), model.blocks[0].down, 1, lib=lib)


def test_pack_q6_puts_each_weight_where_the_kernel_reads_it():
    """TILES_Q6: u = code + 32; its low nibbles as TILES_Q4's, bits 4-5 of tile row r (inputs 2r, 2r + 1) at
    bits 2 (r % 4) of byte 256 + 32 (r // 4) + lane, then d[2][16] (fp16) as TILES_Q8G's; codes outside
    [-32, 31] refused."""
    gen = torch.Generator().manual_seed(1)
    (codes, scale, _), _ = _q6(32, 64, gen)
    blocks = pack_q6(codes, scale).blocks
    assert blocks.shape == (2, 2, 448) and int(codes.min()) == -32 and int(codes.max()) == 31
    for nb in range(2):
        for g in range(2):
            for n in range(16):
                for i in range(32):  # input 32 g + i of row 16 nb + n
                    p, h, j = i // 4, (i // 2) % 2, i % 2
                    byte = int(blocks[nb, g, 32 * p + 2 * n + j])
                    r = i // 2  # the tile row (2p + h)
                    top = (int(blocks[nb, g, 256 + 32 * (r // 4) + 2 * n + j]) >> 2 * (r % 4)) & 3
                    u = (byte >> 4 if h else byte & 0xF) | top << 4
                    assert u - 32 == int(codes[16 * nb + n, 32 * g + i])
                for half in range(2):
                    got = blocks[nb, g, 384 + 32 * half:416 + 32 * half].view(torch.float16)[n].float()
                    assert got == scale[16 * nb + n, 2 * g + half]
    assert pack_q6(codes.clamp(max=30) + 2, scale) is None  # a 32
    assert pack_q6(codes[:24], scale[:24]) is None  # rows off the 16-row blocks


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("rows", [1, 3, 12, 40])
def test_fp16_tiles_beside_the_others_match_the_float64_reference(build, rows):
    """F16 tiles (16-bit weights, fp32 products) in a layer with Q4 and Q8G ones, every build, and AMX."""
    lib = _library(build)
    model = TinyModel(**CONFIGS["odd-groups"], q8g=("o",), f16=("qkv", "down"))
    assert model.blocks[0].qkv.format == TILES_F16 and model.blocks[0].down.format == TILES_F16
    assert_step_matches_reference(model, lib, rows, seed=200 + rows)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_bf16_tiles_beside_the_others_match_the_float64_reference(build, rows):
    """BF16 tiles (a BF16 file's weights as they are, tiny ones included) beside F16, Q4 and Q8G ones, every
    build, and AMX (where a BF16 block is the B tile itself)."""
    lib = _library(build)
    model = TinyModel(**CONFIGS["odd-groups"], q8g=("o",), f16=("down",), bf16=("qkv", "gate_up"))
    formats = [getattr(model.blocks[0], m).format for m in ("qkv", "o", "gate_up", "down")]
    assert formats == [TILES_BF16, TILES_Q8G, TILES_BF16, TILES_F16]
    assert_step_matches_reference(model, lib, rows, seed=300 + rows)


@pytest.mark.parametrize("build", list(BUILDS))
def test_final_rms_norm_of_the_sampling_rows_matches_float64(build):
    """The native step's final norm (sluice_rms_norm): the rows asked for, in their order, each normalised
    against a float64 reference; a row outside x is refused, not read."""
    lib = _library(build)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 96, generator=gen) * 3, torch.rand(96, generator=gen) + 0.5
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    rows = torch.tensor([6, 0, 3, 3])
    torch.testing.assert_close(cpu_kernels.rms_norm_rows(x, rows, w, 1e-5, lib=lib).double(), want[rows],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_kernels.rms_norm_rows(x, None, w, 1e-5, lib=lib).double(), want,
                               rtol=1e-5, atol=1e-5)
    assert cpu_kernels.rms_norm_rows(x, torch.tensor([], dtype=torch.int64), w, 1e-5, lib=lib).shape == (0, 96)
    for bad in ([7], [-1], [2, 9]):
        with pytest.raises(RuntimeError, match="bad shapes"):
            cpu_kernels.rms_norm_rows(x, torch.tensor(bad), w, 1e-5, lib=lib)


def test_pack_f16_puts_each_weight_where_the_kernel_reads_it():
    w = torch.randn(32, 64).half()
    t = pack_f16(w)
    assert t is not None and t.format == TILES_F16 and t.blocks.shape == (2, 2, 1024)
    tile = t.blocks[1, 0].view(torch.float16).view(16, 32)  # rows 16-31, inputs 0-31: [tile row r, 2 n + j]
    assert tile[7, 2 * 4 + 1] == w[16 + 4, 2 * 7 + 1] and tile[0, 0] == w[16, 0]
    assert pack_f16(w[:24]) is None and pack_f16(w.float()) is None
    b = torch.randn(32, 64).to(torch.bfloat16)
    t = pack_f16(b)
    assert t is not None and t.format == TILES_BF16
    tile = t.blocks[1, 0].view(torch.bfloat16).view(16, 32)
    assert tile[7, 2 * 4 + 1] == b[16 + 4, 2 * 7 + 1] and tile[0, 0] == b[16, 0]


def test_pack_q8g_puts_each_weight_where_the_kernel_reads_it():
    gen = torch.Generator().manual_seed(3)
    (codes, scale, mn), _ = _q8g(32, 64, gen)
    t = pack_q8g(codes, scale, mn)
    assert t is not None and t.format == TILES_Q8G and t.blocks.shape == (2, 2, 608)
    blk = t.blocks[1, 1]  # rows 16-31, inputs 32-63
    q = blk[:512].view(torch.int8).view(16, 32)  # tile row r, lane 2 n + j: codes[16 + n, 32 + 2 r + j]
    assert q[5, 2 * 3 + 1] == codes[16 + 3, 32 + 2 * 5 + 1]
    d = blk[512:576].view(torch.float16).view(2, 16)  # d[half][n]
    assert d[1, 7].float() == scale[16 + 7, 2 * 1 + 1] and d[0, 2].float() == scale[16 + 2, 2]
    assert blk[576:].view(torch.float16)[9].float() == mn[16 + 9, 1]
    assert pack_q8g(codes[:24], scale[:24], mn[:24]) is None  # rows off the 16-row blocks


def test_pack_q8g_of_q8_0_weights_keeps_one_scale_per_group():
    """Codes with equal half-group scales and no mins (Q8_0's) pack as TILES_Q8: the codes as TILES_Q8G's,
    then one fp16 d per row, 544 bytes a block; a min or unequal halves keep TILES_Q8G."""
    gen = torch.Generator().manual_seed(4)
    (codes, scale, mn), _ = _q8_0(32, 64, gen)
    t = pack_q8g(codes, scale, mn)
    assert t is not None and t.format == TILES_Q8 and t.blocks.shape == (2, 2, 544)
    blk = t.blocks[1, 1]  # rows 16-31, inputs 32-63
    assert blk[:512].view(torch.int8).view(16, 32)[5, 2 * 3 + 1] == codes[16 + 3, 32 + 2 * 5 + 1]
    assert blk[512:].view(torch.float16)[7].float() == scale[16 + 7, 2] == scale[16 + 7, 3]
    assert pack_q8g(codes, scale, mn + 1e-3).format == TILES_Q8G
    uneven = scale.clone()
    uneven[0, 1] *= 2
    assert pack_q8g(codes, uneven, mn).format == TILES_Q8G


# SmolLM2's attention shape (head size 64, three query heads per kv head) and a two-per-kv-head one: the
# vector paths' fixed (group, head size) kernels; head size 128 (Qwen 2.5 3B's, Llama 3.2 3B's) and 48 (an odd
# number of 16s: the AVX-512 path's pair order ends with a 16 in the natural one) on its general kernel.
TILE_CONFIGS = {
    "g3-d64": dict(hidden=192, heads=3, kv_heads=1, head_dim=64, inter=256, layers=2, bias=False),
    "g2-d64": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=256, layers=2, bias=True),
    "g2-d128": dict(hidden=256, heads=2, kv_heads=1, head_dim=128, inter=256, layers=2, bias=False),
    "g1-d48": dict(hidden=96, heads=2, kv_heads=2, head_dim=48, inter=160, layers=2, bias=True),
}


def _chunk_step(gen: torch.Generator, block_size: int, chunks: list[tuple[int, int]], decodes: int,
                blocks_per_seq: int):
    """Decodes, then prefill chunks of (start, length) with their rows in order (as the model runner
    lays them out): the rows the native step attends to in tiles."""
    seqs = decodes + len(chunks)
    num_blocks = seqs * blocks_per_seq + 3
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * blocks_per_seq].view(seqs, blocks_per_seq).int()
    positions, row_seq = [], []
    for s in range(decodes):
        positions.append(int(torch.randint(0, blocks_per_seq * block_size, (1,), generator=gen)))
        row_seq.append(s)
    for i, (start, n) in enumerate(chunks):
        positions += range(start, start + n)
        row_seq += [decodes + i] * n
    positions, row_seq = torch.tensor(positions), torch.tensor(row_seq, dtype=torch.int32)
    slots = torch.stack([tables[int(s), int(p) // block_size].long() * block_size + int(p) % block_size
                         for s, p in zip(row_seq, positions)])
    return positions, slots, tables, row_seq, num_blocks


# Chunks of (start, length) and the blocks per sequence: short contexts, and ones whose rows' keys span
# several KEY_SPANs (256 positions: attended in spans, then merged), a chunk crossing a span's end.
CHUNKS = {"short": ([(130, 37), (0, 21), (5, 3)], 12), "spans": ([(240, 40), (700, 20), (0, 5)], 48)}


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("config", list(TILE_CONFIGS))
@pytest.mark.parametrize("context", list(CHUNKS))
def test_prefill_chunks_attend_in_tiles_like_the_float64_reference(build, config, context):
    """Chunks longer than a tile (16 rows), starting deep in a context and at 0, beside decodes (at
    random positions up to the context's end: past several spans of keys in the long one)."""
    lib = _library(build)
    model = TinyModel(**TILE_CONFIGS[config])
    d = model.dims
    block_size, (chunks, blocks_per_seq) = 16, CHUNKS[context]
    gen = torch.Generator().manual_seed(7)
    step = ForwardStep(**d, block_size=block_size, layers=model.blocks, cos=model.cos, sin=model.sin, lib=lib)
    positions, slots, tables, row_seq, num_blocks = _chunk_step(
        gen, block_size, chunks, decodes=3, blocks_per_seq=blocks_per_seq)
    kv = (torch.randn(len(model.layers), 2, num_blocks * block_size, d["kv_heads"], d["head_dim"], generator=gen)
          .to(torch.bfloat16))
    x = torch.randn(len(positions), d["hidden"], generator=gen)
    want = model.reference(x, positions, slots, tables, row_seq, kv.clone(), block_size)
    for threads in (1, 2):
        got = step.run(x.clone(), positions, slots, tables, row_seq, kv.clone(), threads, wide_min_rows=0)
        err = (got.double() - want).abs().max().item()
        assert err < 2e-3 * want.abs().max().item(), (step.isa, threads, err)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("start", [45, 500])
def test_a_row_attends_the_same_in_a_chunk_as_alone(build, start):
    """Tiles change the order of work, not of arithmetic: a prefill chunk's rows come out bit-identical to
    the same tokens decoded one step at a time (int16 matmuls are per row), so how a prompt is chunked
    and batched changes nothing. From 500 the chunk's rows cross a span of keys' end (512): its rows
    before it are two spans merged, after it three, in either form."""
    lib = _library(build)
    model = TinyModel(**TILE_CONFIGS["g3-d64"])
    d = model.dims
    block_size = 16
    gen = torch.Generator().manual_seed(3)
    step = ForwardStep(**d, block_size=block_size, layers=model.blocks, cos=model.cos, sin=model.sin, lib=lib)
    n = 40
    positions, slots, tables, row_seq, num_blocks = _chunk_step(gen, block_size, [(start, n)], decodes=0,
                                                                blocks_per_seq=(start + n) // block_size + 1)
    kv = (torch.randn(len(model.layers), 2, num_blocks * block_size, d["kv_heads"], d["head_dim"], generator=gen)
          .to(torch.bfloat16))
    x = torch.randn(n, d["hidden"], generator=gen)
    chunk = step.run(x.clone(), positions, slots, tables, row_seq, kv.clone(), 2, wide_min_rows=0)
    kv_one = kv.clone()
    for i in range(n):
        one = step.run(x[i:i + 1].clone(), positions[i:i + 1], slots[i:i + 1], tables, row_seq[i:i + 1], kv_one, 2,
                       wide_min_rows=0)
        assert torch.equal(one[0], chunk[i]), (step.isa, i)


def test_builds_take_their_code_paths():
    model = TinyModel(**CONFIGS["even-groups"])
    names = {build: ForwardStep(**model.dims, block_size=4, layers=model.blocks, cos=torch.zeros(8, 16),
                               sin=torch.zeros(8, 16), lib=cpu_build.compile_library(flags)).isa
             for build, flags in BUILDS.items() if build != "avx2" or {"avx2", "fma", "f16c"} <= cpu_info().flags}
    assert names["plain"] == "scalar"
    if "avx2" in names:
        assert names["avx2"] == "avx2"
    flags = cpu_info().flags
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        assert names["native"] == ("avx512-vnni" if "avx512_vnni" in flags else "avx512")


def test_pack_refuses_scales_that_are_not_fp16_and_shapes_off_the_blocks():
    codes = torch.zeros(16, 32, dtype=torch.uint8)
    assert pack_q4_1(codes, torch.full((16, 1), 0.1), torch.zeros(16, 1)) is None  # 0.1 is not an fp16
    assert pack_q4_1(codes, torch.full((16, 1), 0.125), torch.zeros(16, 1)) is not None
    assert pack_q4_1(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1)) is None
    assert pack_q4_1(torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1)) is None


def test_pack_puts_each_weight_where_the_kernel_reads_it():
    """Block (nb, g), pair p, byte i: tile row 2p in the low nibble, 2p + 1 in the high one, lane i = 2n + j
    holding W[16 nb + n, 32 g + 2 r + j]; then the 16 rows' fp16 d and m."""
    gen = torch.Generator().manual_seed(0)
    (codes, scale, mn), _ = _q4(32, 64, gen)
    blocks = pack_q4_1(codes, scale, mn).blocks
    assert blocks.shape == (2, 2, 320)
    for nb, g, r, n, j in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 1), (0, 1, 6, 3, 1), (1, 0, 9, 12, 0)]:
        byte = int(blocks[nb, g, 32 * (r // 2) + 2 * n + j])
        assert (byte >> 4 if r % 2 else byte & 0xF) == int(codes[16 * nb + n, 32 * g + 2 * r + j])
        d = blocks[nb, g, 256:288].view(torch.float16)[n].float()
        m = blocks[nb, g, 288:320].view(torch.float16)[n].float()
        assert d == scale[16 * nb + n, g] and m == mn[16 * nb + n, g]


def test_pack_q5_puts_each_weight_where_the_kernel_reads_it():
    """TILES_Q5: the low nibbles as TILES_Q4's, then pair p's fifth bits in 8 bytes at 256 + 8p (bit 32 h +
    2 n + j: input 4p + 2h + j of row n, little-endian), then d and m."""
    gen = torch.Generator().manual_seed(1)
    (codes, scale, mn), _ = _q5(32, 64, gen)
    blocks = pack_q5(codes, scale, mn).blocks
    assert blocks.shape == (2, 2, 384) and int(codes.max()) >= 16  # some fifth bits set
    for nb in range(2):
        for g in range(2):
            for n in range(16):
                for i in range(32):  # input 32 g + i of row 16 nb + n
                    p, h, j = i // 4, (i // 2) % 2, i % 2
                    byte = int(blocks[nb, g, 32 * p + 2 * n + j])
                    bits = int.from_bytes(bytes(blocks[nb, g, 256 + 8 * p:264 + 8 * p].tolist()), "little")
                    code = (byte >> 4 if h else byte & 0xF) | ((bits >> (32 * h + 2 * n + j)) & 1) << 4
                    assert code == int(codes[16 * nb + n, 32 * g + i])
                assert blocks[nb, g, 320:352].view(torch.float16)[n].float() == scale[16 * nb + n, g]
                assert blocks[nb, g, 352:384].view(torch.float16)[n].float() == mn[16 * nb + n, g]


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(9, 3, 64), (8, 8, 32), (12, 2, 48), (4, 4, 64), (4, 2, 64), (8, 2, 128), (6, 2, 128)])
def test_native_decode_attention_matches_the_torch_reference(build, heads, kv_heads, head_dim):
    """kernels.cpu.decode_attention (the torch path's decode rows on a CPU) against paged_attention_ref's
    own decode branch, on strided queries (a slice of a fused QKV output) and shuffled cache blocks."""
    from kernels.cpu import decode_attention
    from kernels.metadata import AttentionMetadata
    from kernels.reference.paged_attention import paged_attention_ref

    lib = _library(build)
    gen = torch.Generator().manual_seed(heads)
    batch, block_size, blocks = 5, 16, 40
    num_blocks = batch * blocks + 1
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * blocks].view(batch, blocks).int()
    lens = torch.tensor([1, 17, 257, 96, 640], dtype=torch.int32)  # (257, 640: in 2 and 3 spans of keys)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, :heads * head_dim].unflatten(-1, (heads, head_dim))  # strided rows
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
    v = qkv[:, (heads + kv_heads) * head_dim:].unflatten(-1, (kv_heads, head_dim))
    pos = (lens - 1).long()
    slots = tables[torch.arange(batch), pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=lens,
                             query_start_loc=torch.arange(batch + 1, dtype=torch.int32), num_decodes=batch,
                             block_size=block_size, query_lens_host=[1] * batch, seq_lens_host=lens.tolist(),
                             max_decode_len=int(lens.max()))
    want = paged_attention_ref(q, k, v, k_cache, v_cache, meta)  # writes this step's K/V, then attends
    for threads in (1, 2):
        got = decode_attention(q, k_cache, v_cache, tables, lens, block_size, threads, lib=lib)
        # the reference rounds q to bf16 (the cache's dtype) before its bf16 SDPA; the kernel keeps fp32
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2)
        assert (got - want).abs().mean() < 3e-3
        # a row alone (a job per span of keys, for the threads to share) as in the batch (a job per row)
        alone = decode_attention(q[4:], k_cache, v_cache, tables[4:], lens[4:], block_size, threads, lib=lib)
        assert torch.equal(alone[0], got[4]), threads


def test_phase_timers_split_a_step_and_stay_off_unless_asked():
    from kernels.cpu import PHASES, profile, profile_read

    lib = _library("native")
    model = TinyModel(**CONFIGS["even-groups"])
    d = model.dims
    step = ForwardStep(**d, block_size=4, layers=model.blocks, cos=model.cos, sin=model.sin, lib=lib)
    gen = torch.Generator().manual_seed(0)
    positions, slots, tables, row_seq, num_blocks = _step(9, gen, 4, 8)
    kv = torch.zeros(len(model.layers), 2, num_blocks * 4, d["kv_heads"], d["head_dim"], dtype=torch.bfloat16)
    x = torch.randn(9, d["hidden"], generator=gen)
    profile(True, lib=lib)
    profile_read(lib=lib)
    for _ in range(3):
        step.run(x.clone(), positions, slots, tables, row_seq, kv, 2)
    times = profile_read(lib=lib)
    profile(False, lib=lib)
    assert set(times) == set(PHASES)
    assert times["matmuls"] > 0 and times["attention"] > 0
    assert times["step"] >= times["matmuls"] + times["attention"] + times["waits at barriers"]
    step.run(x.clone(), positions, slots, tables, row_seq, kv, 2)
    assert all(v == 0 for v in profile_read(lib=lib).values())  # off: nothing counted


def _gguf_matrices() -> list[tuple[str, cpu_kernels.GGUFRows, np.ndarray]]:
    """(type, the file's rows, gguf-py's dequantisation) for the types gguf-py quantises and the K types of
    the llama-quantize fixture."""
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((40, 96)) * 0.05).astype(np.float32)
    out = []
    for name in ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        t = gguf.GGMLQuantizationType[name]
        data = np.ascontiguousarray(gguf.quants.quantize(dense, t)).reshape(40, -1).view(np.uint8)
        out.append((name, cpu_kernels.GGUFRows(data, int(t), (40, 96)),
                    gguf.quants.dequantize(data, t).astype(np.float32).reshape(40, 96)))
    seen = set()
    for t in gguf.GGUFReader(str(FIXTURE)).tensors:
        name = t.tensor_type.name
        if len(t.shape) == 2 and name in ("Q4_K", "Q5_K", "Q6_K") and name not in seen:
            seen.add(name)
            v, k = int(t.shape[1]), int(t.shape[0])
            data = np.ascontiguousarray(t.data).reshape(v, -1)
            out.append((name, cpu_kernels.GGUFRows(data, int(t.tensor_type), (v, k)),
                        gguf.quants.dequantize(data, t.tensor_type).astype(np.float32).reshape(v, k)))
    assert len(seen) == 3
    return out


@pytest.mark.parametrize("build", list(BUILDS))
def test_gguf_rows_are_ggmls_dequantisation_bit_for_bit(build):
    """Rows decoded from the file's blocks (gguf_rows.c) are the values gguf-py's dequantisation gives,
    exactly (no fused multiply-add in any build), one row at a time and many on two threads; the full
    product from them matches the float64 reference; a row outside the matrix is refused."""
    lib = _library(build)
    for name, rows, want in _gguf_matrices():
        v, k = rows.shape
        ids = torch.tensor([3, 0, v - 1, 3])
        assert np.array_equal(cpu_kernels.gguf_rows(rows, ids, lib=lib).numpy(), want[ids.numpy()]), name
        many = torch.arange(v).repeat(2048 // v + 1)  # enough values to be split between threads
        assert np.array_equal(cpu_kernels.gguf_rows(rows, many, 2, lib=lib).numpy(), want[many.numpy()]), name
        x = torch.randn(3, k)
        for threads in (1, 2):
            torch.testing.assert_close(cpu_kernels.gguf_rows_product(x, rows, threads, lib=lib).double(),
                                       x.double() @ torch.from_numpy(want).double().T, rtol=1e-5, atol=1e-5)
        with pytest.raises(IndexError):
            cpu_kernels.gguf_rows(rows, torch.tensor([v]), lib=lib)
    with pytest.raises(ValueError):  # a type the kernels do not decode (Q2_K)
        cpu_kernels.gguf_rows(cpu_kernels.GGUFRows(np.zeros((2, 84 * 1), np.uint8), 10, (2, 256)), torch.tensor([0]),
                              lib=lib)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_output_layer_refined_from_the_files_rows_matches_the_float64_reference(build, rows):
    """The int8 output layer's candidates recomputed from the file's rows (engine/token_rows.py) have the
    float64 reference's values, every build."""
    lib = _library(build)
    gen = torch.Generator().manual_seed(rows)
    v, k = 992, 96  # 62 tiles of 16 rows; three groups of 32 inputs
    dense = (torch.randn(v, k, generator=gen) * 0.05).numpy()
    data = np.ascontiguousarray(gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)).reshape(v, -1)
    w = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0).reshape(v, k)).double()
    file_rows = cpu_kernels.GGUFRows(data.view(np.uint8), int(gguf.GGMLQuantizationType.Q8_0), (v, k))
    x = torch.randn(rows, k, generator=gen)
    ref = x.double() @ w.T
    q = (w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8)
    head = cpu_kernels.pack_int8(q, (w.abs().amax(1) / 127).float())
    refined = cpu_kernels.head_logits(x, head, 2, refine=16, exact_rows=file_rows, lib=lib)
    plain = cpu_kernels.head_logits(x, head, 2, lib=lib)
    top = plain.topk(16, dim=-1).indices
    torch.testing.assert_close(refined.gather(1, top).double(), ref.gather(1, top), rtol=1e-5, atol=1e-5)
    assert (plain.double() - ref).gather(1, top).abs().max() > 1e-4  # the int8 values alone are not exact


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("rows", [1, 2, 3, 12])
def test_a_4bit_output_layer_matches_the_float64_reference_and_refines_exactly(build, rows):
    """The output layer's 4-bit copy (a large vocabulary's, engine/weights.py `native_head`) in the layers'
    TILES_Q4: its products are the float64 ones of its dequantised weights (int16 activations; the wide
    matmul's int8 ones against the same rounding), and each row's 16 best are recomputed from the exact
    weights, whose argmax they hold; every build, one and two threads."""
    from engine.weights import native_head, q4_rows

    lib = _library(build)
    gen = torch.Generator().manual_seed(rows)
    v, k = 992, 96  # 62 tiles of 16 rows; three groups of 32 inputs
    exact = torch.randn(v, k, generator=gen) * 0.05
    head = native_head(exact, bits=4)
    assert isinstance(head, cpu_kernels.LayerTiles) and head.format == cpu_kernels.TILES_Q4
    codes, d, m = q4_rows(exact)
    dense = codes.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    mins = (m.double() + 8 * d.double()).repeat_interleave(32, 1)  # (the int8 matmul centres codes on 8)
    assert (dense - exact.double()).abs().max() <= d.double().max() * 0.51 + 1e-3  # 4-bit steps of each group
    x = torch.randn(rows, k, generator=gen)
    ref = x.double() @ dense.T
    for (int8, amx), _ in _matmul_modes(lib):
        want = _int8_groups(x.double()) @ (dense - mins).T + x.double() @ mins.T if int8 else ref
        for threads in (1, 2):
            plain = cpu_kernels.head_logits(x, head, threads, wide_min_rows=int8, amx_min_rows=amx, lib=lib)
            if amx:  # AMX: x and the widened weights in bf16
                torch.testing.assert_close(plain.double(), ref, rtol=2e-2, atol=2e-2)
            elif int8:  # x rounded in fp32 there: an input on a rounding boundary may go the other way
                err = (plain.double() - want).abs()
                assert err.median() < 1e-5 and err.max() < 2e-3, (err.median(), err.max())
            else:  # x in int16 steps of max |x| / 32767: ~3e-5 on these outputs (codes up to 15 times d)
                torch.testing.assert_close(plain.double(), want, rtol=1e-4, atol=3e-4)
            refined = cpu_kernels.head_logits(x, head, threads, exact=exact, refine=16, wide_min_rows=int8,
                                              amx_min_rows=amx, lib=lib)
            top = plain.topk(16, dim=-1).indices
            torch.testing.assert_close(refined.gather(1, top).double(), (x.double() @ exact.double().T).gather(1, top),
                                       rtol=1e-5, atol=1e-5)
            assert torch.equal(refined.argmax(-1), (x @ exact.T).argmax(-1))
    assert (ref - x.double() @ exact.double().T).abs().max() > 1e-3  # the 4-bit values alone are not exact
