"""Hostile tool calls against ``clef-local mcp`` (``scripts/mcp_abuse.py``, shortened: 160 calls over stdio, every
kind): no crash, no 5xx, no call lost, the server's RSS flat and its good calls answered, the last one too. The full
1,000-call run and its numbers: docs/benchmarks.md#mcp-hostile-calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hostile_calls_leave_the_server_answering(tiny_llama: Path, tiny_vision: Path, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "mcp_abuse.py"), "--model", str(tiny_llama),
                             "--vision", str(tiny_vision), "--calls", "160", "--every", "20", "--json", str(out)],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    print("\n" + result.stdout)
    assert len(summary["kinds"]) == 8 and sum(sum(k.values()) for k in summary["kinds"].values()) == 160
    assert summary["server_5xx"] == 0 and summary["lost"] == 0
    assert summary["good_failed"] == 0 and summary["last_good_answered"] and summary["good"] == 8 + 4
    answered = {kind: counts.get("answer", 0) for kind, counts in summary["kinds"].items()}
    # every hostile kind is refused, except odd Unicode, which is valid text (answered or refused, never a crash)
    assert all(n == 0 for kind, n in answered.items() if kind != "odd unicode"), summary["kinds"]
    assert set(summary["kinds"]["unknown tools"]) == {"protocol error -32602"}
    # flat: the first 10 MB strings and the vision model's first images raise the allocator's high-water mark, the
    # two bounded caches fill (a 32 MiB state cache, 8 MiB of remembered states); over the last quarter of the calls
    # (samples: before, after each quarter, at the end) nothing may grow by more than those caches: five leaked 10 MB
    # strings a quarter would show
    rss = summary["rss_mib"]
    assert rss[-1] - rss[len(rss) // 2] < 40 + 20 and summary["peak_mib"] - rss[0] < 600, rss
