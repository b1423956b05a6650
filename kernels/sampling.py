"""A sampler that never waits on the host: greedy, temperature, top-k and top-p in device ops only.

`sample_tokens(logits, temperature, top_k, top_p, seeds, offsets)` takes every per-row parameter as a
tensor on the logits' device and returns the tokens as a device tensor: no `.item()`, `.tolist()`,
`bool(tensor)` or data-dependent shapes, so it can sit inside a captured CUDA graph and the host only
synchronises when it finally reads the tokens.

Before sampling, `apply_logits_controls` applies the per-row logit controls (logit_bias, min_tokens bans,
repetition / frequency / presence penalties, a grammar's token bitmask) from a `LogitsControls` of
host-built tensors, and `token_logprobs` gives the logprobs of the distribution that was sampled from:
both in device ops only too (shapes come from the host's inputs, never from device values).

Sampling is the exponential race (argmax of p / q, q ~ Exp(1)) with the noise drawn by a counter-based
hash of (row seed, row offset, vocabulary index) instead of a stateful generator: a row's token depends
only on its own logits, parameters, seed and offset (e.g. its number of generated tokens), never on the
rest of the batch, and the same request replays identically. Semantics of the filters match
`engine.sampler`: temperature 0 is greedy; top_k <= 0 means off; top_p keeps the smallest prefix of the
sorted distribution whose mass before each kept token is < top_p (the first token always stays).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # 23 bits: (2^23 - 0.5) / 2^23 is a float32 below 1. With 24 bits the top value rounded to 1.0, whose
    # -log is 0, and the race gave that token (however unlikely) an infinite score: 1 sample in ~340.
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


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


@dataclass
class LogitsControls:
    """Per-row logit controls of one batch, as flat (row, token) lists on the logits' device.

    Only rows that use a control have entries; a field left None means no row of the batch uses it. The
    (row, token) pairs of each list are unique. Built by the host (`engine.sampler`), applied on the
    device by `apply_logits_controls`."""

    bias_rows: torch.Tensor | None = None  # int64 [N]: logit_bias
    bias_tokens: torch.Tensor | None = None  # int64 [N]
    bias_values: torch.Tensor | None = None  # float32 [N], added
    ban_rows: torch.Tensor | None = None  # int64 [M]: set to -inf (min_tokens: the stop tokens)
    ban_tokens: torch.Tensor | None = None
    rep_rows: torch.Tensor | None = None  # int64 [R]: repetition penalty over prompt + output tokens
    rep_tokens: torch.Tensor | None = None
    rep_penalty: torch.Tensor | None = None  # float32 [R], the row's penalty (> 0)
    pen_rows: torch.Tensor | None = None  # int64 [P]: frequency / presence penalty over generated tokens
    pen_tokens: torch.Tensor | None = None
    pen_values: torch.Tensor | None = None  # float32 [P]: frequency * count + presence, subtracted
    guided_rows: torch.Tensor | None = None  # int64 [G]: rows constrained by a grammar
    bitmask: torch.Tensor | None = None  # int32 [G, ceil(vocab / 32)]: bit t % 32 of word t // 32 = allowed


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [G, W] bitmask (llguidance's layout) -> bool [G, vocab], True where the token is allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab].bool()


_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


def bitmask_bias(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [G, W] bitmask -> float32 [G, vocab]: 0 where the token is allowed, -inf where not.

    A lookup of each byte in a 256 x 8 table (token t is bit t % 8 of byte t // 8 of the little-endian
    words): an embedding gather and one add, several times cheaper than a masked_fill / where with a
    random boolean mask, which branches per element on a CPU."""
    table = _BYTE_TABLES.get(bitmask.device)
    if table is None:
        bits = (torch.arange(256, device=bitmask.device)[:, None] >> torch.arange(8, device=bitmask.device)) & 1
        table = _BYTE_TABLES[bitmask.device] = torch.zeros(256, 8, device=bitmask.device).masked_fill_(
            bits == 0, float("-inf"))
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [G, 4W]
    return torch.nn.functional.embedding(as_bytes, table).flatten(1)[:, :vocab]


def apply_logits_controls(logits: torch.Tensor, c: LogitsControls) -> torch.Tensor:
    """float32 logits [B, V] -> the processed logits (a new tensor; the input is not modified).

    Order: the grammar mask, logit_bias, bans, repetition penalty, frequency/presence penalties (-inf
    stays -inf through all of them). A row the bans would leave with no token at all (min_tokens against
    a grammar that only allows a stop token) keeps its grammar-masked logits instead."""
    out = logits.float().clone()
    if c.guided_rows is not None and c.bitmask is not None:
        out.index_add_(0, c.guided_rows, bitmask_bias(c.bitmask, out.shape[-1]))
    fallback = out.clone() if c.ban_rows is not None and c.guided_rows is not None else None
    if c.bias_rows is not None and c.bias_tokens is not None and c.bias_values is not None:
        out.index_put_((c.bias_rows, c.bias_tokens), c.bias_values, accumulate=True)
    if c.ban_rows is not None and c.ban_tokens is not None:
        out.index_put_((c.ban_rows, c.ban_tokens), out.new_full((), float("-inf")))
    if c.rep_rows is not None and c.rep_tokens is not None and c.rep_penalty is not None:
        vals = out[c.rep_rows, c.rep_tokens]
        out[c.rep_rows, c.rep_tokens] = torch.where(vals > 0, vals / c.rep_penalty, vals * c.rep_penalty)
    if c.pen_rows is not None and c.pen_tokens is not None and c.pen_values is not None:
        out.index_put_((c.pen_rows, c.pen_tokens), -c.pen_values, accumulate=True)
    if fallback is not None:
        dead = out.amax(dim=-1, keepdim=True) == float("-inf")
        out = torch.where(dead, fallback, out)
    return out


def distribution_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, filter_top: bool = True) -> torch.Tensor:
    """The (unnormalised) log-distribution each row samples from: logits / temperature after top-k/top-p;
    temperature 0 rows (greedy) keep their logits as they are. `filter_top=False`: as in `sample_tokens`."""
    logits = logits.float()
    scaled = logits / temperature.clamp(min=1e-5)[:, None]
    if filter_top:
        scaled = filter_top_k_top_p(scaled, top_k, top_p.float())
    return torch.where((temperature == 0)[:, None], logits, scaled)


def token_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   tokens: torch.Tensor, k: int,
                   filter_top: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the sampled `tokens` [R] and each row's top k: (float32 [R], float32 [R, k], int64 [R, k]).

    `logits` are the processed full-precision logits of the R rows that want logprobs; excluded tokens
    come out as -inf (the host clamps them for JSON)."""
    lp = distribution_logits(logits, temperature, top_k, top_p, filter_top).log_softmax(dim=-1)
    top = lp.topk(k, dim=-1)
    return lp.gather(1, tokens[:, None]).squeeze(1), top.values, top.indices
