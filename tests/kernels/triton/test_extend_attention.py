"""Prefill/extend attention and the whole paged_attention step (Triton, interpreted) against the references."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.metadata import AttentionMetadata
from kernels.reference.extend_attention import extend_attention_ref
from kernels.reference.paged_attention import paged_attention_ref
from kernels.triton.extend_attention import extend_attention_triton
from kernels.triton.paged_attention import paged_attention_triton

from ..conftest import DEV, close, paged_layout

pytestmark = pytest.mark.triton

# (dtype, H, Hkv, D, block_size, [(cached prefix, new tokens)]); BLOCK_M = BLOCK_N = 16 on CPU.
CASES = [
    # GQA 1; fresh prefill of 1; prefix at a block edge
    (torch.float32, 4, 4, 64, 4, [(0, 1), (0, 5), (3, 17), (16, 16)]),
    (torch.float32, 8, 2, 128, 16, [(0, 33), (15, 2), (17, 1)]),  # GQA 4, D 128; a 1-token chunk after a prefix
    (torch.float32, 8, 1, 64, 8, [(7, 9), (0, 20)]),  # GQA 8
    (torch.float16, 8, 2, 64, 4, [(5, 11), (0, 18)]),
    (torch.bfloat16, 16, 2, 128, 16, [(20, 12), (0, 3)]),  # GQA 8, D 128
]


def _extend_inputs(dtype, h, hkv, d, bs, chunks, seed=0):
    torch.manual_seed(seed)
    lens = [p + n for p, n in chunks]
    tables, slots = paged_layout(lens, bs, seed=seed)
    k_cache = torch.randn(slots, hkv, d).to(dtype)
    v_cache = torch.randn(slots, hkv, d).to(dtype)
    qsl = [0]
    for _, n in chunks:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], h, d).to(dtype)
    out = (q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32))
    return tuple(x.to(DEV) for x in out)


@pytest.mark.parametrize("dtype,h,hkv,d,bs,chunks", CASES)
def test_extend_matches_reference(dtype, h, hkv, d, bs, chunks):
    q, kc, vc, tables, seq_lens, qsl = _extend_inputs(dtype, h, hkv, d, bs, chunks)
    max_q = max(n for _, n in chunks)
    out = extend_attention_triton(q, kc, vc, tables, seq_lens, qsl, bs, max_q, block_m=16, block_n=16)
    close(out, extend_attention_ref(q, kc, vc, tables, seq_lens, qsl, bs), dtype)


def _metadata(chunks, bs, seed):
    """A mixed step as the engine builds it: decodes (1 new token) first, then prefill/extend chunks."""
    lens = [p + n for p, n in chunks]
    tables, slots = paged_layout(lens, bs, seed=seed)
    slot_mapping, qsl = [], [0]
    for s, (p, n) in enumerate(chunks):
        slot_mapping += [int(tables[s, pos // bs]) * bs + pos % bs for pos in range(p, p + n)]
        qsl.append(qsl[-1] + n)
    nd = 0
    while nd < len(chunks) and chunks[nd][1] == 1 and chunks[nd][0] > 0:
        nd += 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=DEV), block_tables=tables.to(DEV),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        num_decodes=nd, block_size=bs, query_lens_host=[n for _, n in chunks], seq_lens_host=lens,
        max_decode_len=max(lens[:nd], default=0))
    return meta, slots


@pytest.mark.parametrize("dtype,h,hkv,d,bs,chunks", [
    (torch.float32, 8, 2, 64, 4, [(0, 1), (4, 1), (16, 1), (0, 6), (9, 7)]),  # decodes of length 1, 5, 17
    (torch.float16, 8, 8, 128, 16, [(30, 1), (2, 1), (16, 16)]),
    (torch.bfloat16, 8, 1, 64, 8, [(12, 1), (0, 9)]),
])
def test_paged_attention_step_matches_reference(dtype, h, hkv, d, bs, chunks):
    """write_kv + decode + extend through the engine's entry point: same output and same cache."""
    meta, slots = _metadata(chunks, bs, seed=3)
    torch.manual_seed(3)
    t = sum(n for _, n in chunks)
    q, k, v = torch.randn(t, h, d).to(dtype), torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, d).to(dtype)
    kc, vc = torch.randn(slots, hkv, d).to(dtype), torch.randn(slots, hkv, d).to(dtype)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    kc2, vc2 = kc.clone(), vc.clone()
    out = paged_attention_triton(q, k, v, kc, vc, meta)
    ref = paged_attention_ref(q, k, v, kc2, vc2, meta)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    close(out, ref, dtype)
