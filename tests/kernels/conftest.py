"""Kernel tests: each Triton kernel against its torch reference.

Without a GPU they run on the CPU under TRITON_INTERPRET=1, which must be set before `triton` is
imported (Triton builds its own library functions as interpreted or compiled at import, and each
`@triton.jit` kernel when its module is imported). `import kernels` never imports Triton, and the test
modules import `kernels.triton` after this file has run, so setting it here, at collection, is early
enough; the rest of the suite never launches a Triton kernel on CPU tensors, so the variable changes
nothing for it.
With a CUDA GPU (and TRITON_INTERPRET unset) the same tests run the compiled kernels on the GPU.
"""

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
    DEV = "cuda"
    _LATE = False
else:
    DEV = "cpu"
    _LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1"
    os.environ["TRITON_INTERPRET"] = "1"


def _interpret_triton_library() -> bool:
    """When something imported Triton before this file could set TRITON_INTERPRET (in the full suite,
    transformers -> torch._dynamo does), Triton's own library functions (tl.max, tl.sum, tl.cdiv,
    tl.zeros, ...) were built as compiled-only functions that the interpreter cannot call. On a machine
    without a GPU nothing can compile anyway, so rewrap them as interpreted functions. True if it worked."""
    try:
        import triton.language as tl
        import triton.language.standard as std
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except Exception:  # pragma: no cover - a Triton without these internals
        return False
    for mod in (tl, std, tl.math):
        for name, val in list(vars(mod).items()):
            if isinstance(val, JITFunction):
                setattr(mod, name, InterpretedFunction(val.fn))
    return True


if _LATE and _interpret_triton_library():
    _LATE = False

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    # One bf16 ulp is 2**-8 relative; the interpreter also rounds ties away from even.
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _kernel_env(monkeypatch):
    if _LATE:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run tests/kernels on its own")
    monkeypatch.delenv("SLUICE_KERNELS", raising=False)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def paged_layout(seq_lens, block_size, max_blocks=None, seed=0, spare_blocks=3):
    """Random, non-contiguous block tables for `seq_lens` ([S] ints): (block_tables int32 [S, mb], num_slots)."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    mb = max_blocks or max(max(need), 1)
    total = sum(need) + spare_blocks
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(len(seq_lens), mb, dtype=torch.int32)
    i = 0
    for s, nb in enumerate(need):
        tables[s, :nb] = perm[i:i + nb].to(torch.int32)
        i += nb
    return tables, total * block_size
