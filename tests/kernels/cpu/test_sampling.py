"""The native CPU sampler (kernels/cpu `sample`) against kernels.sampling's torch sampler: the same
tokens (the same noise, temperature, top-k and top-p semantics), on a real vocabulary's size, for every
build of forward.c this CPU runs: the candidate path, the wide-nucleus path and the unfiltered race."""

import pytest
import torch

from kernels.cpu import build as cpu_build
from kernels.cpu import sample, sample_masked
from kernels.sampling import sample_tokens, uniform_noise, unpack_bitmask

from .test_forward import BUILDS, _library

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="no C compiler to build kernels/cpu/forward.c")

VOCAB = 49152
CASES = {  # temperature, top_k, top_p
    "greedy": (0.0, 0, 1.0),
    "race over all": (0.7, 0, 1.0),
    "top-k": (0.8, 40, 1.0),
    "top-k and top-p": (1.0, 50, 0.95),
    "narrow top-p": (0.5, 0, 0.9),
    "wide top-p": (2.0, 0, 0.999),  # more kept tokens than the 512 candidates: the bisection path
    "top-k 1": (1.5, 1, 1.0),
    "top-p keeps one": (0.5, 0, 0.2),  # the first token's mass alone reaches top_p
}


def _kept_and_scores(row, temp, top_k, top_p, seed, offset):
    """float64 race scores of every token, -inf where the filters drop it (sample_tokens_ref's rules)."""
    scaled = row.double() / max(temp, 1e-5)
    vals, order = scaled.sort(descending=True, stable=True)
    probs = vals.softmax(-1)
    before = probs.cumsum(-1) - probs
    k = top_k if 0 < top_k < row.numel() else row.numel()
    keep = (torch.arange(row.numel()) < k) & ((before < top_p) | (torch.arange(row.numel()) == 0))
    kept = torch.zeros(row.numel(), dtype=torch.bool)
    kept[order[keep]] = True
    u = uniform_noise(torch.tensor([seed]), torch.tensor([offset]), row.numel())[0].double()
    score = (scaled - scaled.max()).exp() / -u.log()
    return kept, score.masked_fill(~kept, float("-inf"))


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("case", list(CASES))
def test_native_sampler_gives_the_torch_samplers_tokens(build, case):
    lib = _library(build)
    temp, top_k, top_p = CASES[case]
    b = 12
    g = torch.Generator().manual_seed(len(case))
    logits = 3 * torch.randn(b, VOCAB, generator=g)
    logits[:, 7] = logits[:, 9] = logits.max() + 1  # an exact tie at the top: the first index wins
    params = (torch.full((b,), temp), torch.full((b,), top_k, dtype=torch.int64), torch.full((b,), top_p),
              torch.randint(0, 2**62, (b,), generator=g), torch.randint(0, 10_000, (b,), generator=g))
    want = sample_tokens(logits, *params, filter_top=top_k > 0 or top_p < 1)
    for threads in (1, 2):
        got = sample(logits, *params, threads, lib=lib)
        for i in range(b):
            if got[i] == want[i]:
                continue
            # Rounding of exp/log may decide a near-tie of the race the other way, and torch's unstable
            # sort orders equal logits either way (ours: the lower index first): then our token must
            # still win the race among the tokens the rules keep, to rounding.
            kept, score = _kept_and_scores(logits[i], temp, top_k, top_p, int(params[3][i]), int(params[4][i]))
            assert kept[got[i]], (case, i)
            assert score[got[i]] >= score.max() * (1 - 1e-5), (case, i)
        if temp == 0 or top_k == 1 or case == "top-p keeps one":
            assert got.tolist() == [7] * b


def test_native_sampler_depends_on_seed_and_offset_only():
    lib = _library("native")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=g)
    logits[3:] = logits[:3]
    params = (torch.full((6,), 1.0), torch.zeros(6, dtype=torch.int64), torch.full((6,), 0.95),
              torch.tensor([1, 2, 3, 1, 2, 3]), torch.tensor([5, 5, 5, 5, 5, 6]))
    got = sample(logits, *params, 2, lib=lib).tolist()
    assert got[:2] == got[3:5]  # same logits, seed and offset: same token, wherever the row is
    alone = sample(logits[4:5], *(p[4:5] for p in params), 1, lib=lib).tolist()
    assert alone == [got[4]]
    draws = {sample(logits[:1], params[0][:1], params[1][:1], params[2][:1], torch.tensor([9]), torch.tensor([o]), 1,
                    lib=lib).item() for o in range(16)}
    assert len(draws) > 1  # the offset moves the stream


