"""The Llama forward pass, read top to bottom (gpt-fast style); the ops come from `kernels` (torch on a
CPU, Triton on CUDA), the weight formats from engine/weights.py.

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
from torch import nn

import kernels.cpu as cpu_kernels
from kernels import AttentionMetadata, fused_add_rms_norm, paged_attention, rms_norm, rotary_inplace, silu_and_mul

from . import batch_invariant
from .cpu_plan import CpuKernels, Plan, measure_plan
from .gguf_blocks import GroupBlocks, HalfWeights
from .loader import LazyTensors, ModelArgs
from .token_rows import TokenRows
from .weights import (
    LAYER_LINEARS,
    Int4Weight,
    Int8Weight,
    Linear,
    NativeBlocks,
    Q4Blocks,
    fused_blocks,
    int4_available,
    int8_available,
    k_tiles_pay,
    native_fits,
    native_head,
    native_layers,
    q4_matches,
    six_bit_tiles_pay,
)


def rope_tables(args: ModelArgs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [max_positions, head_dim // 2]; llama3-style frequency scaling when configured
    (a Hugging Face config's `rope_scaling`, or a GGUF's per-frequency factors, which its converter computes
    from the same rule)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if args.rope_freq_factors is not None:
        if len(args.rope_freq_factors) != dim // 2:
            raise ValueError(f"rope_freqs has {len(args.rope_freq_factors)} factors for head size {dim}")
        inv_freq = inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float64)
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
# with the 4-bit candidate copy: on the random Llama-3.2-1B-shape file's flat distributions its 16 best missed
# the argmax once in 63 positions (top-1 agreement 96.8% against the int8 copy's 98.4%, bench/agreement.py),
# 32 did not; no slower at batch 1 or 16 (decode_roofline)
REFINE_TOP_4BIT = 32


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


class LlamaModel(nn.Module):
    head_rows: TokenRows | None = None  # (a class default: tests build the output layer alone)

    def __init__(self, args: ModelArgs, weights: MutableMapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, weight_dtype: torch.dtype | None = None, deterministic: bool = False,
                 q4_blocks: MutableMapping[str, Q4Blocks] | None = None, native_block_size: int = 0,
                 kernels: CpuKernels | None = None,
                 group_blocks: MutableMapping[str, GroupBlocks | HalfWeights | TokenRows | None] | None = None,
                 head_bits: int | None = None):
        """q4_blocks: the file's 4-bit weights, for small steps (CPU only; see `Linear`); with them the
        output layer also gets an int8 copy for small steps. `native_block_size`: the KV cache's block
        size, to run every step through the native CPU forward step (kernels/cpu) when `kernels` allows
        native kernels and every layer has 4-bit blocks it reads; the layers then get no dense or torch
        int4 copy at all (0: the torch path). `kernels`: the runner's kernel choice, read at every step (its
        threads and AMX rows); None: no native kernels. `group_blocks`: the file's other block types the
        native step reads (engine/gguf_blocks.py), for it alone. `head_bits`: the native output layer's
        candidate copy, 8 or 4 bits (None: by its size, engine/weights.py `native_head`). Consumes
        `weights`, `q4_blocks` and `group_blocks`: each layer's entries are removed from them once the
        layer is built."""
        super().__init__()
        self.args = args
        self.kernels = kernels or CpuKernels()
        wdt = weight_dtype or dtype
        self.dtype = dtype
        # EngineConfig.deterministic: batch-invariant matmuls and attention (engine/batch_invariant.py).
        self.deterministic = det = deterministic
        self.attention = batch_invariant.paged_attention if det else paged_attention

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        self.norm = w("model.norm.weight")
        use_q4 = bool(q4_blocks) and int4_available(device) and not det
        self.cos, self.sin = rope_tables(args, device)
        # Deterministic bf16 weights on a CPU without bf16 units: the fixed-shape chunks multiply in float32
        # (oneDNN's emulated bf16 matmul is ~5x slower); still batch-invariant, and still bf16 in memory.
        mul = torch.float32 if det and wdt == torch.bfloat16 and device.type == "cpu" and \
            not self.kernels.bf16_units else None

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
            return b if weights[name].shape == b[0].shape and q4_matches(b, weights[name]) else None

        def native_blocks(name: str) -> NativeBlocks | None:
            """A weight's blocks for the native step: its 4-bit ones, or the loader's group blocks of the
            same tensor of the file (never for a weight a caller replaced)."""
            b = q4(name)
            if b is not None or group_blocks is None or name not in group_blocks or name not in weights:
                return b
            if isinstance(weights, LazyTensors) and weights.from_file(name) and (
                    not isinstance(group_blocks, LazyTensors) or group_blocks.from_file(name)):
                g = group_blocks[name]
                return None if isinstance(g, TokenRows) else g
            return None

        def drop_layer(i: int) -> None:
            """The layer's source tensors are not needed any more: freeing them as we go keeps the peak
            memory of loading near the model's own size instead of the loader's plus the model's."""
            p = f"model.layers.{i}."
            for name in [n for n in weights if n.startswith(p)]:
                del weights[name]
                for extra in (q4_blocks, group_blocks):
                    if extra is not None:
                        extra.pop(name, None)

        # The whole forward in one native call (kernels/cpu), where every layer has blocks it reads.
        self.native: cpu_kernels.ForwardStep | None = None
        if (native_block_size and self.kernels.native and not det and dtype == torch.float32
                and native_fits(args, q4_blocks if use_q4 and q4_blocks is not None else {}, group_blocks or {})):
            self.native = self._native_step(args, weights, native_blocks, drop_layer, native_block_size)
        # The token embedding and the output layer. With the native step, both read from the file itself where
        # the kernels decode its type (engine/token_rows.py: rows decoded on demand, exactly), not fp32 copies.
        rows = self._token_rows(weights, group_blocks, args.tie_word_embeddings) if self.native else None
        self.embed: torch.Tensor | TokenRows
        self.head_rows: TokenRows | None = None if rows is None else rows[1]
        self.lm_head: Linear | None = None
        lm_head: torch.Tensor | TokenRows
        if rows is not None:
            self.embed, lm_head = rows
        else:
            self.embed = w("model.embed_tokens.weight")
            lm_head = self.embed if args.tie_word_embeddings else w("lm_head.weight")
            # The output layer reads as many bytes as a third of the model. With bf16 weights it runs in
            # bf16 too, and each row's top candidates are then recomputed at full precision, so near-ties
            # between the likeliest tokens (all that greedy, top-k and top-p look at) are decided exactly;
            # bf16 alone flips such ties.
            self.lm_head = Linear(lm_head, None, dtype, det)
            # (Not in deterministic mode: the output layer stays one full-precision batch-invariant matmul.)
        self.layers: list[LayerWeights] = []
        q4_used = self.native is not None
        for i in range(args.num_layers if self.native is None else 0):
            p = f"model.layers.{i}."
            blocks = {name: fused_blocks([q4(p + n) for n in names]) for name, names in LAYER_LINEARS.items()}
            q4_used = q4_used or any(b is not None for b in blocks.values())
            qkv4, o4, gate_up4, down4 = (None if b is None else Int4Weight(b) for b in blocks.values())
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            qkv_bias = (torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                        if args.attention_bias else None)
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], dim=0)
            self.layers.append(LayerWeights(
                attn_norm=w(p + "input_layernorm.weight"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                qkv=Linear(qkv, qkv_bias, wdt, det, packed=qkv4, multiply_dtype=mul),
                o=Linear(w(p + "self_attn.o_proj.weight"), None, wdt, det, packed=o4, multiply_dtype=mul),
                gate_up=Linear(gate_up, None, wdt, det, packed=gate_up4, multiply_dtype=mul),
                down=Linear(w(p + "mlp.down_proj.weight"), None, wdt, det, packed=down4, multiply_dtype=mul),
            ))
            drop_layer(i)
        # With the native step the output layer is native too: only its int8 copy (4-bit for a large one),
        # in the kernel's layout (kernels/cpu `Q8Tiles`, `LayerTiles`), for every step size; else torch's
        # int8 copy for small steps.
        self.head_tiles: cpu_kernels.Q8Tiles | cpu_kernels.LayerTiles | None = None
        self.lm_head_fast: Linear | None = None
        if self.native is not None:
            self.head_tiles = native_head(lm_head, bits=head_bits)
        elif wdt != dtype and not det:
            assert isinstance(lm_head, torch.Tensor)
            head8 = Int8Weight(lm_head) if q4_used and int8_available(device) else None
            self.lm_head_fast = Linear(lm_head, None, wdt, packed=head8)
        # Per step size: packed or dense weights, and threads (CPU; engine/cpu_plan.py). None: leave
        # both alone (GPU, deterministic mode, or before `plan_cpu_steps`).
        self.layer_plan: Plan | None = None
        self.head_plan: Plan | None = None

    def _token_rows(self, weights: MutableMapping[str, torch.Tensor],
                    group_blocks: MutableMapping[str, GroupBlocks | HalfWeights | TokenRows | None] | None,
                    tied: bool) -> tuple[TokenRows, TokenRows] | None:
        """(embedding, output layer) read from the file, when the loader has them for both (and they are the
        file's, not weights a caller replaced); else None: fp32 copies."""
        names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
        if group_blocks is None or not isinstance(weights, LazyTensors) or not all(
                n in group_blocks and n in weights and weights.from_file(n)
                and (not isinstance(group_blocks, LazyTensors) or group_blocks.from_file(n)) for n in names):
            return None
        rows = [group_blocks[n] for n in names]
        if not all(isinstance(r, TokenRows) for r in rows):
            return None
        for r in rows:
            r.threads = self.kernels.threads  # type: ignore[union-attr]
        return rows[0], rows[-1]  # type: ignore[return-value]

    def _native_step(self, args: ModelArgs, weights: MutableMapping[str, torch.Tensor],
                     blocks: Callable[[str], NativeBlocks | None], drop_layer: Callable[[int], None],
                     block_size: int) -> cpu_kernels.ForwardStep | None:
        """The layers bound to the native forward step, or None when their blocks do not match the
        weights (engine/weights.py, `native_layers`)."""
        layers = native_layers(args, weights, blocks, drop_layer, k_scales=k_tiles_pay(), six_bit=six_bit_tiles_pay())
        if layers is None:
            return None
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
        """Applies the plan's thread count for a step of `rows` rows (torch's thread count is the process's,
        so the step sets it); returns whether to read packed weights."""
        if plan is None:
            return False
        choice = plan.for_rows(rows)
        if torch.get_num_threads() != choice.threads:
            torch.set_num_threads(choice.threads)
        return choice.packed

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, exact: bool = False) -> torch.Tensor:
        if exact or not self.approximate_logits:
            if self.head_rows is not None:
                return self.head_rows.product(h, threads=self.kernels.threads if self.kernels.native else 0)
            assert self.lm_head is not None
            return self.lm_head(h).float()
        if self.head_tiles is not None:
            rows = self.head_rows
            dense = self.lm_head.weight if rows is None and self.lm_head is not None else None
            # One native call: the candidate copy's products (int8, or 4-bit), each row's top candidates and
            # their exact values (from the fp32 copy, or the file's rows).
            return cpu_kernels.head_logits(h, self.head_tiles, self.kernels.threads, exact=dense,
                                           exact_rows=None if rows is None else rows.rows,
                                           refine=REFINE_TOP_4BIT if isinstance(self.head_tiles, cpu_kernels.LayerTiles)
                                           else REFINE_TOP, wide_min_rows=self.kernels.wide_min_rows,
                                           amx_min_rows=self.kernels.amx_min_rows)
        assert self.lm_head_fast is not None and self.lm_head is not None
        logits = self.lm_head_fast(h, self._use(self.head_plan, h.shape[0])).float()
        return self._refine(h, logits, self.lm_head.weight)

    @staticmethod
    def _refine(h: torch.Tensor, logits: torch.Tensor, exact: torch.Tensor | TokenRows) -> torch.Tensor:
        """`logits` with each row's REFINE_TOP largest recomputed against the exact weights (in place)."""
        top = logits.topk(REFINE_TOP, dim=-1).indices  # [n, k]
        rows = exact[top]  # [n, k, hidden], full precision
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
               wide_rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The final normalised hidden states at `logits_indices` ([n, hidden]): what `logits` multiplies.
        `num_layers`: only the first layers; `wide_rows`: the native step's (int8, AMX) matmul thresholds for
        this call, rather than the kernels' (both for timing at start)."""
        a = self.args
        rows = token_ids.shape[0]
        if self.native is not None:
            # Row -> its sequence's block table: the metadata lists each sequence's rows together (a step
            # of decodes only: row i is sequence i).
            seqs = len(meta.query_lens_host)
            row_seq = (torch.arange(seqs, dtype=torch.int32) if seqs == rows else
                       torch.repeat_interleave(torch.arange(seqs, dtype=torch.int32),
                                               torch.tensor(meta.query_lens_host), output_size=rows))
            x = self.native.run(self.embed[token_ids], positions, meta.slot_mapping, meta.block_tables, row_seq,
                                kv_cache, self.kernels.threads, *(wide_rows or (self.kernels.wide_min_rows,
                                                                              self.kernels.amx_min_rows)),
                                num_layers=num_layers)
            return cpu_kernels.rms_norm_rows(x, logits_indices, self.norm, a.rms_norm_eps)
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
