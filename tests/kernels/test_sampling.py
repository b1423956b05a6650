"""The sync-free sampler: same tokens as the row-by-row reference, no host synchronisation, batch invariance."""

import math

import torch

from kernels.sampling import sample_tokens, sample_tokens_ref, uniform_noise

from .conftest import DEV


def _params(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    temps = [0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.5][:b]
    top_k = [0, 0, 5, 0, 3, 1, 20, 0][:b]
    top_p = [1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 0.8, 0.95][:b]
    seeds = [int(x) for x in torch.randint(0, 2**62, (b,), generator=g)]
    offsets = list(range(b))
    return temps, top_k, top_p, seeds, offsets


def _tensors(temps, top_k, top_p, seeds, offsets):
    return (torch.tensor(temps, device=DEV), torch.tensor(top_k, device=DEV),
            torch.tensor(top_p, device=DEV), torch.tensor(seeds, device=DEV), torch.tensor(offsets, device=DEV))


def test_matches_reference():
    torch.manual_seed(0)
    logits = 3 * torch.randn(8, 50)
    params = _params(8)
    for step in range(4):
        offsets = [o + 10 * step for o in params[4]]
        p = (*params[:4], offsets)
        got = sample_tokens(logits.to(DEV), *_tensors(*p))
        assert got.tolist() == sample_tokens_ref(logits, *p)
    greedy = sample_tokens(logits.to(DEV), *_tensors(*params))
    assert greedy[0] == logits[0].argmax() and greedy[4] == logits[4].argmax()
    assert greedy[5] == logits[5].argmax()  # top_k 1 is greedy whatever the temperature


def test_no_host_sync(monkeypatch):
    """Every value that would need the host (item, tolist, bool, int, float) is forbidden inside."""
    def boom(*a, **k):
        raise AssertionError("sample_tokens synchronised with the host")

    logits = torch.randn(8, 50, device=DEV)
    args = _tensors(*_params(8))
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    out = sample_tokens(logits, *args)
    monkeypatch.undo()
    assert out.shape == (8,) and out.dtype == torch.int64


def test_row_independent_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    params = _params(8)
    full = sample_tokens(logits.to(DEV), *_tensors(*params)).tolist()
    for i in range(8):
        single = sample_tokens(logits[i:i + 1].to(DEV), *_tensors(*[[x[i]] for x in params]))
        assert single.tolist() == [full[i]]


def test_distribution_and_filters():
    """2000 draws from one row (different offsets) follow the softmax; top-k/top-p restrict the support."""
    n, vocab = 2000, 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(n, vocab).contiguous().to(DEV)
    temps = torch.ones(n, device=DEV)
    seeds = torch.full((n,), 1234, device=DEV)
    offsets = torch.arange(n, device=DEV)
    no_k, no_p = torch.zeros(n, dtype=torch.long, device=DEV), torch.ones(n, device=DEV)
    counts = torch.bincount(sample_tokens(logits, temps, no_k, no_p, seeds, offsets).cpu(), minlength=vocab).float()
    expected = logits[0].float().softmax(-1).cpu() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25, (counts, expected)  # 5 degrees of freedom: p < 1e-4
    top2 = sample_tokens(logits, temps, torch.full_like(no_k, 2), no_p, seeds, offsets)
    assert set(top2.tolist()) == {0, 1}
    # softmax mass: 0.55, 0.20, 0.12, ...: top_p 0.7 keeps tokens 0 and 1 (mass before token 2 is 0.75)
    topp = sample_tokens(logits, temps, no_k, torch.full_like(no_p, 0.7), seeds, offsets)
    assert set(topp.tolist()) == {0, 1}


def test_noise_is_uniform_and_deterministic():
    u = uniform_noise(torch.tensor([7, 2**40 + 3]), torch.tensor([0, 5]), 4096)
    assert torch.equal(u, uniform_noise(torch.tensor([7, 2**40 + 3]), torch.tensor([0, 5]), 4096))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.var()) - 1 / 12) < 0.01
    assert not torch.equal(u[0], u[1])
    assert math.isclose(float((-torch.log(u)).mean()), 1.0, abs_tol=0.05)
