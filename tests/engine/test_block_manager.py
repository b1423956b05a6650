"""Prefix-cache hardening (no model): keyed SHA-256 block hashes, verified hits, and cache salts.

A hit is served another request's K/V, so it must be exact: Python's `hash` of a tuple can be made to
collide (vLLM's GHSA-rm76-4mrf-v9r8), and a shared cache tells one tenant what another already sent.
"""

from __future__ import annotations

from engine.block_manager import BlockManager, block_hash, root_hash
from engine.request import EngineRequest, SamplingParams
from engine.sequence import Sequence
from gateway.messages import QueueItem

BLOCK = 4


def seq(rid: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence.from_request(EngineRequest(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt),
                                 max_tokens=4)


def run_prefill(bm: BlockManager, s: Sequence) -> int:
    """Admit `s` the way the scheduler does, compute its whole prompt, register its blocks; returns the hit tokens."""
    match = bm.match_prefix(s)
    bm.allocate_prefix(s, match)
    s.num_computed_tokens = match.num_tokens
    bm.grow(s, s.num_tokens - match.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return match.num_tokens


def test_block_keys_are_keyed_sha256_digests():
    bm = BlockManager(16, BLOCK)
    run_prefill(bm, seq("a", list(range(9))))
    assert len(bm.cached) == 2
    assert all(isinstance(h, bytes) and len(h) == 32 for h in bm.cached)
    # Keyed with a per-process random seed: not the plain SHA-256 anyone could precompute.
    import hashlib
    from array import array
    plain = hashlib.sha256(root_hash(None) + array("q", range(4)).tobytes()).digest()
    assert block_hash(root_hash(None), list(range(4))) != plain


def test_shared_prefix_still_hits():
    bm = BlockManager(16, BLOCK)
    run_prefill(bm, seq("a", list(range(10))))
    b = seq("b", list(range(8)) + [99, 98])
    assert run_prefill(bm, b) == 8


def test_forced_hash_collision_with_other_tokens_is_refused(monkeypatch):
    """Every block hashes alike: the hit must still be refused because its tokens differ."""
    monkeypatch.setattr(BlockManager, "_hash", staticmethod(lambda parent, tokens: b"\0" * 32))
    bm = BlockManager(16, BLOCK)
    run_prefill(bm, seq("victim", [1, 2, 3, 4, 5]))
    assert len(bm.cached) == 1
    attacker = seq("attacker", [7, 7, 7, 7, 7])
    assert bm.match_prefix(attacker).num_tokens == 0
    # ...and a real match is still served.
    assert bm.match_prefix(seq("again", [1, 2, 3, 4, 6])).num_tokens == BLOCK


def test_forced_hash_collision_with_other_parent_is_refused(monkeypatch):
    """Hashes that ignore the parent: equal tokens after a different prefix (or salt) must not hit."""
    monkeypatch.setattr(BlockManager, "_hash", staticmethod(lambda parent, tokens: block_hash(b"", tokens)))
    bm = BlockManager(16, BLOCK)
    run_prefill(bm, seq("victim", [1, 2, 3, 4, 5, 6, 7, 8, 9], salt="tenant-a"))
    assert bm.match_prefix(seq("other-tenant", [1, 2, 3, 4, 5, 6, 7, 8, 9], salt="tenant-b")).num_tokens == 0
    assert bm.match_prefix(seq("same-tenant", [1, 2, 3, 4, 5, 6, 7, 8, 9], salt="tenant-a")).num_tokens > 0


def test_different_salts_do_not_share_blocks():
    bm = BlockManager(32, BLOCK)
    prompt = list(range(13))
    assert run_prefill(bm, seq("a1", prompt, salt="a")) == 0
    assert run_prefill(bm, seq("b1", prompt, salt="b")) == 0  # same tokens, other salt: no hit
    assert run_prefill(bm, seq("n1", prompt)) == 0  # unsalted is its own scope too
    assert run_prefill(bm, seq("e1", prompt, salt="")) == 0  # and differs from the empty salt
    assert run_prefill(bm, seq("a2", prompt, salt="a")) == 12
    assert run_prefill(bm, seq("b2", prompt, salt="b")) == 12
    assert run_prefill(bm, seq("n2", prompt)) == 12


def test_salt_travels_through_the_queue_to_the_sequence():
    req = EngineRequest("r", [1, 2, 3], SamplingParams(), cache_salt="s" * 64)
    item = QueueItem.from_dict(QueueItem(request=req, tier="pro").to_dict())
    assert item.request.cache_salt == "s" * 64
    assert Sequence.from_request(item.request, max_tokens=1).cache_salt == "s" * 64
    assert EngineRequest.from_dict({"request_id": "old", "prompt_token_ids": [1]}).cache_salt is None
