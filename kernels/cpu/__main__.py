"""`python -m kernels.cpu`: builds (or finds) this machine's native forward step now, as `make install` does."""

import logging

from .build import cache_dir, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
lib = load()
if lib is None:
    print("native CPU forward step: not built (see above); the engine will use its torch path")
else:
    amx = " + AMX" if lib.sluice_amx_available() else ""
    print(f"native CPU forward step: {lib.sluice_forward_isa().decode()}{amx} build in {cache_dir()}")
