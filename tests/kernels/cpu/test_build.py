"""kernels/cpu/build.py and abi.py: the step's parts all key the build cache, and a build whose C structs
disagree with the ctypes mirrors is refused (the engine keeps its torch path) rather than read wrongly."""

from __future__ import annotations

import shutil

import pytest

from kernels.cpu import abi
from kernels.cpu import build as cpu_build

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="no C compiler to build kernels/cpu/forward.c")


@pytest.mark.parametrize("arch", [("-march=native",), ("-march=x86-64",)])
def test_every_build_agrees_with_the_ctypes_mirrors(arch):
    lib = cpu_build.compile_library(arch)
    assert lib is not None and abi.mismatch(lib) is None
    assert lib.sluice_forward_isa().decode() in ("avx512-vnni", "avx512", "avx2", "scalar")


def test_a_struct_that_differs_refuses_the_build(monkeypatch, tmp_path, caplog):
    lib = cpu_build.load()
    assert lib is not None
    right = abi.expected()
    monkeypatch.setattr(abi, "expected", lambda: [right[0] + 4, *right[1:]])  # as if the mirror had a field more
    assert "differ from the ctypes mirrors" in (abi.mismatch(lib) or "")
    # compile_library applies the check: a fresh cache, a build, refused
    monkeypatch.setenv("SLUICE_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_build.compile_library.cache_clear()
    try:
        assert cpu_build.compile_library(("-march=x86-64",)) is None
        assert "native CPU forward step refused" in caplog.text
    finally:
        cpu_build.compile_library.cache_clear()


def test_every_part_keys_the_cache(monkeypatch, tmp_path):
    src = tmp_path / "cpu"
    shutil.copytree(cpu_build.SOURCE.parent, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(cpu_build, "SOURCE", src / "forward.c")
    parts = {p.name for p in cpu_build._sources()}
    assert {"forward.c", "sluice_forward.h", "common.h", "vec.h", "matmul.c", "attention.c", "step.c", "head.c",
            "sampler.c", "threads.c"} <= parts
    cc = cpu_build._compiler()
    assert cc is not None
    keys = {cpu_build._key(cc, ("-O3",))}
    for name in ("vec.h", "attention.c", "sluice_forward.h"):
        p = src / name
        p.write_text(p.read_text() + "\n/* changed */\n")
        keys.add(cpu_build._key(cc, ("-O3",)))
    assert len(keys) == 4  # each part's change is a new build


def test_sluice_native_march_chooses_the_build_served(monkeypatch):
    monkeypatch.setenv("SLUICE_NATIVE_MARCH", "x86-64-v3")
    assert cpu_build.target_flags() == ("-march=x86-64-v3",)
    lib = cpu_build.load()
    assert lib is not None and lib.sluice_forward_isa().decode() == "avx2"  # AVX2, whatever this CPU has beyond
    monkeypatch.setenv("SLUICE_NATIVE_MARCH", "x86-64")
    assert cpu_build.load().sluice_forward_isa().decode() == "scalar"
    monkeypatch.setenv("SLUICE_NATIVE_MARCH", "x86-64 -O0")
    with pytest.raises(ValueError, match="SLUICE_NATIVE_MARCH"):
        cpu_build.target_flags()
    monkeypatch.delenv("SLUICE_NATIVE_MARCH")
    assert cpu_build.target_flags() == ("-march=native",)
