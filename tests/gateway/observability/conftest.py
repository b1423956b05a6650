"""Browser for the dashboard tests: Debian's Chromium (`make test` installs it) driven by Playwright."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[3] / "var" / "test-artifacts"


def chromium_path() -> str | None:
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture
async def chromium(tmp_path):
    """Opens a fresh headless Chromium (its own profile under tmp_path): `await chromium(**context_options)`
    returns a browser context; all are closed at the end."""
    exe = chromium_path()
    if exe is None:
        pytest.skip("chromium is not installed and could not be (`make test` runs `apt-get install chromium`; "
                    "it needs root and the Debian archive)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("playwright is missing: install the dev extra (`pip install -e '.[dev]'`)")
    contexts = []
    async with async_playwright() as pw:
        async def launch(**options):
            # Playwright passes the profile as --user-data-dir (a fresh one per context).
            ctx = await pw.chromium.launch_persistent_context(
                str(tmp_path / f"chromium-profile-{len(contexts)}"), executable_path=exe, headless=True,
                args=CHROMIUM_ARGS, **options)
            contexts.append(ctx)
            return ctx
        try:
            yield launch
        finally:
            for ctx in contexts:
                await ctx.close()
