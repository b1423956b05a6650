"""Prometheus metrics (the one registry every layer writes to), rate-limited logging, and the
operator's dashboard: its data, read from that registry and the running gateway, and its static page."""
