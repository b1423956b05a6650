"""Paged KV memory: fixed-size blocks, reference counts, and prefix caching by chained block hashes.

A full block is identified by the hash of (parent block's hash, its token ids), as in vLLM, so two
sequences sharing a prefix share the blocks of that prefix. A block whose last reference goes away
keeps its K/V and its hash: it sits at the end of the free list and is reused by a later request with
the same prefix, or evicted least-recently-used when memory is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # block hash -> block id (full blocks with valid K/V)
        self.hit_tokens_total = 0
        self.queried_tokens_total = 0

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    @staticmethod
    def _hash(parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    # -- prefix cache ------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest prefix of the sequence's tokens, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        tokens = seq.token_ids()
        usable = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent = None
        for b in range(usable):
            h = self._hash(parent, tokens[b * self.block_size:(b + 1) * self.block_size])
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def allocate_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Give a waiting sequence the cached blocks of its prefix; it computes only the rest."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)  # type: ignore[arg-type]
        seq.num_computed_tokens = len(hits) * self.block_size
        self.queried_tokens_total += len(seq.prompt_token_ids)
        self.hit_tokens_total += seq.num_computed_tokens

    # -- allocation --------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens of K/V; the caller checked `can_grow`."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise MemoryError("grow() without can_grow()")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache (after their K/V are written)."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        tokens = None
        while len(seq.block_hashes) < full:
            b = len(seq.block_hashes)
            if tokens is None:
                tokens = seq.token_ids()
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = self._hash(parent, tokens[b * self.block_size:(b + 1) * self.block_size])
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[b]]
            if block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = block.block_id

    def free_sequence(self, seq: Sequence) -> None:
        """Drop the sequence's references; its hashed blocks stay cached, tail blocks first in line for eviction."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)  # no content worth keeping: reuse first
                else:
                    self.free[block_id] = None  # most recently used end
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        for h, block_id in list(self.cached.items()):
            if self.blocks[block_id].ref_count == 0:
                self.blocks[block_id].hash = None
                del self.cached[h]
