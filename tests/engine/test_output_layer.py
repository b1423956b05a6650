"""The bf16 output layer with exact recomputation of each row's top candidates."""

import ctypes

import gguf
import numpy as np
import pytest
import torch

import engine.weights
import kernels.cpu as cpu_kernels
from engine.cpu_plan import CpuKernels, Plan
from engine.model import REFINE_TOP, LlamaModel
from engine.weights import (
    HEAD_4BIT_MIN_WEIGHTS,
    Int4Weight,
    Int8Weight,
    Linear,
    int4_available,
    int8_available,
    native_head,
    q4_rows,
)


def test_fast_logits_are_exact_where_it_matters():
    torch.manual_seed(0)
    weight = torch.randn(5000, 64)
    model = LlamaModel.__new__(LlamaModel)  # only the output layer is needed
    model.lm_head = Linear(weight, None, torch.float32)
    model.lm_head_fast = Linear(weight, None, torch.bfloat16)
    model.head_tiles = None
    model.head_plan = None
    h = torch.randn(32, 64)
    exact = model.logits(h, exact=True)
    fast = model.logits(h)
    bf16_only = model.lm_head_fast(h).float()
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))  # greedy decisions are exact
    refined = bf16_only.topk(REFINE_TOP, dim=-1).indices  # the candidates recomputed at full precision
    torch.testing.assert_close(fast.gather(1, refined), exact.gather(1, refined), rtol=1e-5, atol=1e-4)
    assert (bf16_only - exact).abs().max() > 1e-3  # without the refinement the values really differ
    assert (fast - exact).abs().max() < 0.5  # and the rest stay close (bf16 rounding of the tail)


