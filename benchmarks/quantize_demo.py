"""``clef-local quantize --bits 4`` on the demo model, end to end as a user runs it: time, group, validation.

    python benchmarks/quantize_demo.py                           # the default --bits 4 (group size from the source)
    python benchmarks/quantize_demo.py --groups default 64       # and --group-size 64 beside it

Each run is the real command in a fresh subprocess (``python -m clef_local.cli quantize --bits 4 --out …``, with
validation on the packaged probe set) into a temporary directory; the table gives its exit code, wall time, the
group size it wrote, bits per weight, and the validation metrics from the variant's ``validation.json`` (for a run
that fails validation the variant is not written, so they are read from the error line instead).
Table in docs/benchmarks.md#quantize---bits-4-on-the-demo-model-end-to-end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clef_local.demo.default import default_model_path


def run(model: Path, out: Path, group: str) -> dict[str, object]:
    """One ``quantize --bits 4`` subprocess; what it printed, its exit code, time and (when written) validation."""
    cmd = [sys.executable, "-m", "clef_local.cli", "quantize", "--model", str(model), "--bits", "4", "--out", str(out)]
    if group != "default":
        cmd += ["--group-size", group]
    started = time.perf_counter()
    # rich wraps at 80 columns in a pipe; wide enough that the summary's "group size" line stays whole
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
    row: dict[str, object] = {"command": " ".join(["clef-local", *cmd[3:]]).replace(str(model), "DEMO").replace(
        str(out), "V"), "exit": proc.returncode, "seconds": time.perf_counter() - started, "group": group}
    if proc.returncode == 0:
        config = json.loads((out / "config.json").read_text())["quantization_config"]["clef_local"]
        manifest = json.loads((out / "clef_local_manifest.json").read_text())
        validation = json.loads((out / "validation.json").read_text())
        row.update(written=config["group_size"], bits=manifest["scheme"]["bits_per_weight"],
                   flips=f"{validation['flips']} / {validation['questions']}", passed=validation["passed"],
                   **validation["metrics"])
    else:
        error = next((line for line in proc.stderr.splitlines() if line.startswith("error: ")), proc.stderr[-300:])
        row.update(written="—", bits=None, error=error, passed=False)
        for name, value in re.findall(r"(mean_kl|flip_rate) ([0-9.e-]+) >", error):
            row[name] = float(value)
    row["summary"] = "\n".join(line for line in proc.stdout.splitlines() if "group size" in line)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the source release (default: the demo model)")
    parser.add_argument("--groups", nargs="+", default=["default"], help="'default' (no --group-size) and/or sizes")
    args = parser.parse_args()
    model = args.model or default_model_path()
    rows = []
    with tempfile.TemporaryDirectory(prefix="quantize-demo-") as tmp:
        for group in args.groups:
            rows.append(run(model, Path(tmp) / f"int4-{group}", group))
    print(f"source: {model}")
    print("| command | exit | seconds | group written | bits/weight | mean KL | max KL | flips | max \\|Δp\\| | "
          "validation |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")

    def fmt(value: object, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    def flips(row: dict[str, object]) -> str:
        rate = fmt(row.get("flip_rate"), ".1%")
        return f"{row['flips']} ({rate})" if "flips" in row else rate

    for r in rows:
        verdict = "✓ written" if r["exit"] == 0 else f"✗ {r.get('error', '')}"
        print(f"| `{r['command']}` | {r['exit']} | {r['seconds']:.0f} | {r['written']} | {fmt(r['bits'], '.2f')} | "
              f"{fmt(r.get('mean_kl'), '.4f')} | {fmt(r.get('max_kl'), '.3f')} | {flips(r)} | "
              f"{fmt(r.get('max_abs_dp'), '.3f')} | {verdict} |")
    for r in rows:
        if r["summary"]:
            print(f"{r['group']}: {r['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
