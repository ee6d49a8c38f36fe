"""Driving Debian's chromium headless through Playwright, for the UI's browser tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"


def browser_or_skip() -> Any:
    """Playwright's ``sync_playwright``; skips (fails in CI) where chromium or Playwright is missing."""
    reason = None
    if not (Path(CHROMIUM).is_file() or shutil.which("chromium")):
        reason = f"chromium is not installed at {CHROMIUM} (apt-get install chromium)"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        reason = f"playwright is not installed ({exc}); pip install -e '.[dev]'"
    if reason:
        if os.environ.get("CI") or os.environ.get("CLEF_REQUIRE_BROWSER"):  # .ci/run installs chromium
            pytest.fail(reason)
        pytest.skip(reason)
    return sync_playwright


def type_into(page: Any, elem_id: str, text: str, *, replace: bool = False) -> None:
    field = page.locator(f"#{elem_id}").locator("textarea, input").first
    field.click()
    if replace:
        page.keyboard.press("Control+A")
        page.keyboard.press("Delete")
    page.keyboard.type(text)
