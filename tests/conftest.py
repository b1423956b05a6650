"""Suite-wide environment, set before anything imports torch or triton.

OMP_WAIT_POLICY=PASSIVE: on a small shared CPU box torch's OpenMP threads otherwise busy-wait between
ops and make small ops up to 100x slower. TRITON_INTERPRET=1 without a GPU: Triton kernels then run on
the CPU (Triton reads it at import, and transformers imports Triton while the suite is collected).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.fixtures.servers import real_gateway, redis_server  # noqa: F401  (session fixtures for every folder)
