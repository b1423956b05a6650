"""`python -m kernels.cpu`: builds (or finds) this machine's fused decode step now, as `make install` does."""

import logging

from .build import cache_dir, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
lib = load()
if lib is None:
    print("fused CPU decode step: not built (see above); the engine will use its torch path")
else:
    print(f"fused CPU decode step: {lib.sluice_decode_isa().decode()} build in {cache_dir()}")
