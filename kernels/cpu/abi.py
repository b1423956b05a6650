"""The ctypes mirrors of the structs the native step takes (kernels/cpu/sluice_forward.h), and the check
that a build agrees with them: a field added on one side only would otherwise be read as wrong memory,
silently. `build.compile_library` refuses a library that disagrees (the engine keeps its torch path)."""

from __future__ import annotations

import ctypes


class Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("inter", ctypes.c_int), ("layers", ctypes.c_int),
                ("block_size", ctypes.c_int), ("eps", ctypes.c_float)]


class Tiles(ctypes.Structure):
    """`layer_tiles`: a matrix's blocks and their format (TILES_*, sluice_forward.h), and with `tail` set, the
    rows after the first `rows` in their own blocks and format."""

    _fields_ = [("blocks", ctypes.c_void_p), ("format", ctypes.c_int), ("rows", ctypes.c_int),
                ("tail", ctypes.c_void_p), ("tail_format", ctypes.c_int)]


class Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", Tiles),
                ("o", Tiles), ("gate_up", Tiles), ("down", Tiles), ("qkv_bias", ctypes.c_void_p)]


def expected() -> list[int]:
    """What `sluice_abi_sizes` reports, in its order, for structs laid out as the mirrors above."""
    return [ctypes.sizeof(Dims), Dims.eps.offset, ctypes.sizeof(Layer), Layer.qkv.offset, Layer.qkv_bias.offset,
            ctypes.sizeof(Tiles), Tiles.format.offset, Tiles.tail.offset]


def mismatch(lib: ctypes.CDLL) -> str | None:
    """None when the build's structs match the mirrors; else what differs."""
    want = expected()
    out = (ctypes.c_int64 * 16)()
    have = lib.sluice_abi_sizes(out, len(out))
    got = list(out[:min(have, len(out))])
    return None if got == want else f"the C structs' sizes and offsets {got} differ from the ctypes mirrors' {want}"
