"""What an attention call needs to know about a step's batch besides the tensors: `AttentionMetadata`.

The model runner builds one per step; every layer's attention reads it. The cache of one layer is
`[num_slots, kv_heads, head_dim]`, where slot = block * block_size + offset. Sequences are ordered
decodes first (one query token each), then prefill/extend chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: the cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [S] int32: context length after this step's tokens
    query_start_loc: torch.Tensor  # [S + 1] int32: offsets of each sequence's tokens in the flat batch
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    block_size: int
    # Host-side copies so the torch path never synchronises on a device tensor.
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    max_decode_len: int = 0
    _decode_gather: tuple[torch.Tensor, torch.Tensor] | None = None
    _prefill_gather: dict[int, torch.Tensor] = field(default_factory=dict)

    def decode_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids [Nd, nblocks] and validity mask [Nd, 1, 1, nblocks * block_size] for the decode
        sequences (built once per step, shared by every layer). Gathering whole blocks moves
        block_size times fewer, larger rows than gathering slot by slot: about twice as fast on a CPU."""
        if self._decode_gather is None:
            nd = self.num_decodes
            nblocks = (self.max_decode_len + self.block_size - 1) // self.block_size
            blocks = self.block_tables[:nd, :nblocks].long()
            pos = torch.arange(nblocks * self.block_size, device=blocks.device)
            mask = pos[None, :] < self.seq_lens[:nd, None]
            self._decode_gather = (blocks, mask[:, None, None, :])
        return self._decode_gather

    def context_slots(self, s: int) -> torch.Tensor:
        if s not in self._prefill_gather:
            n = self.seq_lens_host[s]
            nblocks = (n + self.block_size - 1) // self.block_size
            offs = torch.arange(self.block_size, device=self.block_tables.device)
            slots = self.block_tables[s, :nblocks].long()[:, None] * self.block_size + offs
            self._prefill_gather[s] = slots.reshape(-1)[:n]
        return self._prefill_gather[s]
