"""OpenMP settings for torch's CPU threads, applied on import: import this before anything imports torch.

Threads that busy-wait between kernels (`OMP_WAIT_POLICY=ACTIVE`, or GNU OpenMP's default of ~3 ms
of spinning) steal the cores the event loop, the tokenizer and other processes need, and two such
processes on two cores wait on each other's descheduled threads: small ops ran up to 100x slower. So
threads sleep at once (`OMP_WAIT_POLICY=PASSIVE`). Waking them costs tens of microseconds per
parallel region on a VM, which is why the engine measures, per step size, whether a step is faster
on fewer threads (engine/cpu_plan.py).

A bounded spin does not pay in a server either: with `GOMP_SPINCOUNT=10000` (~0.1 ms) a batch-4 decode
step of the engine alone ran ~20% faster, but `sluice serve` on 2 cores streamed fewer tokens (c=1: 23-25
against 30-36 tok/s; c=4: 70 against 78-89, same run, `bench` A/B), the spinning worker taking the core
the event loop needs. A value set by the user wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
