"""A BERT encoder's forward pass, read top to bottom (gpt-fast style): BERT, MiniLM, bge-small, e5-small
and gte-small all share it (post-norm layers, absolute positions, GELU, biases everywhere).

One forward takes a *packed* batch: the token ids of many inputs end to end, `[num_tokens]`, and a
`PackedBatch` saying where each input starts. The linear layers hold most of the work (12 * hidden^2
multiply-adds per token and layer, against 2 * length * hidden for attention's two products), and
they see `[num_tokens, hidden]`: no padding is ever multiplied there. Only attention needs the inputs
apart. It runs on a padded copy of Q/K/V (`[inputs, heads, longest, head_dim]`, one scatter in and
one gather out) with a key mask, as one call per layer: one attention call per input costs ~40 us of
dispatch each (x inputs x layers), and one block-diagonal mask over the whole pack computes
num_tokens^2 scores instead of inputs * longest^2. The scheduler hands over inputs of similar lengths,
so the padding attention sees is a few percent.

Q/K/V are one matmul (fused weight), and each linear layer with what follows it (GELU, the residual
addition) is one call (linear.py: oneDNN's fused epilogues on a CPU). The matmuls run in
`matmul_dtype`: bf16 where the CPU multiplies it natively (AVX512-BF16, AMX: twice float32's rate).
Then the residual stream is kept in bf16 too (LayerNorm statistics, softmax sums and pooling are
float32 inside torch's kernels): converting it back and forth cost 3% more time for no accuracy the
goal needs (cosine to the float32 forward 0.99992 either way). Measured on a 2-core AVX512-BF16 CPU,
MiniLM, 1024-token steps: linear layers ~60% of a step, attention ~20% (its softmax alone ~12%: with
head_dim 32 the scores cost as much as the products), the rest LayerNorm, embeddings and copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import Linear, onednn_fusion


@dataclass
class BertArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"  # gelu (erf), or gelu_new / gelu_pytorch_tanh (tanh approximation)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class PackedBatch:
    """Where each input of a packed forward sits: input i is tokens cu_seqlens[i]:cu_seqlens[i+1].

    `scatter`: each token's row in the padded `[inputs * longest]` layout attention uses, and
    `key_mask` `[inputs, 1, 1, longest]` (True: a real token), both None when every input has the same
    length (then the pack is already a dense `[inputs, longest]` block)."""

    cu_seqlens: torch.Tensor  # int64 [inputs + 1]
    positions: torch.Tensor  # int64 [num_tokens]: each token's position within its input
    longest: int
    scatter: torch.Tensor | None
    key_mask: torch.Tensor | None

    @property
    def num_inputs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @staticmethod
    def of(lengths: list[int], device: torch.device | str = "cpu") -> PackedBatch:
        n = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        torch.cumsum(n, 0, out=cu[1:])
        starts = torch.repeat_interleave(cu[:-1], n)
        positions = torch.arange(int(cu[-1])) - starts
        longest = max(lengths)
        scatter = key_mask = None
        if min(lengths) != longest:
            row = torch.repeat_interleave(torch.arange(len(lengths)), n)
            scatter = (row * longest + positions).to(device)
            key_mask = (torch.arange(longest)[None, :] < n[:, None]).view(len(lengths), 1, 1, longest).to(device)
        return PackedBatch(cu.to(device), positions.to(device), longest, scatter, key_mask)


class EncoderLayer:
    def __init__(self, w: Mapping[str, torch.Tensor], prefix: str, device: torch.device | str, dtype: torch.dtype,
                 fused: bool, rows: int):
        def get(name: str) -> torch.Tensor:
            return w[f"{prefix}.{name}"].float().to(device)

        def linear(name: str) -> Linear:
            return Linear(get(f"{name}.weight"), get(f"{name}.bias"), dtype, fused, rows)

        att = "attention.self"
        self.qkv = Linear(torch.cat([get(f"{att}.{p}.weight") for p in ("query", "key", "value")]),
                          torch.cat([get(f"{att}.{p}.bias") for p in ("query", "key", "value")]), dtype, fused, rows)
        self.out = linear("attention.output.dense")
        self.ln1 = get("attention.output.LayerNorm.weight"), get("attention.output.LayerNorm.bias")
        self.up, self.down = linear("intermediate.dense"), linear("output.dense")
        self.ln2 = get("output.LayerNorm.weight"), get("output.LayerNorm.bias")


class Bert:
    """The encoder: embeddings, then `num_layers` post-norm layers; returns every token's last hidden state."""

    def __init__(self, args: BertArgs, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 matmul_dtype: torch.dtype = torch.float32, rows: int = 1024):
        if args.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {args.hidden_act!r} is not supported (gelu, gelu_new, gelu_pytorch_tanh)")
        self.args = args
        self.dtype = matmul_dtype
        # torch's fused attention (flash) is the fastest CPU attention in float32 (2-3x two batched
        # matmuls at 64-256 tokens), but its bf16 path is slower than its float32 one, while bf16 batched
        # matmuls run on the bf16 units: 15-30% less time than flash at 32-256 tokens. On CUDA, flash.
        self.flash = matmul_dtype == torch.float32 or torch.device(device).type != "cpu"
        self.fused = onednn_fusion(matmul_dtype, torch.device(device))  # linear.py; `rows`: a step's usual size
        self.gelu_approximate = "none" if args.hidden_act == "gelu" else "tanh"

        def get(name: str) -> torch.Tensor:
            return weights[name].float().to(device)

        self.word_embeddings = get("embeddings.word_embeddings.weight")
        self.position_embeddings = get("embeddings.position_embeddings.weight")
        # Every input is one segment (type 0): its embedding is a constant added to every token.
        self.token_type_0 = get("embeddings.token_type_embeddings.weight")[0]
        self.ln_embed = get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias")
        self.layers = [EncoderLayer(weights, f"encoder.layer.{i}", device, matmul_dtype, self.fused, rows)
                       for i in range(args.num_layers)]

    def _norm(self, x: torch.Tensor, ln: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.args.hidden_size,), ln[0], ln[1], self.args.layer_norm_eps)

    def _attention(self, qkv: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """[num_tokens, 3 * hidden] -> [num_tokens, hidden]: each input attends to its own tokens only."""
        a = self.args
        b, n = batch.num_inputs, batch.longest
        if batch.scatter is not None:
            padded = qkv.new_zeros(b * n, qkv.shape[1])
            padded.index_copy_(0, batch.scatter, qkv)
            qkv = padded
        q, k, v = qkv.view(b, n, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.flash:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask)  # [b, heads, n, head_dim]
        else:
            o = self._matmul_attention(q, k, v, batch.key_mask)
        o = o.transpose(1, 2).reshape(b * n, a.hidden_size)
        return o if batch.scatter is None else o.index_select(0, batch.scatter)

    def _matmul_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          key_mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + mask) v as two batched matmuls, the scores in memory
        ([inputs * heads, longest, longest]: ~6 MB at 1024 tokens of 256-token inputs)."""
        b, heads, n, d = q.shape
        q, k, v = (t.reshape(b * heads, n, d) for t in (q, k, v))
        if key_mask is None:
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(d ** -0.5)
        else:
            bias = torch.zeros(b, 1, n, dtype=q.dtype, device=q.device).masked_fill_(~key_mask.view(b, 1, n),
                                                                                       float("-inf"))
            scores = torch.baddbmm(bias.repeat_interleave(heads, 0), q, k.transpose(1, 2), alpha=d ** -0.5)
        return torch.bmm(torch.softmax(scores, dim=-1), v).view(b, heads, n, d)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """input_ids int64 [num_tokens] (the inputs of `batch`, end to end) -> float32 [num_tokens, hidden]."""
        x = self.word_embeddings[input_ids] + self.position_embeddings[batch.positions] + self.token_type_0
        x = self._norm(x, self.ln_embed).to(self.dtype)
        for layer in self.layers:
            attn = self._attention(layer.qkv(x), batch)
            x = self._norm(layer.out.plus(attn, x), layer.ln1)
            h = layer.up.gelu(x, self.gelu_approximate)
            x = self._norm(layer.down.plus(h, x), layer.ln2)
        return x.float()
