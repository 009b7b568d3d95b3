"""What the browser tests share: Debian's chromium driven by playwright (no browser download),
skipped where it is missing — except under CI, which installs it (.ci/run) — and a page that
records every console error and uncaught exception (`page.errors`). The `browser` fixture is in
conftest.py."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def require_browser() -> None:
    """Call at a test module's top: skips the module when there is no browser to drive."""
    if not CHROMIUM or not __import__("importlib").util.find_spec("playwright"):
        if os.environ.get("CI") == "true":
            raise RuntimeError("the browser tests need Debian's chromium and playwright: .ci/run installs them")
        pytest.skip("no chromium or playwright here (apt-get install chromium; pip install playwright)",
                    allow_module_level=True)


def launch(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])


def watch(pg):
    """The page with `errors`: its console errors and uncaught exceptions, as they come."""
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(f"{m.text} ({m.location.get('url', '')})") if m.type == "error" else None)
    pg.errors = errors
    return pg
