"""`python -m gateway ...` is the same as the `sluice` console script."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before anything imports torch

from gateway.cli import main

raise SystemExit(main())
