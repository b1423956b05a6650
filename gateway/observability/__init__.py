"""Prometheus metrics and rate-limited logging."""
