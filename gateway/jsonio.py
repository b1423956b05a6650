"""JSON on the per-request and per-token paths: orjson (several times faster than the stdlib in both
directions, measured in bench/remote_overhead.py), with the stdlib as the fallback for what orjson
refuses, so nothing that parsed or encoded before fails now.

Output is compact (`{"a":1}`) and keeps non-ASCII text as UTF-8: for strings, ints, lists and dicts
it is byte for byte `json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()` (floats are
written differently, e.g. `0.00001` against `1e-05`: where those bytes matter, use the stdlib).
"""

from __future__ import annotations

import json

import orjson


def dumps(obj: object) -> bytes:
    """Compact UTF-8 JSON. What orjson refuses (an int beyond 64 bits, a lone surrogate, a non-str
    dict key) goes through the stdlib, which encodes it or raises as it always did."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes | str) -> object:
    """Parsed JSON. What orjson refuses but the stdlib reads (NaN/Infinity literals, an escaped lone
    surrogate) is read by the stdlib; anything else raises `ValueError` (`json.JSONDecodeError`). An
    integer beyond 64 bits is read as a float (the stdlib: an int)."""
    try:
        return orjson.loads(data)
    except ValueError:  # orjson.JSONDecodeError, a json.JSONDecodeError
        return json.loads(data)
