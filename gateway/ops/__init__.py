"""Operators' tools: `sluice bench` (bench/), a load generator for any OpenAI-compatible URL."""