# (seed, offset, token) whose noise hash has its top 24 bits set (found by scanning offsets of seed 7): the
# noise's largest value. Drawn from 24 bits it rounded to 1.0 in float32, -log(1.0) = 0, and the race gave
# that token an infinite score however unlikely it was (about one sample in 340 over 49,152 tokens).
TOP_NOISE = (7, 309, 10981)


@pytest.mark.parametrize("build", list(BUILDS))
def test_the_largest_noise_stays_below_one_and_never_picks_an_unlikely_token(build):
    seed, offset, token = TOP_NOISE
    u = uniform_noise(torch.tensor([seed]), torch.tensor([offset]), VOCAB)[0]
    assert u.max() < 1.0 and u[token] == u.max()
    lib = _library(build)
    logits = torch.zeros(1, VOCAB)
    logits[0, token] = -80.0  # e^-80 of the others' probability
    got = sample(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.tensor([seed]),
                 torch.tensor([offset]), 1, lib=lib)
    assert got.item() != token
    assert sample_tokens(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1),
                         torch.tensor([seed]), torch.tensor([offset]), filter_top=False).item() != token


def _masked(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits with every token its mask forbids at -inf (the torch path's bitmask application)."""
    return logits.masked_fill(~unpack_bitmask(masks, logits.shape[1]), float("-inf"))


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("vocab", [VOCAB, 1000 + 7])  # a whole number of 16-token groups, and a ragged tail
def test_sampling_under_a_mask_gives_the_masked_rows_tokens(build, vocab):
    """sample_masked(rows, masks) == sample(logits with forbidden tokens at -inf)[rows], token for token:
    masks of one token, a few scattered ones, a block, most of the vocabulary, the tail's last tokens."""
    lib = _library(build)
    g = torch.Generator().manual_seed(vocab)
    b, words = 9, (vocab + 31) // 32
    logits = 3 * torch.randn(b, vocab, generator=g)
    allowed = torch.zeros(b, vocab, dtype=torch.bool)
    allowed[0, 5] = True
    allowed[1, torch.randint(0, vocab, (12,), generator=g)] = True
    allowed[2, 100:400] = True
    allowed[3] = torch.rand(vocab, generator=g) < 0.9
    allowed[4, vocab - 3:] = True
    allowed[5, [3, 700]] = True
    logits[5, 3] = logits[5, 700] = logits.max() + 1  # a tie among the allowed: the lower index wins
    allowed[6] = True
    allowed[7, torch.randint(0, vocab, (40,), generator=g)] = True
    allowed[8, 16:32] = True
    bits = (allowed.to(torch.int64).view(b, -1)
            if vocab % 32 == 0 else torch.nn.functional.pad(allowed.to(torch.int64), (0, 32 * words - vocab)))
    masks = (bits.view(b, words, 32) << torch.arange(32)).sum(-1).to(torch.int64)
    masks = torch.where(masks >= 2**31, masks - 2**32, masks).to(torch.int32)  # llguidance's int32 words
    rows = torch.tensor([8, 0, 3, 1, 5, 2, 4, 7, 6])
    for temp in (0.0, 0.7, 1.3):
        seeds, offsets = torch.randint(0, 2**62, (b,), generator=g), torch.randint(0, 10_000, (b,), generator=g)
        want = sample(_masked(logits, masks)[rows], torch.full((b,), temp), torch.zeros(b, dtype=torch.int64),
                      torch.ones(b), seeds, offsets, 1, lib=lib)
        got = sample_masked(logits, rows, masks[rows], torch.full((b,), temp), seeds, offsets, lib=lib)
        assert got.tolist() == want.tolist(), temp
        assert all(bool(allowed[r, t]) for r, t in zip(rows.tolist(), got.tolist()))
    with pytest.raises(ValueError, match="allows no token"):
        sample_masked(logits, rows[:1], torch.zeros(1, words, dtype=torch.int32), torch.ones(1),
                      seeds[:1], offsets[:1], lib=lib)


@pytest.mark.parametrize("build", list(BUILDS))
def test_greedy_takes_the_first_maximum_at_any_vocabulary_size(build):
    """The vector argmax (16 lanes on AVX-512, 8 on AVX2) and its scalar tail: the maximum anywhere, ties
    to the lowest index, rows whose length is no multiple of the vector."""
    lib = _library(build)
    g = torch.Generator().manual_seed(5)
    for v in (3, 8, 17, 1003, 128256 + 5):
        for at in sorted({0, v // 2, v - 1}):
            logits = torch.randn(2, v, generator=g)
            logits[0, at] = logits[1, at] = 10.0
            logits[1, v - 1] = 10.0  # a tie: the lower index wins
            params = (torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
                      torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
            assert sample(logits, *params, 1, lib=lib).tolist() == [at, at], (v, at)
