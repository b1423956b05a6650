"""OpenMP settings for torch's CPU threads, applied on import: import this before anything imports torch.

Two opposite failures bound the choice on a small shared CPU box. Threads that busy-wait
indefinitely between kernels (`OMP_WAIT_POLICY=ACTIVE`, or GNU OpenMP's default of ~3 ms of
spinning) steal the cores the event loop, the tokenizer and other processes need, and two such
processes on two cores wait on each other's descheduled threads: small ops ran up to 100x slower.
Threads that sleep at once (`PASSIVE`) must be woken for every parallel region, which costs tens of
microseconds on a VM, more than a small matmul itself: a decode step runs ~120 of them.

So threads sleep by default (`OMP_WAIT_POLICY=PASSIVE`) but first spin for a bounded
`GOMP_SPINCOUNT` (10,000 spins, ~0.1 ms): long enough to carry a worker from one op of a step to
the next, short enough that an idle engine gives its cores back at once. GNU OpenMP (torch's
Linux builds) honours an explicit spin count even under PASSIVE; either variable set by the user wins.
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
