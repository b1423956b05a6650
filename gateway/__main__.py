"""`python -m gateway ...` is the same as the `sluice` console script."""

import gateway.omp  # noqa: F401  (OpenMP settings, before anything imports torch)
from gateway.cli import main

raise SystemExit(main())
