"""Paged decode attention (Triton, interpreted) against the torch references."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.reference.decode_attention import decode_attention_ref
from kernels.triton.decode_attention import decode_attention_triton

from ..conftest import DEV, close, paged_layout

pytestmark = pytest.mark.triton

# (dtype, query heads, kv heads, head_dim, block_size, seq_lens, splits); BLOCK_N is 16 throughout so
# the lengths below cross tiles, cache blocks and splits at and around their boundaries.
CASES = [
    (torch.float32, 4, 4, 64, 4, [1, 4, 5, 16, 17, 33], 1),  # GQA 1, length 1, block/tile edges
    (torch.float32, 8, 2, 128, 16, [1, 16, 32, 47], 2),  # GQA 4, D 128
    (torch.float32, 8, 1, 64, 8, [2, 9, 63, 64, 65], 3),  # GQA 8 (MQA), uneven splits
    (torch.float16, 8, 2, 64, 4, [1, 7, 31, 40], 2),
    (torch.float16, 16, 2, 128, 16, [1, 17, 50], 1),  # GQA 8, D 128
    (torch.bfloat16, 4, 4, 128, 8, [1, 8, 25], 2),
    (torch.bfloat16, 8, 1, 64, 4, [3, 16, 29], 4),
    (torch.float32, 6, 2, 80, 16, [1, 20, 35], 2),  # GQA 3, head_dim not a power of two
]


@pytest.mark.parametrize("dtype,h,hkv,d,bs,lens,splits", CASES)
def test_decode_matches_reference(dtype, h, hkv, d, bs, lens, splits):
    torch.manual_seed(hash((h, hkv, d, bs, splits)) % 1000)
    tables, slots = paged_layout(lens, bs)
    k_cache = torch.randn(slots, hkv, d).to(dtype)
    v_cache = torch.randn(slots, hkv, d).to(dtype)
    q = torch.randn(len(lens), h, d).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q, k_cache, v_cache, tables, seq_lens = (x.to(DEV) for x in (q, k_cache, v_cache, tables, seq_lens))
    out = decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, bs, num_splits=splits, block_n=16)
    close(out, decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, bs), dtype)


def test_decode_more_splits_than_tiles_and_strided_q():
    """Empty splits (length 1 with 8 splits) merge to nothing; q may be a strided view of a QKV output."""
    torch.manual_seed(1)
    lens = [1, 2, 40]
    tables, slots = paged_layout(lens, 4)
    k_cache, v_cache = torch.randn(slots, 2, 64), torch.randn(slots, 2, 64)
    qkv = torch.randn(3, (8 + 2 + 2) * 64)
    q = qkv[:, :512].view(3, 8, 64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q, k_cache, v_cache, tables, seq_lens = (x.to(DEV) for x in (q, k_cache, v_cache, tables, seq_lens))
    out = decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, 4, num_splits=8, block_n=16)
    close(out, decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 4), torch.float32)
    assert torch.isfinite(out).all()
