"""The Llama forward pass, read top to bottom (gpt-fast style); the ops come from `kernels` (torch on a
CPU, Triton on CUDA).

One forward handles a flat batch of tokens from many sequences (decodes and prefill chunks mixed):
the linear layers see `[num_tokens, hidden]`, and attention reads each sequence's keys and values
from the paged KV cache through `AttentionMetadata`. Q/K/V and gate/up are fused into one matmul
each: on a CPU the number of ops per step matters as much as their size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu as cpu_kernels
from kernels import AttentionMetadata, fused_add_rms_norm, paged_attention, rms_norm, rotary_inplace, silu_and_mul

from . import batch_invariant
from .cpu_plan import Plan, measure_plan
from .loader import LazyTensors, ModelArgs


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


Q4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [N, K] 0..15, scale, min [N, K/32]
Q4_GROUP = 32
# The fused linears of a layer and the checkpoint weights each one concatenates along its rows.
LAYER_LINEARS = {
    "qkv": [f"self_attn.{n}_proj.weight" for n in "qkv"],
    "o": ["self_attn.o_proj.weight"],
    "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "down": ["mlp.down_proj.weight"],
}


def int4_available(device: torch.device) -> bool:
    """torch's CPU int4 matmul (group-wise scale and zero point, AVX-512 / AVX2 kernels)."""
    return device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")


def int8_available(device: torch.device) -> bool:
    """torch's CPU int8 weight-only matmul (one scale per output row)."""
    return device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")


class Int4Weight:
    """A GGUF Q4_0/Q4_1 weight as torch's packed int4 (`_weight_int4pack_mm_for_cpu`): the file's own
    4-bit codes, one (scale, zero) pair per 32 inputs, so it reads a quarter of bf16's bytes. The kernel
    computes in bf16: x is rounded to bf16 (as the bf16 path does) and the fp16 scales to bf16."""

    def __init__(self, blocks: Q4Blocks):
        codes, scale, mn = blocks
        self.shape = codes.shape
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        # The kernel's dequantisation is (code - 8) * scale + zero.
        zero = mn + 8 * scale
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, Q4_GROUP, self.scales_zeros)


class Int8Weight:
    """A weight as int8 with one scale per output row (`_weight_int8pack_mm`): half of bf16's bytes.
    Used for the output layer, whose rows a decode step reads in full while only each row's top
    candidates matter (and those are recomputed at full precision, see `LlamaModel.logits`)."""

    def __init__(self, weight: torch.Tensor, chunk_rows: int = 4096):
        n = weight.shape[0]
        self.q = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(n)
        for a in range(0, n, chunk_rows):  # in slices: no full-size float temporaries at load
            w = weight[a:a + chunk_rows].float()
            s = w.abs().amax(1).clamp_min(1e-12) / 127
            self.q[a:a + chunk_rows] = (w / s[:, None]).round_().clamp_(-127, 127).to(torch.int8)
            scales[a:a + chunk_rows] = s
        self.scales = scales.to(torch.bfloat16)

    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 2

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scales)


PackedWeight = Int4Weight | Int8Weight


class Linear:
    """y = x W^T (+ b), with W stored in its own dtype (bf16 halves the bytes a CPU decode step reads);
    the activations stay in the model's dtype, so the residual stream and the norms keep full precision.

    `packed`: the same weight in fewer bytes (the GGUF's own 4-bit blocks, or int8), which a caller
    asks for per call: small steps are bound by the bytes they read, larger ones run faster on the
    CPU's bf16 matmul (AMX / AVX512-BF16) than dequantising (see engine/cpu_plan.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: torch.dtype,
                 invariant: bool = False, packed: PackedWeight | None = None):
        self.weight = weight.to(weight_dtype).contiguous()
        self.bias = bias
        self.invariant = invariant  # fixed-shape matmuls: a row's result ignores the rest of the batch
        self.packed = packed

    def __call__(self, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
        if packed and self.packed is not None:
            y = self.packed.mm(x).to(x.dtype)
        elif self.invariant:
            y = batch_invariant.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        else:
            y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def nbytes(self, packed: bool = False) -> int:
        """Bytes of weights one call reads."""
        if packed and self.packed is not None:
            return self.packed.nbytes()
        return self.weight.numel() * self.weight.element_size()


def _q4_matches(blocks: Q4Blocks, weight: torch.Tensor) -> bool:
    """The first row of the blocks dequantizes to the weight's first row."""
    codes, scale, mn = (b[:1] for b in blocks)
    row = (codes.float().unflatten(-1, (-1, Q4_GROUP)) * scale[..., None] + mn[..., None]).flatten(-2)
    return torch.allclose(row, weight[:1].float(), rtol=0, atol=1e-6)


