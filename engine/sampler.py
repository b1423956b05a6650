"""Turns logits into next tokens: logit controls, greedy, temperature, top-k, top-p, per-request seeds,
and logprobs.

First the per-row logit controls (`logits_controls` gathers them from the sequences on the host;
`kernels.sampling.apply_logits_controls` applies them): a grammar's token mask, logit_bias, the
min_tokens ban on stop tokens, repetition / frequency / presence penalties. Only rows that use a control
add entries, and a batch without any skips the pass.

Sampling uses the exponential race (argmax of p / q with q ~ Exp(1)) with `kernels.sample_tokens`'s
noise, a hash of (seed, token index, vocabulary index): a seeded request gets the same output
whatever else is in the batch, and a resumed request simply continues at its index. On CUDA it runs
as device ops (no host synchronisation); on a CPU the native kernel (kernels/cpu) computes the same
tokens row by row from a few hundred candidates instead of sorting and drawing 49k values per row
(torch ops where the runner's `CpuKernels` says native kernels do not run).

Logprobs ("processed", like vLLM's `processed_logprobs`) are the log-softmax of the distribution each
token was actually sampled from: after the controls, temperature and top-k/top-p (greedy rows: of the
processed logits), computed only for the rows that ask, from full-precision logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.cpu as cpu_kernels
from kernels.sampling import LogitsControls, apply_logits_controls, sample_tokens, token_logprobs

from .cpu_plan import CpuKernels
from .guide import Guides
from .request import TokenLogprob, finite_logprob
from .sequence import Sequence


@dataclass
class Sampled:
    token: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


def sample(logits: torch.Tensor, seqs: list[Sequence], guides: Guides | None, kernels: CpuKernels) -> list[Sampled]:
    """logits: [B, vocab] float32, one row per sequence in `seqs`; `kernels`: the runner's kernel choice."""
    native = logits.device.type == "cpu" and kernels.native
    checked = {i for i, s in enumerate(seqs) if s.guide is not None and _check_first(s)} if native else set()
    controls = logits_controls(seqs, logits.device, guides, unmasked=checked)
    if controls is not None:
        logits = apply_logits_controls(logits, controls)
    tokens = _sample_native(logits, seqs, kernels.threads) if native else _sample_device(logits, seqs)
    if checked:
        tokens = _enforce_grammars(logits, seqs, tokens, sorted(checked), guides)
    rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    if not rows:
        return [Sampled(t) for t in tokens.tolist()]
    k = max(seqs[i].sampling.logprobs or 0 for i in rows)
    idx = _tensor(rows, torch.int64, logits.device)
    sp = [seqs[i].sampling for i in rows]
    lp, top_lp, top_ids = token_logprobs(
        logits.index_select(0, idx), _tensor([p.temperature for p in sp], torch.float32, logits.device),
        _tensor([p.top_k for p in sp], torch.int64, logits.device),
        _tensor([p.top_p for p in sp], torch.float32, logits.device), tokens.index_select(0, idx), k,
        filter_top=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in sp))
    out = [Sampled(t) for t in tokens.tolist()]  # the one host synchronisation, with the logprobs below
    for i, v, vs, ids in zip(rows, lp.tolist(), top_lp.tolist(), top_ids.tolist()):
        n = seqs[i].sampling.logprobs or 0
        out[i].logprob = TokenLogprob(out[i].token, finite_logprob(v), ids[:n], [finite_logprob(x) for x in vs[:n]])
    return out


def _check_first(seq: Sequence) -> bool:
    """Whether a guided row may be sampled without its mask and checked afterwards: when its sampling
    picks the best candidate of a race that masking only shortens (greedy, or temperature without top-k
    or top-p), a winner the grammar allows is also the winner under the mask. Logprobs need the masked
    distribution itself."""
    sp = seq.sampling
    return sp.logprobs is None and (sp.temperature == 0 or (sp.top_k <= 0 and sp.top_p >= 1.0))


def _enforce_grammars(logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor, rows: list[int],
                      guides: Guides | None) -> torch.Tensor:
    """Rows sampled before their grammar mask: each token the grammar allows stands (a cheap check of one
    token instead of a mask over the vocabulary); the others are sampled again under their masks, with
    the same noise, so the result is exactly the masked sampler's."""
    if guides is None:
        raise ValueError("guided sequences need the engine's Guides to compute their token masks")
    ids = tokens.tolist()
    rejected = [i for i in rows if not guides.allows(seqs[i].guide, ids[i])]  # type: ignore[arg-type]
    if not rejected:
        return tokens
    sub = [seqs[i] for i in rejected]
    masks = guides.fill_bitmask([s.guide for s in sub if s.guide is not None])
    idx = torch.tensor(rejected, dtype=torch.int64)
    tokens = tokens.clone()
    tokens[idx] = cpu_kernels.sample_masked(  # only the tokens each mask allows are raced
        logits, idx, masks, torch.tensor([s.sampling.temperature for s in sub], dtype=torch.float32),
        torch.tensor([s.noise_seed for s in sub], dtype=torch.int64),
        torch.tensor([len(s.output_token_ids) for s in sub], dtype=torch.int64))
    return tokens


