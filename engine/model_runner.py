"""Owns the model weights and the KV pool; turns `{sequence: num_tokens}` into one forward and sampled tokens.

It only reads the sequences (tokens, progress, block tables); the scheduler applies what a step did.
"""

from __future__ import annotations

import logging

import torch

from kernels import AttentionMetadata

from .config import EngineConfig
from .cuda_graphs import DecodeGraphs
from .guide import Guides
from .loader import LoadedModel
from .model import LlamaModel
from .sampler import Sampled, sample
from .sequence import Sequence

log = logging.getLogger(__name__)


def pick_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto" and config.deterministic:
        return torch.float32
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def pick_weight_dtype(config: EngineConfig) -> torch.dtype:
    if config.weight_dtype == "auto" and config.deterministic:
        return torch.float32
    if config.weight_dtype == "auto":
        return torch.bfloat16
    return _DTYPES[config.weight_dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, guides: Guides | None = None):
        self.config = config
        self.guides = guides  # constrained decoding: the token masks of guided sequences
        self.device = pick_device(config)
        self.dtype = pick_dtype(config, self.device)
        args = loaded.args
        self.weight_dtype = pick_weight_dtype(config)
        self.model = LlamaModel(args, loaded.weights, self.dtype, self.device, self.weight_dtype,
                                deterministic=config.deterministic)
        if config.deterministic:
            log.info("deterministic: batch-invariant matmuls and attention, no CUDA graphs, weights %s, "
                     "activations %s (outputs do not depend on batching, chunking or prefix-cache hits)",
                     str(self.weight_dtype).removeprefix("torch."), str(self.dtype).removeprefix("torch."))
        self.block_size = config.block_size
        kv_bytes_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * self.dtype.itemsize
        self.num_blocks = num_blocks = self._pool_blocks(kv_bytes_per_token)
        # One extra block past the pool: the scratch block that CUDA-graph padding rows write to.
        self.scratch_block = num_blocks
        self.kv_cache = torch.zeros(args.num_layers, 2, (num_blocks + 1) * self.block_size, args.num_kv_heads,
                                    args.head_dim, dtype=self.dtype, device=self.device)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graph_max_batch > 0 and not config.deterministic:
            max_len = config.max_model_len or args.max_position_embeddings
            max_batch = min(config.cuda_graph_max_batch, config.max_running_requests)
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, -(-max_len // self.block_size),
                                       self.scratch_block, max_batch, max_len)

    def _pool_blocks(self, bytes_per_token: int) -> int:
        cfg = self.config
        if cfg.max_total_num_tokens is not None:
            tokens = cfg.max_total_num_tokens
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            fraction = cfg.mem_fraction_static if cfg.mem_fraction_static is not None else 0.85
            tokens = int(free * fraction) // bytes_per_token
        else:
            tokens = cfg.kv_cache_tokens
        return max(1, tokens // cfg.block_size)

    def execute(self, scheduled: dict[Sequence, int]) -> dict[Sequence, Sampled]:
        """Runs one forward over every scheduled token; returns the sampled token (and its logprobs,
        when asked) of each sequence whose last uncomputed token was in this step (partial prefill
        chunks sample nothing). Running it again before the scheduler applies the step recomputes the
        same tokens."""
        logits, hidden, samplers = self._forward(scheduled)
        if not samplers:
            return {}
        logits = self._exact_for_logprobs(logits, hidden, samplers)
        return dict(zip(samplers, sample(logits, samplers, self.generator, self.guides)))

    def _exact_for_logprobs(self, logits: torch.Tensor, hidden: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """With the bf16 output layer only each row's top candidates are exact: rows that want logprobs
        get all their logits recomputed at full precision (a new tensor; graph outputs stay untouched)."""
        if self.model.lm_head_fast is None:
            return logits
        rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
        if not rows:
            return logits
        idx = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return logits.index_copy(0, idx, self.model.logits(hidden.index_select(0, idx), exact=True))

    def logits_for(self, seq: Sequence, n: int) -> torch.Tensor:
        """Logits at every one of the sequence's next n positions (tests and scoring)."""
        logits, _, _ = self._forward({seq: n}, all_logits=True)
        return logits

    def _forward(self, scheduled: dict[Sequence, int],
                 all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]]:
        """(logits, final hidden states, the sequences that sample, in row order)."""
        if (self.graphs is not None and not all_logits and all(n == 1 for n in scheduled.values())
                and self.graphs.bucket_for(len(scheduled)) is not None):
            return self._forward_graph(scheduled)
        return self._forward_eager(scheduled, all_logits)

    def _forward_graph(self, scheduled: dict[Sequence, int]) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]]:
        """A pure decode step: every sequence computes its one newest token and samples."""
        assert self.graphs is not None
        bs = self.block_size
        seqs = list(scheduled)
        positions = [s.num_computed_tokens for s in seqs]
        logits, hidden = self.graphs.run(
            tokens=[s.token_ids(p, p + 1)[0] for s, p in zip(seqs, positions)], positions=positions,
            slots=[s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)],
            block_tables=[s.block_table for s in seqs], seq_lens=[p + 1 for p in positions])
        return logits, hidden, seqs

    def _forward_eager(self, scheduled: dict[Sequence, int],
                       all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]]:
        # Decodes (one token) first, then prefill chunks: the layout the attention op expects.
        order = sorted(scheduled.items(), key=lambda kv: kv[1] > 1)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        samplers: list[Sequence] = []
        num_decodes = 0
        bs = self.block_size
        for seq, n in order:
            start = seq.num_computed_tokens
            num_decodes += n == 1
            tokens += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_lens.append(n)
            seq_lens.append(start + n)
            if all_logits:
                logits_idx += range(len(tokens) - n, len(tokens))
            if start + n == seq.num_tokens:
                if not all_logits:
                    logits_idx.append(len(tokens) - 1)
                samplers.append(seq)
        max_blocks = max(len(s.block_table) for s, _ in order)
        tables = torch.zeros(len(order), max_blocks, dtype=torch.int32)
        for i, (seq, _) in enumerate(order):
            tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        dev = self.device
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            num_decodes=num_decodes, block_size=bs, query_lens_host=query_lens, seq_lens_host=seq_lens,
            max_decode_len=max(seq_lens[:num_decodes], default=0),
        )
        hidden = self.model.hidden(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                                   self.kv_cache, meta, torch.tensor(logits_idx, dtype=torch.long, device=dev))
        return self.model.logits(hidden, exact=all_logits), hidden, samplers
