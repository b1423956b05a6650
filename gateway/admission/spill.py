"""A spill file: spend that could not be written where it belongs (the usage ledger, the Redis totals),
kept durably until it can be, so nothing a gateway accepted vanishes from its books.

One JSON object per line, written in batches; every line of a batch carries the batch's id (`b`), so
the store that takes a batch in can remember the id in the same transaction and a batch imported just
before a crash (the file not yet cleared) is never counted twice. The file is 0600 (it holds key names and
spend), appended under an exclusive `flock` with an fsync (gateways sharing a directory share it safely),
bounded by `max_bytes`, and a batch that cannot be written whole is cut off again, so a reader never
sees half of one. A torn last line (a crash mid-append) is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("sluice.usage")

FILE_MODE = 0o600


@dataclass(frozen=True)
class SpillBatch:
    id: str
    records: list[dict[str, Any]]


@contextlib.contextmanager
def _locked(path: Path, flags: int, lock: int) -> Iterator[int]:
    """The file, open and locked. Retried when another process replaced or removed it while this one
    waited for the lock: a batch appended to a file no longer at `path` would be lost."""
    while True:
        fd = os.open(path, flags, FILE_MODE)
        try:
            fcntl.flock(fd, lock)
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)


class Spill:
    def __init__(self, path: str | os.PathLike[str], max_bytes: int = 64 * 1024 * 1024):
        self.path = Path(path)
        self.max_bytes = max_bytes

    def append(self, records: Sequence[dict[str, Any]]) -> str:
        """Write one batch durably; returns its id. Raises OSError when it cannot be written whole (the
        disk is full, or the file would pass `max_bytes`): then nothing of it stays in the file."""
        batch = uuid.uuid4().hex
        data = "".join(json.dumps({"b": batch, **r}, separators=(",", ":")) + "\n" for r in records).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, fcntl.LOCK_EX) as fd:
            os.fchmod(fd, FILE_MODE)
            size = os.fstat(fd).st_size
            if size + len(data) > self.max_bytes:
                raise OSError(errno.EFBIG, f"the spill file would pass its limit of {self.max_bytes} bytes")
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)  # no half batch left behind
                raise
        return batch

    def batches(self) -> list[SpillBatch]:
        """Every whole batch in the file, oldest first; [] when there is no file."""
        try:
            with _locked(self.path, os.O_RDONLY, fcntl.LOCK_SH) as fd, os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return []
        out: dict[str, list[dict[str, Any]]] = {}
        bad = 0
        for line in raw.splitlines():
            try:
                rec = json.loads(line)
                batch = rec.pop("b")
            except (ValueError, KeyError, TypeError, AttributeError):
                bad += 1
                continue
            out.setdefault(str(batch), []).append(rec)
        if bad:
            log.warning("spill file %s: %d unreadable lines skipped (a write cut short)", self.path, bad)
        return [SpillBatch(b, recs) for b, recs in out.items()]

    def remove(self, batch_ids: set[str]) -> None:
        """Drop these batches (taken in by their store); batches appended meanwhile stay. On a full disk
        the rewrite may fail: the file then stays as it is, and the store's record of the ids it took in
        keeps them from being counted twice."""
        if not batch_ids:
            return
        try:
            with _locked(self.path, os.O_RDWR, fcntl.LOCK_EX) as fd, os.fdopen(os.dup(fd), "rb") as f:
                lines = f.read().splitlines(keepends=True)
                keep = [ln for ln in lines if _batch_of(ln) not in batch_ids]
                if not keep:
                    os.unlink(self.path)
                    return
                if len(keep) == len(lines):
                    return
                tmp = self.path.with_name(self.path.name + ".tmp")
                wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
                try:
                    with os.fdopen(wfd, "wb") as w:
                        w.write(b"".join(keep))
                        w.flush()
                        os.fsync(w.fileno())
                    os.replace(tmp, self.path)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
        except FileNotFoundError:
            return


def _batch_of(line: bytes) -> str | None:
    try:
        return str(json.loads(line)["b"])
    except (ValueError, KeyError, TypeError):
        return None
