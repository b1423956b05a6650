"""Start-up measurements kept between starts on the same machine, model and configuration.

Before it serves, an engine times synthetic steps three ways: the torch path's step plans (packed or
dense weights and thread counts by step size, engine/cpu_plan.py), from how many rows the native step
multiplies on AMX, and the scheduler's step cost model (engine/step_cost.py). On a 2-core box that is
~1.5 s of a 3.5 s native start and ~6 s of a torch-path one, paid again by every restart, by each
worker of a rolling restart and by each replica of a pool. Like Triton's autotuning cache or TensorRT's
timing cache, each result is kept on disk under a key that names everything it depends on: the machine
(CPU model and ISA flags or the GPU's name, cores, torch's version), the model (the file's path, size and
modification time, and its shapes) and the runner's choices (device, dtypes, threads, native step, block
size, ...). Anything that differs is another key, so another measurement.

One JSON file per key, written to a temporary name and renamed, so concurrent starts (N workers on one
box) never read half a file; a file that does not parse, or holds another key, is measured again and
replaced. Where: `$SLUICE_TUNING_CACHE` (a folder; `off`: measure at every start), else
`$XDG_CACHE_HOME/sluice/tuning` (~/.cache/sluice/tuning). Delete the folder to measure again, e.g. after
moving the service onto a busier or quieter box of the same kind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import torch

from kernels.cpu.cpuinfo import cpu_info

log = logging.getLogger(__name__)

VERSION = 1  # of what the entries hold; a change measures everything again
ENV = "SLUICE_TUNING_CACHE"
T = TypeVar("T")


class TuningCache:
    """`remember(kind, key, measure, encode, decode)`: the kept result for (kind, key), or `measure()`'s,
    kept. `folder` None: nothing is kept (every call measures)."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    @classmethod
    def from_env(cls) -> TuningCache:
        where = os.environ.get(ENV, "").strip()
        if where.lower() == "off":
            return cls(None)
        if where:
            return cls(Path(where))
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(Path(base) / "sluice" / "tuning")

    def remember(self, kind: str, key: dict[str, Any] | None, measure: Callable[[], T],
                 encode: Callable[[T], Any], decode: Callable[[Any], T]) -> tuple[T, bool]:
        """(result, whether it was kept from an earlier start). `key` None: this measurement is not kept
        (a model with no file behind it, e.g. random weights)."""
        if self.folder is None or key is None:
            return measure(), False
        full = {"version": VERSION, "kind": kind, **key}
        path = self.folder / f"{kind}-{hashlib.sha256(_dumps(full).encode()).hexdigest()[:24]}.json"
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") == json.loads(_dumps(full)):
                return decode(entry["value"]), True
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("tuning cache: %s unreadable (%s); measuring again", path, e)
        value = measure()
        self._write(path, {"key": full, "value": encode(value)})
        return value, False

    def _write(self, path: Path, entry: dict[str, Any]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(_dumps(entry))
            os.replace(tmp, path)
        except OSError as e:  # a read-only home, a full disk: the engine runs, the next start measures again
            log.warning("tuning cache: could not keep %s (%s)", path, e)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


@cache
def machine_key(device: str) -> dict[str, Any]:
    """What a timing on `device` depends on beyond the model and the configuration."""
    key: dict[str, Any] = {"torch": torch.__version__, "cores": os.cpu_count(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        key["gpu"] = torch.cuda.get_device_name(index)
        key["capability"] = list(torch.cuda.get_device_capability(index))
        return key
    info = cpu_info()
    name, flags = info.model_name, " ".join(sorted(info.flags))
    key["cpu"] = name
    key["flags"] = hashlib.sha256(flags.encode()).hexdigest()[:16]
    return key


def file_fingerprint(path: Path) -> str:
    """A model file or folder as path, size and modification time (a rewritten file is another model)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return f"{path.resolve()}:{stats}"
