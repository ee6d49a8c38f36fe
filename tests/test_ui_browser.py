"""One real-browser test of ``clef-local ui`` on the demo model: Debian's chromium driven headless by Playwright.

Open the page, clear the example, add a choice question with three options by clicking and typing, run it, and
check that three bars and their numbers appear (they sum to 1, the decision is the tallest bar, the table agrees).
The screenshot goes to the test's tmp dir; ``python scripts/ui_load.py`` takes the README's into docs/ui.png.
Skips (with the reason) where chromium or Playwright is missing; in CI (``CI`` or ``CLEF_REQUIRE_BROWSER`` set),
where ``.ci/run`` installs chromium, a missing browser fails instead.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import CHROMIUM, browser_or_skip, type_into

OPTIONS = {"cards": "Card payments and duplicate charges", "transfers": "Bank transfers", "account": "Login"}


@pytest.fixture
def app_url(demo_release: Path) -> Iterator[str]:
    from clef_local.app.ui import build_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    demo = build_app(demo_release)
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield demo.local_url
    finally:
        demo.close()


@pytest.mark.slow
def test_build_and_run_a_choice_question_in_chromium(app_url: str, tmp_path: Path) -> None:
    sync_playwright = browser_or_skip()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(app_url)
            page.locator("#q0-id").wait_for(timeout=60_000)  # the builder rendered the example
            page.locator("#model-status").get_by_text("Model ready").wait_for(timeout=180_000)

            page.click("#clear-questions")
            page.locator("#no-questions").wait_for()
            page.click("#add-question")
            page.locator("#q0-options").wait_for()
            type_into(page, "q0-id", "team", replace=True)
            type_into(page, "q0-instructions", "Which team should handle this ticket?")
            type_into(page, "q0-options", "\n".join(f"{k}: {v}" for k, v in OPTIONS.items()))
            type_into(page, "state", "I was charged twice for my coffee this morning.", replace=True)
            page.locator("#validation").get_by_text("Valid request: 1 question.").wait_for(timeout=30_000)

            page.click("#run")
            bars = page.locator("#results .clef-bar")
            bars.nth(2).wait_for(timeout=120_000)
            assert bars.count() == 3
            numbers = [float(t) for t in page.locator("#results .clef-p").all_inner_texts()]
            assert len(numbers) == 3 and sum(numbers) == pytest.approx(1.0, abs=2e-4)
            assert numbers == sorted(numbers, reverse=True)  # sorted by probability
            labels = page.locator("#results .clef-label").all_inner_texts()
            assert sorted(labels) == sorted(OPTIONS)
            decision = page.locator("#results .clef-decision").inner_text()
            assert decision == labels[0]
            confidence = float(page.locator("#results .clef-confidence").inner_text())
            assert confidence == pytest.approx((numbers[0] - 1 / 3) / (1 - 1 / 3), abs=2e-4)
            status = page.locator("#status").inner_text()
            assert "input tokens" in status and " s" in status
            assert "team" in page.locator("#summary").inner_text()
            page.screenshot(path=str(tmp_path / "ui.png"), full_page=True)
            assert (tmp_path / "ui.png").stat().st_size > 10_000
        finally:
            browser.close()
