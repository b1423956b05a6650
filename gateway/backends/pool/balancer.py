"""Which replica a request goes to: least loaded, with prefix affinity.

A request's prefix is its prompt text cut into `BLOCK_CHARS`-character blocks, each hashed with all
before it, so equal hashes mean equal prefixes (as the engines' own prefix caches key their blocks).
Each replica remembers the blocks of what it was sent (replica.py). The request goes to the replica
that has the most of its leading blocks when that is at least `MIN_MATCH_BLOCKS` (the engine will
skip that prefill) unless that replica is much busier than the least busy one: more than
`BALANCE_ABS` requests and `BALANCE_REL` times as many (the anchor: SGLang router's cache-aware
policy, whose balance thresholds are absolute and relative the same way). Otherwise the least busy
(load over its room level), the emptier KV cache breaking ties.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

from gateway.backends.pool.replica import Replica

BLOCK_CHARS = 256
MIN_MATCH_BLOCKS = 2  # 512 characters (~128 tokens) shared: worth following
BALANCE_ABS = 4
BALANCE_REL = 1.5
_turn = itertools.count()


def prefix_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """The hashes of the text's whole leading blocks, each covering the text up to its end."""
    data = text.encode()
    h = hashlib.blake2b(digest_size=8)
    out: list[int] = []
    for end in range(block_chars, len(data) + 1, block_chars):
        h.update(data[end - block_chars:end])
        out.append(int.from_bytes(h.copy().digest(), "little"))
    return out


def _score(r: Replica, ref: int | None = None) -> float:
    """Busy share of the room level (a lower one is less loaded). A replica whose level is not learnt yet
    is measured against `ref`, the largest learnt level of the others (its cap would make it look empty)."""
    level = r.level if r.learnt or ref is None else ref
    return r.busy() / max(1, min(level, r.engine.max_in_flight))


def _ref(replicas: Sequence[Replica]) -> int | None:
    return max((r.level for r in replicas if r.learnt), default=None)


def pick(replicas: Sequence[Replica], hashes: list[int]) -> Replica | None:
    """The replica with room to send the request to, or None when none has room."""
    open_ = [r for r in replicas if r.has_room()]
    if not open_:
        return None
    ref = _ref(replicas)
    # Ties (common: equal counts) go round the ring from where the last pick was, not to the same replica.
    start = next(_turn) % len(open_)
    ring = open_[start:] + open_[:start]
    least = min(ring, key=lambda r: (_score(r, ref), r.load.kv_usage if r.load and r.load.kv_usage is not None
                                     else 0.0))
    if hashes:
        best = max(open_, key=lambda r: (r.matched_blocks(hashes), -_score(r, ref)))
        if best is not least and best.matched_blocks(hashes) >= MIN_MATCH_BLOCKS:
            gap = best.busy() - least.busy()
            if gap <= BALANCE_ABS or best.busy() <= BALANCE_REL * least.busy():
                return best
    return least


def fallback_order(replicas: Sequence[Replica], first: Replica) -> list[Replica]:
    """`first`, then the others least loaded first: where a failed try moves on to."""
    ref = _ref(replicas)
    return [first] + sorted((r for r in replicas if r is not first), key=lambda r: _score(r, ref))


def round_robin(replicas: Sequence[Replica]) -> Replica | None:
    """The next replica in turn whose breaker lets a request through (no room rule: a plain balancer)."""
    live = [r for r in replicas if r.breaker.available()]
    return live[next(_turn) % len(live)] if live else None
