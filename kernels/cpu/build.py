"""Compiles `forward.c` (with the parts it includes) for this machine on first use and caches the library.

Compiled here rather than shipped: `-march=native` picks AVX-512, AVX2 or plain C for the CPU at hand,
and a C compiler is all it needs (no torch headers, so a build takes about a second). The cache key
covers every source part, the flags, the compiler and the CPU's flags, so a copied cache directory on
another machine builds afresh. No compiler, or a failed build: `None`, and the engine keeps its
torch path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import abi
from .cpuinfo import cpu_info

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("forward.c")  # the one unit; it includes the other parts


def _sources() -> list[Path]:
    """Every part of the step (forward.c includes the others): all of them key the cache."""
    return sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".c", ".h"))
COMMON_FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared", "-pthread")
NATIVE = ("-march=native",)  # what serving uses; tests also build x86-64-v3 (AVX2) and plain x86-64


def cache_dir() -> Path:
    """`SLUICE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/sluice/kernels` (~/.cache/sluice/kernels)."""
    if env := os.environ.get("SLUICE_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _key(cc: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in (*(p.name.encode() + p.read_bytes() for p in _sources()), " ".join(flags).encode(), version.encode(),
                 cpu_info().flags_line.encode()):
        h.update(part)
    return h.hexdigest()[:16]


def target_flags() -> tuple[str, ...]:
    """`-march=native`, or `-march=$SLUICE_NATIVE_MARCH` (e.g. `x86-64-v3`: the AVX2 code path on a CPU that
    has AVX-512, to serve a fleet's common ISA or to time the AVX2 path where no AVX2-only CPU is at hand)."""
    march = os.environ.get("SLUICE_NATIVE_MARCH", "").strip()
    if not march:
        return NATIVE
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march):  # one compiler word, never an option of its own
        raise ValueError(f"SLUICE_NATIVE_MARCH={march!r} is not a -march value (e.g. native, x86-64-v3)")
    return (f"-march={march}",)


def load() -> ctypes.CDLL | None:
    """The library for this machine (built now if not cached), or None where it cannot be built."""
    return compile_library(target_flags())


@functools.cache
def compile_library(arch: tuple[str, ...]) -> ctypes.CDLL | None:
    """`forward.c` built with the target flags `arch` (e.g. `("-march=native",)`), cached on disk."""
    cc = _compiler()
    if cc is None:
        log.warning("native CPU forward step: no C compiler (cc/gcc) found; using the torch path")
        return None
    flags = (*COMMON_FLAGS, *arch)
    try:
        target = cache_dir() / f"forward-{_key(cc, flags)}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # Build beside the target and rename: processes that start together never load half a file.
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                result = subprocess.run([cc, *flags, "-o", str(out), str(SOURCE), "-lm"],
                                        capture_output=True, text=True, timeout=300)
                if result.returncode != 0:
                    log.warning("native CPU forward step: %s failed to build it (%s); using the torch path",
                                cc, result.stderr.strip()[-500:])
                    return None
                os.replace(out, target)
            log.info("native CPU forward step built: %s", target)
        lib = ctypes.CDLL(str(target))
        lib.sluice_abi_sizes.restype = ctypes.c_int
        if (wrong := abi.mismatch(lib)) is not None:
            log.error("native CPU forward step refused: %s; using the torch path", wrong)
            return None
        for fn in (lib.sluice_forward, lib.sluice_decode_attention, lib.sluice_amx_available,
                   lib.sluice_head_logits, lib.sluice_gguf_rows, lib.sluice_gguf_rows_product, lib.sluice_sample,
                   lib.sluice_sample_masked, lib.sluice_rms_norm, lib.sluice_reads_tiles):
            fn.restype = ctypes.c_int  # (ctypes' default; said once here rather than per call)
        lib.sluice_gguf_row_bytes.restype = ctypes.c_int64
        lib.sluice_forward_isa.restype = lib.sluice_wide_matmul.restype = ctypes.c_char_p
        lib.sluice_profile.restype = lib.sluice_profile_read.restype = None
        return lib
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native CPU forward step unavailable (%s); using the torch path", e)
        return None

