"""Paged KV memory: fixed-size blocks, reference counts, and prefix caching by chained block hashes.

A full block is identified by the hash of (parent block's hash, its token ids), as in vLLM, so two
sequences sharing a prefix share the blocks of that prefix. A block whose last reference goes away
keeps its K/V and its hash: it sits at the end of the free list and is reused by a later request with
the same prefix, or evicted least-recently-used when memory is needed.

The hash is SHA-256 keyed with a random per-process seed (not Python's `hash`, whose collisions can be
crafted: vLLM's GHSA-rm76-4mrf-v9r8), and a hit is trusted only when the cached block's parent hash and
token ids equal the request's, so even a collision cannot serve another prompt's K/V. The parent of a
sequence's first block is a digest of its `cache_salt`: sequences with different salts (the gateway
derives one per API key, tier or client salt) never share a block.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence

# Keys every block hash of this process: digests cannot be predicted or precomputed from outside.
_SEED = secrets.token_bytes(32)
_SEEDED = hashlib.sha256(_SEED)


def root_hash(salt: str | None) -> bytes:
    """The 'parent' of a sequence's first block: one digest per cache salt (None: the unsalted root)."""
    h = _SEEDED.copy()
    if salt is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def block_hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """sha256(seed || parent digest || token ids as int64): the identity of a full block."""
    h = _SEEDED.copy()
    h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks holding the longest reusable prefix of a waiting sequence (`match_prefix`): what
    the scheduler passes back to `can_admit` and `allocate_prefix` without reading the pool itself."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0  # tokens those blocks hold: the sequence computes only the rest


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    # What the hash stands for, compared on every hit (set together with `hash`).
    parent: bytes | None = None
    tokens: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[bytes, int] = {}  # block hash -> block id (full blocks with valid K/V)

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    def can_admit(self, match: PrefixMatch, num_new_tokens: int) -> bool:
        """Whether a waiting sequence fits: its cached prefix `match` plus `num_new_tokens` computed this step.

        Cached blocks that no running sequence holds sit on the free list; taking them for this
        sequence removes them from it, so they do not count as free room."""
        need = self.blocks_needed(match.num_tokens + num_new_tokens) - len(match.block_ids)
        reclaimed = sum(1 for b in match.block_ids if self.blocks[b].ref_count == 0)
        return need <= len(self.free) - reclaimed

    @staticmethod
    def _hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
        return block_hash(parent, tokens)  # every block hash goes through here: the collision tests replace it

    # -- prefix cache ------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Cached blocks for the longest prefix of the sequence's tokens, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        tokens = seq.token_ids()
        usable = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent = root_hash(seq.cache_salt)
        for b in range(usable):
            chunk = tuple(tokens[b * self.block_size:(b + 1) * self.block_size])
            h = self._hash(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent != parent or block.tokens != chunk:
                break  # a hash collision: never serve another prefix's K/V
            hits.append(block_id)
            parent = h
        return PrefixMatch(tuple(hits), len(hits) * self.block_size)

    def allocate_prefix(self, seq: Sequence, match: PrefixMatch) -> None:
        """Give a waiting sequence (no blocks yet) the cached blocks of its prefix."""
        assert not seq.block_table
        for block_id in match.block_ids:
            block = self.blocks[block_id]
            assert block.hash is not None
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)

    # -- allocation --------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = block.parent = block.tokens = None
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
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.cache_salt)
            chunk = tuple(tokens[b * self.block_size:(b + 1) * self.block_size])
            h = self._hash(parent, chunk)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[b]]
            if block.hash is None and h not in self.cached:
                block.hash, block.parent, block.tokens = h, parent, chunk
                self.cached[h] = block.block_id

    def free_sequence(self, seq: Sequence) -> None:
        """Drop the sequence's references; its hashed blocks stay cached, tail blocks first in line for eviction.
        The sequence's K/V are gone for it: the scheduler resets its progress."""
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

    def reset_prefix_cache(self) -> None:
        for h, block_id in list(self.cached.items()):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                block.hash = block.parent = block.tokens = None
                del self.cached[h]
