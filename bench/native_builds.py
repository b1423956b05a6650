"""The native step's matmul paths side by side on one model, in one process: a decode step of each batch size
through the first layers with int16 matmuls (wide_min_rows=0), with the int8 matmul (with bf16 dot products
on F16/BF16 tiles where the CPU has AVX-512 BF16), on AMX tiles where the CPU has them, and with the int8 matmul of the same sources
built without AVX-512 BF16 (`-mno-avx512bf16`: int8 with fp32 FMAs on the 16-bit tiles, as on a CPU with
VNNI and no BF16), and on an AVX2 build (`SLUICE_NATIVE_MARCH=x86-64-v3`) whose CPU has AVX-VNNI, the same
sources with `-mavxvnni`. Same weights, same KV cache, same threads; times are medians of `--steps` steps and the
ratios are against the int16 matmuls.

    python -m bench.random_gguf --shape smollm2-135m --type F16 --out /tmp/smol-F16.gguf
    python -m bench.native_builds --model /tmp/smol-F16.gguf [--batches 1,4,16,64] [--context 128]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import time

import torch

from engine import EngineConfig, LLMEngine
from kernels.cpu import build as cpu_build
from kernels.cpu.cpuinfo import cpu_info


def step_ms(engine: LLMEngine, batch: int, context: int, wide: tuple[int, int], steps: int) -> float:
    runner = engine.runner
    step = runner._synthetic_decode(batch, context)
    runner.model.hidden(*step, wide_rows=wide)  # warm
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.model.hidden(*step, wide_rows=wide)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the packaged model)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    print("\n".join(ln for ln in lscpu if ln.startswith(("Model name", "CPU(s)"))))
    print("Flags: " + " ".join(f for ln in lscpu if ln.startswith("Flags") for f in ln.split()
                               if f.startswith(("avx512", "amx", "avx2", "avx_vnni"))))
    engine = LLMEngine(EngineConfig(model=a.model, kv_cache_tokens=max(64, max(map(int, a.batches.split(",")))) *
                                    (a.context + 16), max_running_requests=256, wide_min_rows=0))
    native = engine.runner.model.native
    if native is None:
        raise SystemExit("no native CPU step for this model here")
    print(f"native step {native.isa}, wide matmul {native.wide or 'none'}, tiles {native.tile_formats()}, "
          f"{engine.runner.kernels.threads} threads, context {a.context}")
    variants: dict[str, tuple[ctypes._CFuncPtr, tuple[int, int]]] = {"int16": (native._fn, (0, 0))}
    if native.wide:
        variants[f"wide ({native.wide})"] = (native._fn, (1, 0))
    if native.amx:
        variants["AMX (bf16 tiles)"] = (native._fn, (0, 1))
    if native.wide == "int8+bf16":
        other = cpu_build.compile_library(("-march=native", "-mno-avx512bf16"))
        other.sluice_wide_matmul.restype = ctypes.c_char_p
        variants[f"wide ({other.sluice_wide_matmul().decode()}, -mno-avx512bf16)"] = (other.sluice_forward, (1, 0))
    if native.wide == "int8 4-6 bit" and "avx_vnni" in cpu_info().flags:
        # the same AVX2 sources with AVX-VNNI (as -march=native builds them on an AVX2 CPU that has it):
        # vpdpbusd for the int8 products, and int8 inputs for the int8-range tiles too
        other = cpu_build.compile_library(cpu_build.target_flags() + ("-mavxvnni",))
        other.sluice_wide_matmul.restype = ctypes.c_char_p
        variants[f"wide ({other.sluice_wide_matmul().decode()})"] = (other.sluice_forward, (1, 0))
    print(f"{'batch':>5}  " + "  ".join(f"{k:>34}" for k in variants))
    for b in map(int, a.batches.split(",")):
        row = {}
        for name, (fn, wide) in variants.items():
            native._fn = fn
            row[name] = step_ms(engine, b, a.context, wide, a.steps)
        native._fn = variants["int16"][0]
        base = row["int16"]
        print(f"{b:>5}  " + "  ".join(f"{ms:9.2f} ms ({base / ms:4.2f}x int16)".rjust(34) for ms in row.values()))


if __name__ == "__main__":
    main()
