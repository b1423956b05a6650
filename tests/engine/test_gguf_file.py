"""engine.gguf_file against the gguf package's own reader, on the default model's file: every field
decodes to the same value and every tensor is the same array (type, shape, bytes); bad files are
refused with the reason."""

import numpy as np
import pytest

from engine.gguf_file import GGUFFile, GGUFFormatError
from engine.loader import default_model_path

pytestmark = pytest.mark.model


def test_reads_what_the_gguf_packages_reader_reads():
    import gguf

    path = default_model_path()
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the package's pseudo-fields
    assert set(ours.fields) == set(theirs.fields) - header
    for key, field in theirs.fields.items():
        if key not in header:
            assert ours.fields[key] == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(int(d) for d in b.shape))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_refuses_files_that_are_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(bad)
    old = tmp_path / "old.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFFormatError, match="version 1"):
        GGUFFile(old)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model_path().read_bytes()[:4096])  # the header, then the fields stop mid-way
    with pytest.raises(GGUFFormatError, match="truncated or corrupt"):
        GGUFFile(cut)


def _mapped_rss_kib(path) -> int:
    """This process's resident KiB of the mappings of `path` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in open("/proc/self/smaps"):
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            ours = line.rstrip().endswith(str(path))
        elif ours and first == "Rss:":
            total += int(line.split()[1])
    return total


def test_a_released_tensor_leaves_the_resident_set_and_reads_the_same():
    path = default_model_path()
    f = GGUFFile(path)
    t = next(t for t in f.tensors if t.name == "token_embd.weight")
    before = _mapped_rss_kib(path)
    want = t.data.copy()  # touches every page
    touched = _mapped_rss_kib(path)
    assert touched - before > t.data.nbytes // 1024 * 0.9
    t.release()
    assert touched - _mapped_rss_kib(path) > t.data.nbytes // 1024 * 0.9
    assert np.array_equal(t.data, want)  # read again from the page cache
