"""The first processor's name and flags from /proc/cpuinfo, read once per process.

Three decisions key on them: the native step's build cache (kernels/cpu/build.py), the tuning cache's
machine key (engine/tuning_cache.py) and whether the CPU has bf16 units (engine/cpu_plan.py). One
reader keeps them agreeing on what "this CPU" is.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    flags_line: str  # as the kernel wrote it (order kept), for keys that hash it


@cache
def cpu_info() -> CpuInfo:
    """The first processor's fields; empty flags where /proc/cpuinfo cannot be read (not Linux)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            fields.setdefault(field.strip(), value.strip())
            if "flags" in fields and "model name" in fields:
                break
    except OSError:
        pass
    line = fields.get("flags", "")
    return CpuInfo(fields.get("model name") or platform.processor(), frozenset(line.split()), line)
