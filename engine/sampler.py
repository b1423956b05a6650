"""Turns logits into next tokens: greedy, temperature, top-k, top-p, and per-request seeds.

Sampling uses the exponential race (argmax of p / q with q ~ Exp(1)), which draws exactly one
random number per vocabulary entry per row: a seeded request gets its own random stream and so the
same output whatever else is in the batch. On a CPU the stream is a torch.Generator per request (the
cheapest there); on CUDA it is `kernels.sample_tokens`, whose noise is a hash of (seed, token index),
so sampling needs no host synchronisation and a resumed request simply continues at its index.
"""

from __future__ import annotations

import torch

from kernels.sampling import filter_top_k_top_p, sample_tokens

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator | None = None) -> list[int]:
    """logits: [B, vocab] float32, one row per sequence in `seqs`."""
    if logits.is_cuda:
        return sample_on_device(logits, seqs).tolist()
    temps = [s.sampling.temperature for s in seqs]
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temps):
        return greedy.tolist()
    device = logits.device
    t = torch.tensor([max(x, 1e-5) for x in temps], device=device)
    scaled = logits / t[:, None]
    top_k = torch.tensor([s.sampling.top_k for s in seqs], device=device)
    top_p = torch.tensor([s.sampling.top_p for s in seqs], device=device, dtype=torch.float32)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, s in enumerate(seqs):
        noise[i].exponential_(generator=s.generator if s.generator is not None else generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([x == 0 for x in temps], device=device)
    return torch.where(is_greedy, greedy, sampled).tolist()


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Sampled token ids [B] on the logits' device; parameters travel as tensors, nothing waits on the GPU."""
    dev = logits.device
    sp = [s.sampling for s in seqs]
    filter_top = any(p.top_k > 0 or p.top_p < 1.0 for p in sp if p.temperature > 0)

    def t(values, dtype):
        return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

    return sample_tokens(logits, t([p.temperature for p in sp], torch.float32), t([p.top_k for p in sp], torch.int64),
                         t([p.top_p for p in sp], torch.float32), t([s.noise_seed for s in seqs], torch.int64),
                         t([len(s.output_token_ids) for s in seqs], torch.int64), filter_top=filter_top)