def _fused_blocks(parts: list[Q4Blocks | None]) -> Q4Blocks | None:
    """The 4-bit blocks of weights fused along their output rows (Q/K/V, gate/up), if all are 4-bit."""
    if any(b is None for b in parts):
        return None
    return tuple(torch.cat([b[j] for b in parts if b is not None]) for j in range(3))  # type: ignore[return-value]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, weights: MutableMapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, weight_dtype: torch.dtype | None = None, deterministic: bool = False,
                 q4_blocks: MutableMapping[str, Q4Blocks] | None = None, native_block_size: int = 0):
        """q4_blocks: the file's 4-bit weights, for small steps (CPU only; see `Linear`); with them the
        output layer also gets an int8 copy for small steps. `native_block_size`: the KV cache's block
        size, to run every step through the native CPU forward step (kernels/cpu) when every layer has
        4-bit blocks it reads; the layers then get no dense or torch int4 copy at all (0: the torch
        path). Consumes `weights` and `q4_blocks`: each layer's entries are removed from both once the
        layer is built."""
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
        use_q4 = bool(q4_blocks) and int4_available(device) and not det
        self.cos, self.sin = rope_tables(args, device)

        def q4(name: str) -> Q4Blocks | None:
            """The 4-bit blocks of a weight, if it has them and they still match the weight given (a caller
            may have replaced the weights). Looked up per layer: a lazily loaded model (engine/loader.py)
            then only ever dequantises one layer at a time."""
            if not use_q4 or q4_blocks is None or name not in q4_blocks or name not in weights:
                return None
            b = q4_blocks[name]
            if (isinstance(weights, LazyTensors) and isinstance(q4_blocks, LazyTensors) and weights.from_file(name)
                    and q4_blocks.from_file(name)):
                return b  # both made by the loader from the same tensor of the file: no need to compare
            return b if weights[name].shape == b[0].shape and _q4_matches(b, weights[name]) else None

        def drop_layer(i: int) -> None:
            """The layer's source tensors are not needed any more: freeing them as we go keeps the peak
            memory of loading near the model's own size instead of the loader's plus the model's."""
            p = f"model.layers.{i}."
            for name in [n for n in weights if n.startswith(p)]:
                del weights[name]
                if q4_blocks is not None:
                    q4_blocks.pop(name, None)

        # The whole forward in one native call (kernels/cpu), where every layer has 4-bit blocks it reads.
        self.native: cpu_kernels.ForwardStep | None = None
        if (native_block_size and use_q4 and dtype == torch.float32 and q4_blocks is not None
                and self._native_fits(args, q4_blocks) and cpu_kernels.available()):
            self.native = self._native_step(args, weights, q4, drop_layer, native_block_size)
        self.amx_min_rows = 0  # native steps of at least this many rows multiply on AMX (engine/model_runner.py)
        self.native_threads = 1
        self.layers: list[LayerWeights] = []
        q4_used = self.native is not None
        for i in range(args.num_layers if self.native is None else 0):
            p = f"model.layers.{i}."
            blocks = {name: _fused_blocks([q4(p + n) for n in names]) for name, names in LAYER_LINEARS.items()}
            q4_used = q4_used or any(b is not None for b in blocks.values())
            qkv4, o4, gate_up4, down4 = (None if b is None else Int4Weight(b) for b in blocks.values())
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            qkv_bias = (torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                        if args.attention_bias else None)
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], dim=0)
            self.layers.append(LayerWeights(
                attn_norm=w(p + "input_layernorm.weight"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                qkv=Linear(qkv, qkv_bias, wdt, det, packed=qkv4),
                o=Linear(w(p + "self_attn.o_proj.weight"), None, wdt, det, packed=o4),
                gate_up=Linear(gate_up, None, wdt, det, packed=gate_up4),
                down=Linear(w(p + "mlp.down_proj.weight"), None, wdt, det, packed=down4),
            ))
            drop_layer(i)
        # With the native step the output layer is native too: only its int8 copy, in the kernel's
        # layout (kernels/cpu `Q8Tiles`), for every step size; else torch's int8 copy for small steps.
        self.head_tiles: cpu_kernels.Q8Tiles | None = None
        self.lm_head_fast: Linear | None = None
        if self.native is not None:
            head = Int8Weight(lm_head)
            self.head_tiles = cpu_kernels.pack_int8(head.q, head.scales.float())
        elif wdt != dtype and not det:
            head8 = Int8Weight(lm_head) if q4_used and int8_available(device) else None
            self.lm_head_fast = Linear(lm_head, None, wdt, packed=head8)
        # Per step size: packed or dense weights, and threads (CPU; engine/cpu_plan.py). None: leave
        # both alone (GPU, deterministic mode, or before `plan_cpu_steps`).
        self.layer_plan: Plan | None = None
        self.head_plan: Plan | None = None

    @staticmethod
    def _native_fits(args: ModelArgs, q4_blocks: MutableMapping[str, Q4Blocks]) -> bool:
        """Every linear weight of every layer has 4-bit blocks, and the shapes are ones the kernel takes
        (checked before anything is built, so a model it cannot run gets the torch path whole)."""
        q_n, kv_n = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        shapes_ok = (args.hidden_size % 32 == 0 and args.intermediate_size % 32 == 0 and q_n % 32 == 0
                     and (q_n + 2 * kv_n) % 16 == 0 and args.head_dim % 16 == 0 and args.head_dim <= 256
                     and args.num_heads % args.num_kv_heads == 0 and args.num_heads <= 256)
        return shapes_ok and all(f"model.layers.{i}.{n}" in q4_blocks for i in range(args.num_layers)
                                 for names in LAYER_LINEARS.values() for n in names)

    def _native_step(self, args: ModelArgs, weights: MutableMapping[str, torch.Tensor],
                     q4: Callable[[str], Q4Blocks | None], drop_layer: Callable[[int], None],
                     block_size: int) -> cpu_kernels.ForwardStep | None:
        """The layers packed for the native forward step (their entries dropped as each is packed), or
        None when a weight's blocks do not match it (nothing dropped then: the torch path builds it)."""
        layers: list[cpu_kernels.LayerBlocks] = []
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            blocks = {name: _fused_blocks([q4(p + n) for n in names]) for name, names in LAYER_LINEARS.items()}
            packed = {name: None if b is None else cpu_kernels.pack_q4_1(*b) for name, b in blocks.items()}
            if any(b is None for b in packed.values()):
                if i:
                    raise RuntimeError(f"layer {i}'s 4-bit blocks do not match its weights (the layers before it "
                                       "matched); the model file is inconsistent")
                return None
            bias = (torch.cat([weights[p + f"self_attn.{n}_proj.bias"].float() for n in "qkv"])
                    if args.attention_bias else None)
            layers.append(cpu_kernels.LayerBlocks(
                attn_norm=weights[p + "input_layernorm.weight"],
                mlp_norm=weights[p + "post_attention_layernorm.weight"], qkv_bias=bias, **packed))  # type: ignore[arg-type]
            drop_layer(i)
        return cpu_kernels.ForwardStep(
            hidden=args.hidden_size, heads=args.num_heads, kv_heads=args.num_kv_heads, head_dim=args.head_dim,
            inter=args.intermediate_size, eps=args.rms_norm_eps, block_size=block_size, layers=layers,
            cos=self.cos, sin=self.sin)

    @property
    def approximate_logits(self) -> bool:
        """`logits` computes each row's top candidates exactly and the rest from a cheaper copy of the
        output layer (bf16 or int8); `logits(exact=True)` all of them at full precision."""
        return self.lm_head_fast is not None or self.head_tiles is not None

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def has_packed(self) -> bool:
        return any(lin.packed is not None for lin in self.linears())

    def plan_cpu_steps(self, max_threads: int, packed_max_rows: int | None = None) -> dict[str, str]:
        """Measures (engine/cpu_plan.py), for the layers' linears and for the output layer, which weights
        and how many threads are fastest at each step size, and uses that from now on.
        `packed_max_rows` (configured): the packed layer weights up to that many rows, whatever the
        timing. Returns the measured times, as text, for the log."""
        # Every third layer: enough weights to stream from memory as a step does (tens of MB, past the
        # caches), a third of the time to measure.
        lins = [lin for layer in self.layers[::3] for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        can_pack = self.has_packed

        def layers(m: int, packed: bool) -> Callable[[], object]:
            xs = {k: torch.randn(m, k, dtype=self.dtype) for k in {lin.weight.shape[1] for lin in lins}}
            def run() -> None:
                for lin in lins:  # each output freed before the next: no step holds 40 at once
                    lin(xs[lin.weight.shape[1]], packed)
            return run

        self.layer_plan, layer_times = measure_plan(layers, max_threads, can_pack, packed_max_rows)
        head = self.lm_head_fast
        if head is None:
            self.head_plan = Plan.fixed(max_threads)
            head_times: dict[int, dict[str, float]] = {}
        else:
            def heads(m: int, packed: bool) -> Callable[[], object]:
                x = torch.randn(m, head.weight.shape[1], dtype=self.dtype)
                return lambda: head(x, packed)

            self.head_plan, head_times = measure_plan(heads, max_threads, head.packed is not None,
                                                      all_threads_only=True)

        def fmt(times: dict[int, dict[str, float]]) -> str:
            return "; ".join(f"{m}: " + " ".join(f"{c} {t * 1e3:.2f}ms" for c, t in ts.items())
                             for m, ts in times.items())
        return {"layers": fmt(layer_times), "output layer": fmt(head_times)}

    def _use(self, plan: Plan | None, rows: int) -> bool:
        """Applies the plan's thread count for a step of `rows` rows; returns whether to read packed weights."""
        if plan is None:
            return False
        choice = plan.for_rows(rows)
        if torch.get_num_threads() != choice.threads:
            torch.set_num_threads(choice.threads)
        return choice.packed

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if exact or not self.approximate_logits:
            return self.lm_head(h).float()
        if self.head_tiles is not None:
            # One native call: the int8 products, each row's top candidates and their exact values.
            return cpu_kernels.int8_logits(h, self.head_tiles, self.native_threads, exact=self.lm_head.weight,
                                           refine=REFINE_TOP, amx_min_rows=self.amx_min_rows)
        assert self.lm_head_fast is not None
        logits = self.lm_head_fast(h, self._use(self.head_plan, h.shape[0])).float()
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
               meta: AttentionMetadata, logits_indices: torch.Tensor, num_layers: int | None = None,
               amx_min_rows: int | None = None) -> torch.Tensor:
        """The final normalised hidden states at `logits_indices` ([n, hidden]): what `logits` multiplies.
        `num_layers`: only the first layers; `amx_min_rows`: the native step's AMX threshold for this
        call (both for timing at start)."""
        a = self.args
        rows = token_ids.shape[0]
        if self.native is not None:
            # Row -> its sequence's block table: the metadata lists each sequence's rows together.
            row_seq = torch.repeat_interleave(torch.arange(len(meta.query_lens_host), dtype=torch.int32),
                                              torch.tensor(meta.query_lens_host), output_size=rows)
            x = self.native.run(self.embed[token_ids], positions, meta.slot_mapping, meta.block_tables, row_seq,
                                kv_cache, self.native_threads,
                                self.amx_min_rows if amx_min_rows is None else amx_min_rows, num_layers)
            return rms_norm(x[logits_indices], self.norm, a.rms_norm_eps)
        packed = self._use(self.layer_plan, rows)
        x = self.embed[token_ids]
        residual = None
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for i, layer in enumerate(self.layers[:num_layers]):
            x, residual = fused_add_rms_norm(x, residual, layer.attn_norm, a.rms_norm_eps)
            qkv = layer.qkv(x, packed)
            q = qkv[:, :q_size].unflatten(-1, (a.num_heads, a.head_dim))
            k = qkv[:, q_size:q_size + kv_size].unflatten(-1, (a.num_kv_heads, a.head_dim))
            v = qkv[:, q_size + kv_size:].unflatten(-1, (a.num_kv_heads, a.head_dim))
            rotary_inplace(q, k, self.cos, self.sin, positions)
            attn = self.attention(q, k, v, kv_cache[i, 0], kv_cache[i, 1], meta)
            x = layer.o(attn.reshape(-1, q_size), packed)
            x, residual = fused_add_rms_norm(x, residual, layer.mlp_norm, a.rms_norm_eps)
            x = layer.down(silu_and_mul(layer.gate_up(x, packed)), packed)
        assert residual is not None  # set by the first layer
        return rms_norm((residual + x)[logits_indices], self.norm, a.rms_norm_eps)
