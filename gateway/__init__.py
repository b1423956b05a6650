"""Sluice gateway: the OpenAI-compatible HTTP front (auth, tiers, queueing, SSE) that drives the engine.

Importing this package must not import torch: the CLI sets OMP_WAIT_POLICY before the engine loads.
"""
