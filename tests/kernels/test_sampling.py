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


# -- logit controls and logprobs (the same functions serve the CPU sampler and the device sampler) ------

def _controls(dev):
    from kernels.sampling import LogitsControls

    def t(v, dtype=torch.int64):
        return torch.tensor(v, dtype=dtype, device=dev)

    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 0b1011  # row 1 may only take tokens 0, 1 and 3
    mask[1, 1] = 1 << 3  # row 3 only token 35
    return LogitsControls(
        bias_rows=t([0, 0]), bias_tokens=t([4, 7]), bias_values=t([5.0, -100.0], torch.float32),
        ban_rows=t([2, 3]), ban_tokens=t([9, 35]),
        rep_rows=t([2, 2]), rep_tokens=t([1, 2]), rep_penalty=t([1.5, 1.5], torch.float32),
        pen_rows=t([0]), pen_tokens=t([3]), pen_values=t([2.5], torch.float32),
        guided_rows=t([1, 3]), bitmask=mask.to(dev))


def test_logit_controls_apply_each_control_to_its_rows_only():
    from kernels.sampling import apply_logits_controls

    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    logits[2, 1], logits[2, 2] = 3.0, -3.0
    out = apply_logits_controls(logits.to(DEV), _controls(DEV)).cpu()
    want = logits.clone()
    want[0, 4] += 5.0
    want[0, 7] -= 100.0
    want[0, 3] -= 2.5
    want[1, [i for i in range(40) if i not in (0, 1, 3)]] = float("-inf")
    want[2, 9] = float("-inf")
    want[2, 1], want[2, 2] = 2.0, -4.5
    want[3] = torch.where(torch.arange(40) == 35, logits[3], float("-inf"))  # the ban would empty the row
    torch.testing.assert_close(out, want)
    assert torch.equal(out[4], logits[4])


def test_logit_controls_and_logprobs_never_synchronise(monkeypatch):
    from kernels.sampling import apply_logits_controls, token_logprobs

    def boom(*a, **k):
        raise AssertionError("synchronised with the host")

    logits = torch.randn(5, 40, device=DEV)
    controls = _controls(DEV)
    temps, top_k, top_p, seeds, offsets = _tensors(*_params(5))
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    processed = apply_logits_controls(logits, controls)
    tokens = sample_tokens(processed, temps, top_k, top_p, seeds, offsets)
    lp, top_lp, top_ids = token_logprobs(processed, temps, top_k, top_p, tokens, 4)
    monkeypatch.undo()
    assert lp.shape == (5,) and top_lp.shape == top_ids.shape == (5, 4)


def test_token_logprobs_are_the_sampled_distribution():
    from kernels.sampling import token_logprobs

    torch.manual_seed(2)
    logits = torch.randn(3, 30, device=DEV)
    temps = torch.tensor([0.0, 0.5, 1.0], device=DEV)
    top_k = torch.tensor([0, 0, 3], device=DEV)
    top_p = torch.ones(3, device=DEV)
    tokens = logits.argmax(-1)
    lp, top_lp, top_ids = token_logprobs(logits, temps, top_k, top_p, tokens, 5)
    want0 = logits[0].log_softmax(-1)  # greedy: the plain log_softmax
    torch.testing.assert_close(top_lp[0], want0.topk(5).values)
    torch.testing.assert_close(lp[0], want0.max())
    torch.testing.assert_close(top_lp[1], (logits[1] / 0.5).log_softmax(-1).topk(5).values)
    # top_k 3: the distribution sampled from has three tokens; the rest are excluded (-inf)
    torch.testing.assert_close(top_lp[2, :3], logits[2].topk(3).values.log_softmax(-1))
    assert torch.isinf(top_lp[2, 3:]).all()
    assert top_ids[:, 0].tolist() == tokens.tolist()


def test_unpack_bitmask_matches_llguidance_layout():
    import numpy as np
    from llguidance.numpy import apply_token_bitmask_inplace

    from kernels.sampling import unpack_bitmask

    rng = np.random.default_rng(0)
    mask = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    logits = np.zeros((3, 100), dtype=np.float32)
    apply_token_bitmask_inplace(logits, mask)
    assert torch.equal(unpack_bitmask(torch.from_numpy(mask), 100), torch.from_numpy(logits == 0))


def test_bitmask_bias_is_the_unpacked_mask():
    from kernels.sampling import bitmask_bias, unpack_bitmask

    g = torch.Generator().manual_seed(3)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=g)
    bias = bitmask_bias(mask.to(DEV), 150).cpu()
    allowed = unpack_bitmask(mask, 150)
    assert torch.equal(bias == 0, allowed) and torch.equal(bias == float("-inf"), ~allowed)
