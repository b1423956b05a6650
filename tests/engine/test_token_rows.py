"""engine/token_rows.py: the embedding and output layer read from the file's blocks give the dequantised
weights bit for bit (rows, slices) and their full product at full precision, without a copy; the native
engine holds them so, and its logits still match the fp32 copy's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

import kernels.cpu as cpu_kernels
from engine.loader import _gguf_rows
from engine.token_rows import TokenRows

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for kernels/cpu")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-kquants.gguf"


def _tensor(dense: np.ndarray, qtype: str) -> SimpleNamespace:
    """A matrix quantised by gguf-py, shaped as GGUFReader gives a tensor (dimensions innermost first)."""
    t = gguf.GGMLQuantizationType[qtype]
    return SimpleNamespace(data=gguf.quants.quantize(dense, t), tensor_type=t, shape=list(reversed(dense.shape)))


def _check(t, want: np.ndarray, max_ratio: float) -> TokenRows:
    rows = _gguf_rows(t)
    assert rows is not None, t.tensor_type.name
    v, k = want.shape
    assert rows.shape == (v, k) and rows.type_name == t.tensor_type.name
    assert rows.nbytes() <= want.nbytes * max_ratio  # the point: well under fp32's bytes
    ids = torch.tensor([[3, 0], [v - 1, 3]])
    got = rows[ids]
    assert got.dtype == torch.float32 and got.shape == (2, 2, k)
    assert np.array_equal(got.numpy(), want[ids.numpy()])  # bit for bit the dequantised values
    assert np.array_equal(rows[5:21].numpy(), want[5:21])
    h = torch.randn(3, k)
    ref = h.double() @ torch.from_numpy(want).double().T
    for chunk in (7, 4096):  # chunks that do and do not divide the rows
        torch.testing.assert_close(rows.product(h, chunk_rows=chunk).double(), ref, rtol=1e-5, atol=1e-4)
    for threads in (1, 2):  # the native product, for a decode step's few rows
        torch.testing.assert_close(rows.product(h, threads=threads).double(), ref, rtol=1e-5, atol=1e-4)
    return rows


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16"])
def test_rows_of_each_type_are_the_dequantised_weights(qtype):
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((40, 96)) * 0.05).astype(np.float32)
    t = _tensor(dense, qtype)
    want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    _check(t, want, 0.55 if qtype == "F16" else 0.4)


def test_k_types_from_llama_quantize_and_types_it_does_not_keep():
    reader = gguf.GGUFReader(str(FIXTURE))
    seen = set()
    for t in reader.tensors:
        if len(t.shape) != 2 or t.tensor_type.name in seen or t.tensor_type.name in ("F32", "F16"):
            continue
        _check(t, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32), 0.4)
        seen.add(t.tensor_type.name)
    assert {"Q4_K", "Q5_K", "Q6_K"} <= seen
    f32 = SimpleNamespace(data=np.zeros((4, 32), np.float32), tensor_type=gguf.GGMLQuantizationType.F32,
                          shape=[32, 4])
    assert _gguf_rows(f32) is None  # kept as an fp32 copy, as before


@pytest.mark.model
def test_the_native_engine_keeps_them_and_its_logits_match_the_fp32_copy(engine):
    model = engine.runner.model
    if model.native is None:
        pytest.skip("no native step here (no C compiler)")
    from engine.loader import default_model_path, load_model

    assert isinstance(model.embed, TokenRows) and model.head_rows is model.embed  # tied: one copy
    assert model.lm_head is None
    dense = load_model(str(default_model_path())).weights["model.embed_tokens.weight"]
    assert model.embed.nbytes() < dense.numel() * dense.element_size() / 2.5
    assert model.embed.rows.data.base is not None and not model.embed.rows.data.flags.owndata  # the file's pages
    ids = torch.tensor([0, 1, 17, 49151])
    assert torch.equal(model.embed[ids], dense[ids])
    h = torch.randn(3, dense.shape[1]) * 3
    exact = h @ dense.T
    torch.testing.assert_close(model.logits(h, exact=True), exact, rtol=1e-5, atol=1e-4)
    fast = model.logits(h)
    top = exact.topk(5, dim=-1).indices
    torch.testing.assert_close(fast.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))
