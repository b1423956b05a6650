"""engine/gguf_blocks.py: the codes and group scales of each block type against gguf-py's dequantiser, on
matrices gguf-py quantises (Q8_0, Q5_0, Q5_1) and on a small file llama.cpp's `llama-quantize` wrote with
the K types (tests/fixtures/tiny-kquants.gguf, made by tests/fixtures/make_kquants.py); and that file's
mixed layers through the native step against a float64 reference."""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.gguf_blocks import DECODERS, dequantize, group_blocks, half_weights
from engine.weights import _five_bit, pack_native
from kernels.cpu import (
    TILES_Q4,
    TILES_Q4K,
    TILES_Q5,
    TILES_Q5K,
    TILES_Q6,
    TILES_Q8,
    TILES_Q8G,
    TILES_Q8G6,
    LayerBlocks,
)
from kernels.cpu import build as cpu_build
from tests.kernels.cpu.test_forward import TinyModel, _library, assert_step_matches_reference

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-kquants.gguf"


def _layer_tensors(reader: gguf.GGUFReader) -> dict[str, object]:
    return {t.name: t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}


def _shape(t) -> tuple[int, int]:
    return tuple(int(d) for d in reversed(t.shape))  # type: ignore[return-value]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("k", [96, 512])  # three groups (odd), sixteen
