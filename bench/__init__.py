"""Benchmarks (`python -m bench.NAME`); their processes get the same OpenMP settings as `sluice serve`."""

import gateway.omp  # noqa: F401  (OpenMP settings before any benchmark imports torch)
