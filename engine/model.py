"""The Llama forward pass, read top to bottom (gpt-fast style); the ops come from `kernels` (torch on a
CPU, Triton on CUDA).

One forward handles a flat batch of tokens from many sequences (decodes and prefill chunks mixed):
the linear layers see `[num_tokens, hidden]`, and attention reads each sequence's keys and values
from the paged KV cache through `AttentionMetadata`. Q/K/V and gate/up are fused into one matmul
each: on a CPU the number of ops per step matters as much as their size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionMetadata, fused_add_rms_norm, paged_attention, rms_norm, rotary_inplace, silu_and_mul

from . import batch_invariant
from .loader import ModelArgs


def rope_tables(args: ModelArgs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [max_positions, head_dim // 2]; llama3-style frequency scaling when configured."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    t = torch.arange(args.max_position_embeddings, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos().float().to(device), freqs.sin().float().to(device)


REFINE_TOP = 16  # output-layer candidates per row recomputed at full precision


class Linear:
    """y = x W^T (+ b), with W stored in its own dtype (bf16 halves the bytes a CPU decode step reads);
    the activations stay in the model's dtype, so the residual stream and the norms keep full precision."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: torch.dtype,
                 invariant: bool = False):
        self.weight = weight.to(weight_dtype).contiguous()
        self.bias = bias
        self.invariant = invariant  # fixed-shape matmuls: a row's result ignores the rest of the batch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            y = batch_invariant.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        else:
            y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y + self.bias if self.bias is not None else y


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, weight_dtype: torch.dtype | None = None, deterministic: bool = False):
        super().__init__()
        self.args = args
        wdt = weight_dtype or dtype
        self.dtype = dtype
        # EngineConfig.deterministic: batch-invariant matmuls and attention (engine/batch_invariant.py).
        self.deterministic = det = deterministic
        self.attention = batch_invariant.paged_attention if det else paged_attention

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        lm_head = self.embed if args.tie_word_embeddings else w("lm_head.weight")
        # The output layer reads as many bytes as a third of the model. With bf16 weights it runs in
        # bf16 too, and each row's top candidates are then recomputed at full precision, so near-ties
        # between the likeliest tokens (all that greedy, top-k and top-p look at) are decided exactly;
        # bf16 alone flips such ties.
        self.lm_head = Linear(lm_head, None, dtype, det)
        # (Not in deterministic mode: the output layer stays one full-precision batch-invariant matmul.)
        self.lm_head_fast = Linear(lm_head, None, wdt) if wdt != dtype and not det else None
        self.layers: list[LayerWeights] = []
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            qkv_bias = (torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                        if args.attention_bias else None)
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], dim=0)
            self.layers.append(LayerWeights(
                attn_norm=w(p + "input_layernorm.weight"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                qkv=Linear(qkv, qkv_bias, wdt, det),
                o=Linear(w(p + "self_attn.o_proj.weight"), None, wdt, det),
                gate_up=Linear(gate_up, None, wdt, det),
                down=Linear(w(p + "mlp.down_proj.weight"), None, wdt, det),
            ))
        self.cos, self.sin = rope_tables(args, device)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if self.lm_head_fast is None or exact:
            return self.lm_head(h).float()
        logits = self.lm_head_fast(h).float()
        top = logits.topk(REFINE_TOP, dim=-1).indices  # [n, k]
        rows = self.lm_head.weight[top]  # [n, k, hidden], full precision
        return logits.scatter_(1, top, torch.einsum("nd,nkd->nk", h.to(rows.dtype), rows).float())

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor, exact_logits: bool = False) -> torch.Tensor:
        """token_ids/positions: [T]; kv_cache: [layers, 2, slots, kv_heads, head_dim].

        Returns float32 logits for the tokens at `logits_indices` only (the last token of each
        sequence that samples this step), so a long prefill never builds a [T, vocab] matrix.
        `exact_logits`: every logit at full precision (scoring and tests), not only the top candidates.
        """
        return self.logits(self.hidden(token_ids, positions, kv_cache, meta, logits_indices), exact_logits)

    @torch.inference_mode()
    def hidden(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """The final normalised hidden states at `logits_indices` ([n, hidden]): what `logits` multiplies."""
        a = self.args
        x = self.embed[token_ids]
        residual = None
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for i, layer in enumerate(self.layers):
            x, residual = fused_add_rms_norm(x, residual, layer.attn_norm, a.rms_norm_eps)
            qkv = layer.qkv(x)
            q = qkv[:, :q_size].unflatten(-1, (a.num_heads, a.head_dim))
            k = qkv[:, q_size:q_size + kv_size].unflatten(-1, (a.num_kv_heads, a.head_dim))
            v = qkv[:, q_size + kv_size:].unflatten(-1, (a.num_kv_heads, a.head_dim))
            rotary_inplace(q, k, self.cos, self.sin, positions)
            attn = self.attention(q, k, v, kv_cache[i, 0], kv_cache[i, 1], meta)
            x = layer.o(attn.reshape(-1, q_size))
            x, residual = fused_add_rms_norm(x, residual, layer.mlp_norm, a.rms_norm_eps)
            x = layer.down(silu_and_mul(layer.gate_up(x)))
        assert residual is not None  # set by the first layer
        return rms_norm((residual + x)[logits_indices], self.norm, a.rms_norm_eps)