def test_gguf_py_quantised_blocks_decode_to_its_dequantised_values(qtype, k):
    rng = np.random.default_rng(k)
    dense = (rng.standard_normal((48, k)) * rng.uniform(0.01, 1, (48, 1))).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    data = gguf.quants.quantize(dense, t)
    b = group_blocks(data, qtype, (48, k))
    assert b is not None and b.exact and not b.four_bit  # fp16 scales and mins, as the file holds them
    assert b.codes.dtype == torch.int8 and b.scale.shape == (48, k // 16) and b.mn.shape == (48, k // 32)
    want = gguf.quants.dequantize(data, t).astype(np.float64)
    assert np.array_equal(dequantize(b).numpy(), want)


def test_llama_quantize_k_types_decode_to_gguf_py_values():
    reader = gguf.GGUFReader(str(FIXTURE))
    seen = set()
    for name, t in _layer_tensors(reader).items():
        kind = t.tensor_type.name  # type: ignore[attr-defined]
        b = group_blocks(t.data, kind, _shape(t))  # type: ignore[attr-defined]
        assert b is not None, (name, kind)
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(dequantize(b).numpy(), want, err_msg=f"{name} ({kind})")
        assert b.four_bit == (kind == "Q4_K")
        seen.add(kind)
    assert seen == set(DECODERS)  # the fixture holds every type the decoders read


def test_other_types_and_partial_blocks_are_not_decoded():
    assert group_blocks(np.zeros((2, 64), np.uint8), "F16", (2, 32)) is None
    assert group_blocks(np.zeros((2, 144), np.uint8), "Q4_K", (2, 128)) is None  # K not a whole super-block


def test_f16_and_bf16_stay_the_16_bit_weights_the_file_holds():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((16, 64)).astype(np.float16)
    h = half_weights(w, "F16", (16, 64))
    assert h is not None and h.weight.dtype == torch.float16 and torch.equal(h.weight, torch.from_numpy(w))
    bf = (torch.randn(16, 64, generator=torch.Generator().manual_seed(5)) * 0.1).to(torch.bfloat16)
    raw = bf.view(torch.int16).numpy().view(np.uint8)  # how the file's reader maps BF16: bytes per row
    h = half_weights(raw, "BF16", (16, 64))
    assert h is not None and h.weight.dtype == torch.bfloat16 and torch.equal(h.weight, bf)
    tiny = torch.full((16, 64), 1e-9).to(torch.bfloat16)  # below fp16's range: kept as bf16, not flushed
    h = half_weights(tiny.view(torch.int16).numpy().view(np.uint8), "BF16", (16, 64))
    assert h is not None and torch.equal(h.weight, tiny)
    assert half_weights(w, "Q8_0", (16, 64)) is None


def _tile_values(b, exact_k: bool = False) -> torch.Tensor:
    """The weights the tiles hold: the K types' product scales rounded to fp16 (`exact_k`: as they are, the
    K tiles' own), each weight q d + m in fp32 (what the AMX path then rounds to bf16). Within 2^-11 of the
    file's own values, relative to a group's largest code * scale plus its min: each of the two is rounded to
    fp16 once (under 1% of a Q4_K step)."""
    n, k = b.codes.shape
    scale, mn = (b.scale, b.mn) if exact_k else (b.scale.half().float(), b.mn.half().float())
    qd = b.codes.float().view(n, k // 16, 16) * scale[..., None]
    w = qd.view(n, k // 32, 32) + mn[..., None]
    exact = dequantize(b).view(n, k // 32, 32)
    bound = 2**-11 * (qd.view(n, k // 32, 32).abs().amax(-1) + mn.abs())
    assert ((w.double() - exact).abs().amax(-1) <= bound.double() * (1 + 1e-6)).all()
    return w.view(n, k).double()


def _tile_mins(b, exact_k: bool = False) -> torch.Tensor:
    """The part of `_tile_values` that is the groups' mins (fp16-rounded unless `exact_k`), one per weight."""
    return (b.mn.double() if exact_k else b.mn.half().double()).repeat_interleave(32, 1)


def _fixture_model(k_scales: bool, six_bit: bool = False) -> tuple[TinyModel, dict[str, list[int]]]:
    """The fixture's two layers as the native step's tiles (`k_scales`: Q4_K/Q5_K matrices in K tiles;
    `six_bit`: Q6_K ones in 6-bit tiles, the AVX2 build's), and as float64 weights for the reference."""
    reader = gguf.GGUFReader(str(FIXTURE))
    ts = _layer_tensors(reader)
    model = TinyModel(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=256, layers=2, bias=False)
    fused = {"qkv": ["attn_q", "attn_k", "attn_v"], "o": ["attn_output"], "gate_up": ["ffn_gate", "ffn_up"],
             "down": ["ffn_down"]}
    formats: dict[str, list[int]] = {}
    for i in range(2):
        blocks = {n: group_blocks(t.data, t.tensor_type.name, _shape(t))  # type: ignore[attr-defined]
                  for n, t in ts.items() if n.startswith(f"blk.{i}.")}
        packed = {m: pack_native([blocks[f"blk.{i}.{p}.weight"] for p in parts], k_scales, six_bit)
                  for m, parts in fused.items()}
        formats.update({f"{i}.{m}": t.formats() for m, t in packed.items() if t is not None})
        dense, model.mins[i] = {}, {}
        for m, parts in fused.items():
            t = packed[m]
            assert t is not None
            # each part's tiles: the matrix's, or its tail's for the last part
            fmts = [t.tail.format if t.tail is not None and j == len(parts) - 1 else t.format
                    for j in range(len(parts))]
            ws, mins = [], []
            for p, f in zip(parts, fmts, strict=True):
                b, exact = blocks[f"blk.{i}.{p}.weight"], f in (TILES_Q4K, TILES_Q5K)
                ws.append(_tile_values(b, exact))
                if f in (TILES_Q4, TILES_Q5, TILES_Q4K, TILES_Q5K):  # the int8 matmul centres 4-bit and 5-bit
                    five = _five_bit(b)  # codes on 8 and 16 (Q5_0's moved up by 16)  # type: ignore[arg-type]
                    assert five is not None
                    rnd = (lambda x: x.double()) if exact else (lambda x: x.half().double())
                    centre = 16 if f in (TILES_Q5, TILES_Q5K) else 8
                    mins.append((rnd(five[2]) + centre * rnd(five[1])).repeat_interleave(32, 1))
                else:  # the int8 matmul's reference multiplies the groups' mins by the exact inputs
                    mins.append(_tile_mins(b, exact))
            dense[m], model.mins[i][m] = torch.cat(ws), torch.cat(mins)
        model.q8g[i] = {m for m, t in packed.items()
                        if t is not None and any(f in (TILES_Q8G, TILES_Q8) for f in t.formats())}
        _, norms, _ = model.layers[i]
        model.layers[i] = (dense, norms, None)
        model.blocks[i] = LayerBlocks(attn_norm=norms[0], mlp_norm=norms[1], **packed)  # type: ignore[arg-type]
    return model, formats


@pytest.mark.skipif(cpu_build.load() is None, reason="no C compiler to build kernels/cpu/forward.c")
@pytest.mark.parametrize("build, six_bit", [("native", False), ("avx2", False), ("avx2", True)])
@pytest.mark.parametrize("rows", [1, 9, 40])
@pytest.mark.parametrize("k_scales", [True, False])
def test_a_file_that_mixes_block_types_runs_natively_like_the_float64_reference(build, six_bit, rows, k_scales):
    model, formats = _fixture_model(k_scales, six_bit)
    # layer 0: Q4_K/Q5_K q and k in 5-bit tiles (with their own scales, or fp16 d and m) and the Q6_K v after
    # them in int8 group tiles (codes in [-32, 32]; or 6-bit tiles), Q8_0 (Q8 tiles: one scale per group, no
    # min), Q5_0/Q5_1 in 5-bit tiles, Q6_K; layer 1 is all Q4_K (4-bit tiles, with its own scales or fp16 d
    # and m)
    q6 = TILES_Q6 if six_bit else TILES_Q8G6
    assert {k: v for k, v in formats.items() if k.startswith("0.")} == {
        "0.qkv": [TILES_Q5K if k_scales else TILES_Q5, q6], "0.o": [TILES_Q8], "0.gate_up": [TILES_Q5],
        "0.down": [q6]}
    assert {k: v for k, v in formats.items() if k.startswith("1.")} == dict.fromkeys(
        ("1.qkv", "1.o", "1.gate_up", "1.down"), [TILES_Q4K if k_scales else TILES_Q4])
    # AVX2's wide matmul gives the Q8_0 matrix int16 inputs and the others int8 ones: an int16 input that
    # falls on the other side of a rounding step than the float64 reference's (a step is 2^9 fp32 ulps of
    # the row's largest: it happens) then moves the next int8 roundings, and this file's reference moves by
    # 1e-3 to 1e-2 a row for inputs moved by 1e-6 of themselves: its step is checked on int16 matmuls, its
    # wide matmul matrix by matrix (below). On AVX-512 VNNI (int8 inputs everywhere) the median row stays
    # within 1e-4, but one row of 40 may move as far as the reference's own (2.6e-2 under that 1e-6 move).
    assert_step_matches_reference(model, _library(build), rows, seed=rows, wide=build != "avx2", int8_max=3e-2)


@pytest.mark.parametrize("build, six_bit", [("native", False), ("avx2", False), ("avx2", True)])
@pytest.mark.parametrize("k_scales", [True, False])
def test_the_files_matrices_through_each_builds_wide_matmul_match_their_rounding(build, six_bit, k_scales):
    """Each matrix of the file through the build's wide matmul (the native matmul of sluice_head_logits,
    which takes a layer's tiles) against the float64 product with the inputs rounded as that matmul
    rounds them: int8 in 32s for the 4-bit tiles, for the int8-group ones too on AVX-512 VNNI and on AVX2
    for those with codes in [-32, 32] (TILES_Q8G6), else int16 per row."""
    from kernels.cpu import head_logits
    from tests.kernels.cpu.test_forward import _int8_groups, _int16_rows

    lib = _library(build)
    lib.sluice_wide_matmul.restype = ctypes.c_char_p
    wide = lib.sluice_wide_matmul().decode()
    if not wide.startswith("int8"):
        pytest.skip(f"this build's wide matmul is {wide or 'none'}")
    model, _ = _fixture_model(k_scales, six_bit)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(0))
    checked = 0
    for i, layer in enumerate(model.blocks):
        for name in ("qkv", "o", "gate_up", "down"):
            whole, weight, mins = getattr(layer, name), model.layers[i][0][name], model.mins[i][name]
            if whole.shape[1] != x.shape[1]:
                continue
            parts = [(whole, 0)] + ([(whole.tail, whole.shape[0])] if whole.tail is not None else [])
            for tiles, r0 in parts:  # (a matrix with a tail: each part, its own rows)
                r1, tiles = r0 + tiles.shape[0], dataclasses.replace(tiles, tail=None)
                int16 = wide == "int8 4-6 bit" and tiles.format in (TILES_Q8G, TILES_Q8)
                rounded = (_int16_rows if int16 else _int8_groups)(x.double())
                w, m = weight[r0:r1], mins[r0:r1]
                want = rounded @ (w - m).T + x.double() @ m.T
                for threads in (1, 2):
                    got = head_logits(x, tiles, threads, wide_min_rows=1, lib=lib).double()
                    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-6, (i, name, tiles.format, threads)
                checked += 1
    assert checked >= 6


@pytest.mark.parametrize("build", ["native", "avx2", "plain"])
def test_six_bit_tiles_are_taken_only_by_the_build_that_reads_them(build, monkeypatch):
    """The loader's policy (`six_bit_tiles_pay`) follows the loaded build: the AVX2 one (whose wide matmul
    is "int8 4-6 bit", or "int8 avx-vnni" with AVX-VNNI) reads TILES_Q6 and gets Q6_K's codes in them; the
    others keep TILES_Q8G6."""
    import engine.weights as weights

    lib = _library(build)
    lib.sluice_wide_matmul.restype = ctypes.c_char_p
    monkeypatch.setattr(cpu_build, "load", lambda: lib)
    assert weights.six_bit_tiles_pay() == (lib.sluice_wide_matmul().decode() in ("int8 4-6 bit", "int8 avx-vnni"))
    _, formats = _fixture_model(k_scales=True, six_bit=weights.six_bit_tiles_pay())
    assert formats["0.down"] == [TILES_Q6 if weights.six_bit_tiles_pay() else TILES_Q8G6]
