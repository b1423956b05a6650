"""The native CPU sampler (kernels/cpu `sample`) against kernels.sampling's torch sampler: the same
tokens (the same noise, temperature, top-k and top-p semantics), on a real vocabulary's size, for every
build of forward.c this CPU runs: the candidate path, the wide-nucleus path and the unfiltered race."""

import pytest
import torch

from kernels.cpu import build as cpu_build
from kernels.cpu import sample
from kernels.sampling import sample_tokens, uniform_noise

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
