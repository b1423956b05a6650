"""Fixtures for the gateway tests: `providers` (two fault-injecting mock providers on loopback), used by
backends/remote, routing and observability. The helpers live in tests/fixtures/; the real gateway and
redis-server session fixtures are registered for every folder by tests/conftest.py."""

from tests.fixtures.providers import providers  # noqa: F401