@pytest.mark.skipif(not int4_available(torch.device("cpu")), reason="no CPU int4 matmul in this torch")
def test_int4_weight_computes_the_gguf_blocks():
    """Int4Weight multiplies by code * scale + min of each group of 32 (GGUF Q4_1), in bf16 arithmetic."""
    torch.manual_seed(0)
    n, k = 96, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // 32) * 0.01
    mn = -torch.rand(n, k // 32) * 0.05
    dense = (codes.float().reshape(n, k // 32, 32) * scale[..., None] + mn[..., None]).reshape(n, k)
    w4 = Int4Weight((codes, scale, mn))
    lin = Linear(dense, None, torch.bfloat16, packed=w4)
    x = torch.randn(5, k)
    ref = x @ dense.T
    torch.testing.assert_close(lin(x, packed=True), ref, rtol=2e-2, atol=2e-2)  # the int4 path
    torch.testing.assert_close(lin(x), ref, rtol=2e-2, atol=2e-2)  # the bf16 path
    assert not torch.equal(lin(x, packed=True), lin(x))  # two different computations


@pytest.mark.skipif(not int8_available(torch.device("cpu")), reason="no CPU int8 matmul in this torch")
def test_int8_output_layer_keeps_the_exact_top_candidates():
    """The int8 copy of the output layer (one scale per row) picks the candidates; the top ones are then
    recomputed at full precision, so greedy, top-k and top-p see exact values, the tail is close."""
    torch.manual_seed(0)
    weight = torch.randn(5000, 64) * 0.05
    w8 = Int8Weight(weight, chunk_rows=1000)  # several slices
    assert w8.nbytes() < weight.numel() * 2 // 1.9  # about half of bf16
    x = torch.randn(7, 64)
    torch.testing.assert_close(w8.mm(x).float(), x @ weight.T, rtol=0.03, atol=0.03)
    model = LlamaModel.__new__(LlamaModel)
    model.lm_head = Linear(weight, None, torch.float32)
    model.lm_head_fast = Linear(weight, None, torch.bfloat16, packed=w8)
    model.head_tiles = None
    model.head_plan = Plan.fixed(torch.get_num_threads(), packed_max_rows=64)
    exact = model.logits(x, exact=True)
    fast = model.logits(x)
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))
    top = exact.topk(5, dim=-1).indices
    torch.testing.assert_close(fast.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    int8_only = model.lm_head_fast(x, packed=True).float()
    assert (int8_only - exact).abs().max() > 1e-3  # without the refinement the values really differ
    assert (fast - exact).abs().max() < 0.1


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for kernels/cpu")
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 40])
def test_native_int8_output_layer_refines_the_top_candidates(rows):
    """The native output layer (kernels/cpu): its products equal the int8 weights' to the rounding of its
    matmul (int16 activations; the wide matmul's bf16 tiles on AMX, or int8 activations in 32s, against
    the same rounding of x), and each row's REFINE_TOP best are recomputed
    against the exact weights in the same call, on one and two threads; the model's logits take it."""
    torch.manual_seed(rows)
    weight = torch.randn(4992, 64) * 0.05  # 312 blocks of 16 rows: not a multiple of the threads' shares
    w8 = Int8Weight(weight)
    head = cpu_kernels.pack_int8(w8.q, w8.scales.float())
    x = torch.randn(rows, 64)
    int8_ref = x.double() @ (w8.q.double() * w8.scales.double()[:, None]).T
    exact = x @ weight.T
    lib = cpu_kernels.build.load()
    lib.sluice_wide_matmul.restype = ctypes.c_char_p
    wide = lib.sluice_wide_matmul().decode()
    groups = x.double().view(rows, -1, 32)
    steps = groups.abs().amax(-1, keepdim=True) / 127
    x8 = (torch.round(groups / steps) * steps).view(rows, -1)  # int8 in 32s
    w8_ref = (w8.q.double() * w8.scales.double()[:, None]).T
    # (int8, AMX) thresholds: int16 activations; every row count on the int8 matmul; every row count on AMX
    # (activations and weights in bf16)
    modes = [(0, 0)] + ([(1, 0)] if wide else []) + ([(0, 1)] if lib.sluice_amx_available() else [])
    for wide_rows, amx in modes:
        # (AVX2's "int8 4-6 bit": int16 inputs for int8 rows; with AVX-VNNI, "int8 avx-vnni", int8 ones)
        int8 = wide_rows and wide in ("int8", "int8+bf16", "int8 avx-vnni")
        tol = 2e-2 if amx else 1e-4
        for threads in (1, 2):
            plain = cpu_kernels.head_logits(x, head, threads, wide_min_rows=wide_rows, amx_min_rows=amx)
            torch.testing.assert_close(plain.double(), x8 @ w8_ref if int8 else int8_ref,
                                       rtol=tol, atol=tol)
            refined = cpu_kernels.head_logits(x, head, threads, exact=weight, refine=REFINE_TOP,
                                              wide_min_rows=wide_rows, amx_min_rows=amx)
            top = plain.topk(REFINE_TOP, dim=-1).indices
            torch.testing.assert_close(refined.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
            rest = torch.ones_like(plain, dtype=torch.bool).scatter_(1, top, False)
            assert torch.equal(refined[rest], plain[rest])  # only the candidates changed
            assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    assert cpu_kernels.pack_int8(w8.q[:40], w8.scales[:40]) is None  # 40 rows: not whole blocks
    assert cpu_kernels.head_logits(x[:0], head, 2, exact=weight, refine=REFINE_TOP).shape == (0, 4992)  # a chunk
    model = LlamaModel.__new__(LlamaModel)
    model.lm_head = Linear(weight, None, torch.float32)
    kernels = CpuKernels(native=True, threads=2, wide_min_rows=0)
    model.lm_head_fast, model.head_tiles, model.kernels = None, head, kernels
    assert model.approximate_logits
    torch.testing.assert_close(model.logits(x), cpu_kernels.head_logits(x, head, 2, weight, REFINE_TOP))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for kernels/cpu")
@pytest.mark.parametrize("rows", [1, 9])
def test_native_output_layer_refines_from_the_files_rows(rows):
    """The candidates recomputed from the file's rows (engine/token_rows.py) get the values the fp32 copy
    of the same weights gives, on one and two threads."""
    torch.manual_seed(rows)
    v, k = 1024, 96
    qt = gguf.GGMLQuantizationType.Q5_1
    data = np.ascontiguousarray(gguf.quants.quantize((torch.randn(v, k) * 0.05).numpy(), qt)).reshape(v, -1)
    weight = torch.from_numpy(gguf.quants.dequantize(data, qt).astype(np.float32).reshape(v, k))
    file_rows = cpu_kernels.GGUFRows(data.view(np.uint8), int(qt), (v, k))
    w8 = Int8Weight(weight)
    head = cpu_kernels.pack_int8(w8.q, w8.scales.float())
    x = torch.randn(rows, k)
    exact = x @ weight.T
    for threads in (1, 2):
        dense = cpu_kernels.head_logits(x, head, threads, exact=weight, refine=REFINE_TOP)
        coded = cpu_kernels.head_logits(x, head, threads, refine=REFINE_TOP, exact_rows=file_rows)
        plain = cpu_kernels.head_logits(x, head, threads)
        torch.testing.assert_close(coded, dense, rtol=1e-5, atol=1e-5)
        top = plain.topk(REFINE_TOP, dim=-1).indices
        torch.testing.assert_close(coded.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(coded.gather(1, top), plain.gather(1, top), rtol=1e-5, atol=1e-5)


def test_native_head_packs_in_slices_what_the_whole_int8_copy_packs():
    torch.manual_seed(0)
    weight = torch.randn(4992, 64) * 0.05
    w8 = Int8Weight(weight)
    whole = cpu_kernels.pack_int8(w8.q, w8.scales.float())
    sliced = native_head(weight, chunk_rows=1000)  # slices of 992 rows: the last one shorter
    assert whole is not None and sliced is not None and sliced.shape == whole.shape
    assert torch.equal(sliced.blocks, whole.blocks) and torch.equal(sliced.scales, whole.scales)
    assert native_head(weight[:40]) is None  # not whole tiles


def test_native_head_is_4bit_from_its_size_on_or_when_asked_and_packs_in_slices_alike(monkeypatch):
    """4-bit (the layers' TILES_Q4) from HEAD_4BIT_MIN_WEIGHTS weights on or with bits=4, int8 below; sliced
    packing gives the whole matrix's tiles."""
    torch.manual_seed(1)
    weight = torch.randn(4992, 64) * 0.05
    whole = cpu_kernels.pack_q4_1(*q4_rows(weight))
    sliced = native_head(weight, chunk_rows=1000, bits=4)
    assert isinstance(sliced, cpu_kernels.LayerTiles) and whole is not None
    assert sliced.format == cpu_kernels.TILES_Q4 and torch.equal(sliced.blocks, whole.blocks)
    assert HEAD_4BIT_MIN_WEIGHTS > weight.numel()
    assert isinstance(native_head(weight), cpu_kernels.Q8Tiles)  # below the size: int8
    monkeypatch.setattr(engine.weights, "HEAD_4BIT_MIN_WEIGHTS", weight.numel())
    assert isinstance(native_head(weight), cpu_kernels.LayerTiles)  # from it on: 4-bit
    assert isinstance(native_head(weight, bits=8), cpu_kernels.Q8Tiles)  # unless asked