def _sample_native(logits: torch.Tensor, seqs: list[Sequence], threads: int) -> torch.Tensor:
    sp = [s.sampling for s in seqs]
    f32, i64 = torch.float32, torch.int64
    return cpu_kernels.sample(
        logits, torch.tensor([p.temperature for p in sp], dtype=f32), torch.tensor([p.top_k for p in sp], dtype=i64),
        torch.tensor([p.top_p for p in sp], dtype=f32), torch.tensor([s.noise_seed for s in seqs], dtype=i64),
        torch.tensor([len(s.output_token_ids) for s in seqs], dtype=i64), threads)


def _sample_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    dev = logits.device
    sp = [s.sampling for s in seqs]
    if all(p.temperature == 0 for p in sp):
        # Every row greedy (the host knows): the argmax alone. The race's noise is a dozen elementwise
        # launches over [B, vocab]; on an H200 they were 2 of the 2.2 ms of a batch-1 greedy decode step.
        return logits.float().argmax(dim=-1)
    filter_top = any(p.top_k > 0 or p.top_p < 1.0 for p in sp if p.temperature > 0)
    return sample_tokens(logits, _tensor([p.temperature for p in sp], torch.float32, dev),
                         _tensor([p.top_k for p in sp], torch.int64, dev),
                         _tensor([p.top_p for p in sp], torch.float32, dev),
                         _tensor([s.noise_seed for s in seqs], torch.int64, dev),
                         _tensor([len(s.output_token_ids) for s in seqs], torch.int64, dev), filter_top=filter_top)


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], guides: Guides | None = None) -> torch.Tensor:
    """Sampled token ids [B] on the logits' device; parameters travel as tensors, nothing waits on the GPU."""
    controls = logits_controls(seqs, logits.device, guides)
    if controls is not None:
        logits = apply_logits_controls(logits, controls)
    return _sample_device(logits, seqs)


def _tensor(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def logits_controls(seqs: list[Sequence], device: torch.device, guides: Guides | None,
                    unmasked: set[int] | frozenset[int] = frozenset()) -> LogitsControls | None:
    """The batch's logit controls as tensors on `device` (None: no row uses any). Host work is per entry
    of the rows that use a control: their bias, their stop tokens while under min_tokens, their distinct
    seen/generated tokens (kept incrementally on the sequence), and one grammar mask per guided row
    (except the rows in `unmasked`, whose grammar is checked after sampling)."""
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    rep_rows: list[int] = []
    rep_tokens: list[int] = []
    rep_penalty: list[float] = []
    pen_rows: list[int] = []
    pen_tokens: list[int] = []
    pen_values: list[float] = []
    guided: list[int] = []
    for i, s in enumerate(seqs):
        sp = s.sampling
        if sp.logit_bias:
            bias_rows += [i] * len(sp.logit_bias)
            bias_tokens += sp.logit_bias.keys()
            bias_values += sp.logit_bias.values()
        if len(s.output_token_ids) < sp.min_tokens and s.stop_token_ids:
            ban_rows += [i] * len(s.stop_token_ids)
            ban_tokens += s.stop_token_ids
        if sp.repetition_penalty != 1 and s.seen_token_ids:
            rep_rows += [i] * len(s.seen_token_ids)
            rep_tokens += s.seen_token_ids.keys()
            rep_penalty += [sp.repetition_penalty] * len(s.seen_token_ids)
        if (sp.frequency_penalty != 0 or sp.presence_penalty != 0) and s.output_counts:
            pen_rows += [i] * len(s.output_counts)
            pen_tokens += s.output_counts.keys()
            pen_values += [sp.frequency_penalty * c + sp.presence_penalty for c in s.output_counts.values()]
        if s.guide is not None and i not in unmasked:
            guided.append(i)
    if not (bias_rows or ban_rows or rep_rows or pen_rows or guided):
        return None
    c = LogitsControls()
    i64, f32 = torch.int64, torch.float32
    if bias_rows:
        c.bias_rows, c.bias_tokens = _tensor(bias_rows, i64, device), _tensor(bias_tokens, i64, device)
        c.bias_values = _tensor(bias_values, f32, device)
    if ban_rows:
        c.ban_rows, c.ban_tokens = _tensor(ban_rows, i64, device), _tensor(ban_tokens, i64, device)
    if rep_rows:
        c.rep_rows, c.rep_tokens = _tensor(rep_rows, i64, device), _tensor(rep_tokens, i64, device)
        c.rep_penalty = _tensor(rep_penalty, f32, device)
    if pen_rows:
        c.pen_rows, c.pen_tokens = _tensor(pen_rows, i64, device), _tensor(pen_tokens, i64, device)
        c.pen_values = _tensor(pen_values, f32, device)
    if guided:
        if guides is None:
            raise ValueError("guided sequences need the engine's Guides to compute their token masks")
        matchers = [g for g in (seqs[i].guide for i in guided) if g is not None]
        c.guided_rows = _tensor(guided, i64, device)
        c.bitmask = guides.fill_bitmask(matchers, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return c
