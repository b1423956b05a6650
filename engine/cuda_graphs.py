"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

For a small model a decode step is hundreds of tiny kernel launches; on a GPU the launch overhead, not
memory bandwidth, bounds it. A captured graph replays the whole step in one launch. Inputs live in
static buffers; a batch is padded up to its bucket with rows that write their K/V to a scratch block
(never handed to the block manager) and attend to one token; their outputs are dropped.

On a CPU the same class runs without capturing (`capture=False`): that path is how the padding is
tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging

import torch

from kernels import AttentionMetadata

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_blocks_per_seq: int, scratch_block: int,
                 max_batch: int, max_model_len: int, capture: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch] + [max_batch]
        dev = kv_cache.device
        n = max(self.buckets)
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_idx = torch.arange(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits, hidden states)
        if capture:
            self._capture()

    def bucket_for(self, n: int) -> int | None:
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def _meta(self, b: int, max_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b], block_tables=self.tables[:b], seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[:b + 1], num_decodes=b, block_size=self.block_size,
            query_lens_host=[1] * b, seq_lens_host=[1] * b, max_decode_len=max_len)

    def _run_model(self, b: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final hidden states): the runner recomputes exact logits from the hidden states of
        rows that want logprobs, outside the graph."""
        h = self.model.hidden(self.tokens[:b], self.positions[:b], self.kv_cache, self._meta(b, max_len),
                              self.logits_idx[:b])
        return self.model.logits(h), h

    def _capture(self) -> None:
        """Largest bucket first so the smaller graphs reuse its memory pool."""
        pool = None
        for b in sorted(self.buckets, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile the Triton kernels and let the allocator settle
                    self._run_model(b, self.max_model_len)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._run_model(b, self.max_model_len)
            pool = graph.pool()
            self.graphs[b], self.outputs[b] = graph, out
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(self, tokens: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] and hidden states [n, hidden] for n decode sequences (n at most the largest bucket)."""
        n = len(tokens)
        b = self.bucket_for(n)
        assert b is not None, "batch larger than the largest bucket"
        pad = b - n
        self.tokens[:b].copy_(torch.tensor(tokens + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots + [self.scratch_block * self.block_size] * pad), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor(seq_lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        tables = torch.full((b, self.tables.shape[1]), self.scratch_block, dtype=torch.int32)
        for i, row in enumerate(block_tables):
            tables[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        self.tables[:b].copy_(tables, non_blocking=True)
        if b in self.graphs:
            self.graphs[b].replay()
            logits, h = self.outputs[b]
        else:
            logits, h = self._run_model(b, max(seq_lens))
        return logits[:n], h[:n]
