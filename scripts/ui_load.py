"""A check, not a benchmark: ``clef-local ui`` in a real browser (page load, one run) and the README screenshot.

    python scripts/ui_load.py                     # the demo model; writes the README screenshot docs/ui.png
    python scripts/ui_load.py --model DIR --screenshot /tmp/ui.png --runs 5

The real CLI (``clef-local ui``) runs in its own process on a free loopback port; Debian's chromium, driven
headless by Playwright, opens the page. "Interactive" is the schema builder rendered with the example's inputs
(``#q0-id``); "model ready" is the model panel after the page's load event has loaded the model. A run is
the click on **Run** (the ticket-triage example: noul + 4-way choice + 4-level score) until its bars are on
the page; "decide" is the model time the page reports for it. One table is printed, in seconds (the last run's
numbers: docs/benchmarks.md#ui).
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, process: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"clef-local ui exited with status {process.returncode} before serving")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"clef-local ui did not answer at {url} within {timeout:.0f} s")


def _open(page: Any, url: str) -> tuple[float, float]:
    """(seconds to interactive, seconds to model ready) from navigation start."""
    started = time.perf_counter()
    page.goto(url)
    page.locator("#q0-id").wait_for(timeout=120_000)
    interactive = time.perf_counter() - started
    page.locator("#model-status").get_by_text("Model ready").wait_for(timeout=300_000)
    return interactive, time.perf_counter() - started


def _run_once(page: Any) -> tuple[float, float]:
    """(click-to-bars seconds, decide seconds the page reports) for one click on Run."""
    tracker = "#results [data-testid=status-tracker]"  # gradio's per-output spinner: not .hide while running
    started = time.perf_counter()
    page.click("#run")
    page.wait_for_function(f"!document.querySelector('{tracker}').classList.contains('hide')", timeout=10_000)
    page.wait_for_function(f"document.querySelector('{tracker}').classList.contains('hide')", timeout=300_000)
    page.locator("#results .clef-bar").first.wait_for(timeout=10_000)
    wall = time.perf_counter() - started
    match = re.search(r"([0-9.]+) s", page.locator("#status").inner_text())
    return wall, float(match.group(1)) if match else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="release directory (default: the demo model)")
    parser.add_argument("--runs", type=int, default=3, help="warm runs after the first (median reported)")
    parser.add_argument("--screenshot", default=str(ROOT / "docs" / "ui.png"), help="where the screenshot goes")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    from clef_local.demo.default import default_model_path

    model = args.model or str(default_model_path())
    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "clef_local.cli", "ui", "--model", model, "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(url, process)
        server_start = time.perf_counter() - started
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            cold_interactive, cold_ready = _open(page, url)
            first_wall, first_decide = _run_once(page)
            warm = [_run_once(page) for _ in range(args.runs)]
            Path(args.screenshot).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.screenshot, full_page=True)
            warm_interactive, warm_ready = _open(page, url)
            browser.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
    rows = [
        ("server start (`clef-local ui` process → HTTP 200)", server_start),
        ("page load → interactive (builder rendered), cold", cold_interactive),
        ("page load → model ready (model loads on first visit)", cold_ready),
        ("page load → interactive, model already loaded", warm_interactive),
        ("page load → model ready, model already loaded", warm_ready),
        ("first run: click Run → bars (triage, 3 questions)", first_wall),
        ("  of which decide (as the page reports)", first_decide),
        (f"warm run: click Run → bars (median of {args.runs})", statistics.median(w for w, _ in warm)),
        ("  of which decide", statistics.median(d for _, d in warm)),
    ]
    print(f"model: {model}")
    print("| measure | seconds |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} |")
    print(f"screenshot: {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
