"""A sampler that never waits on the host: greedy, temperature, top-k and top-p in device ops only.

`sample_tokens(logits, temperature, top_k, top_p, seeds, offsets)` takes every per-row parameter as a
tensor on the logits' device and returns the tokens as a device tensor: no `.item()`, `.tolist()`,
`bool(tensor)` or data-dependent shapes, so it can sit inside a captured CUDA graph and the host only
synchronises when it finally reads the tokens.

Sampling is the exponential race (argmax of p / q, q ~ Exp(1)) with the noise drawn by a counter-based
hash of (row seed, row offset, vocabulary index) instead of a stateful generator: a row's token depends
only on its own logits, parameters, seed and offset (e.g. its number of generated tokens), never on the
rest of the batch, and the same request replays identically. Semantics of the filters match
`engine.sampler`: temperature 0 is greedy; top_k <= 0 means off; top_p keeps the smallest prefix of the
sorted distribution whose mass before each kept token is < top_p (the first token always stays).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without ever overflowing int64."""
    lo = (x & _M16) * c
    hi = (((x >> 16) * c) & _M16) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash (Chris Wellons), on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, vocab] in (0, 1), a pure function of (seed, offset, column)."""
    seeds = seeds.to(torch.int64)
    offsets = offsets.to(torch.int64)
    key = _mix32((seeds & _M32) ^ 0x9E3779B9)
    key = _mix32(key ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (offsets & _M32))
    key = _mix32(key ^ ((offsets >> 32) & _M32) ^ 0x85EBCA6B)
    col = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _mix32(key[:, None] ^ col[None, :])
    x = _mix32(x ^ 0x27D4EB2F)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k / top-p masking with per-row parameters, all on the device (used by both samplers)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    cut = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token: the first token always stays
    cut |= cum >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, offsets: torch.Tensor, filter_top: bool = True) -> torch.Tensor:
    """logits [B, V] float32; temperature/top_p [B] float32; top_k/seeds/offsets [B] int64. Returns [B] int64.

    `filter_top=False` skips the top-k/top-p sort: the host knows from the requests' parameters when no
    row filters (and can capture both variants in CUDA graphs); results are the same when no row filters.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=1e-5)[:, None]
    if filter_top:
        scaled = filter_top_k_top_p(scaled, top_k, top_p.float())
    probs = scaled.softmax(dim=-1)
    q = -torch.log(uniform_noise(seeds, offsets, logits.shape[-1]))
    sampled = (probs / q).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)


def sample_tokens_ref(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                      seeds: list[int], offsets: list[int]) -> list[int]:
    """Row-by-row reference with host control flow (and the same noise function)."""
    out = []
    for i in range(logits.shape[0]):
        row = logits[i].float()
        if temperature[i] == 0:
            out.append(int(row.argmax()))
            continue
        scaled = row / max(temperature[i], 1e-5)
        vocab = row.shape[0]
        vals, order = scaled.sort(descending=True)
        k = top_k[i] if 0 < top_k[i] < vocab else vocab
        keep = torch.zeros(vocab, dtype=torch.bool)
        p = vals.softmax(-1)
        before = 0.0
        for r in range(k):
            if r > 0 and before >= top_p[i]:
                break
            keep[r] = True
            before += float(p[r])
        masked = torch.full_like(scaled, float("-inf"))
        masked[order[keep]] = scaled[order[keep]]
        probs = masked.softmax(-1)
        u = uniform_noise(torch.tensor([seeds[i]]), torch.tensor([offsets[i]]), vocab)[0]
        out.append(int((probs / -torch.log(u)).argmax()))
    return out
