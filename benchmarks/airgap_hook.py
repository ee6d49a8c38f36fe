"""What the air gap's audit hook costs: per audited event, with no hook, the hook installed but off, and on.

    python benchmarks/airgap_hook.py                 # 200,000 calls per row, best of 5

Each state runs in a fresh interpreter (a hook cannot be removed). Rows: ``sys._getframe()`` (an audited call that
logging, typing and warnings make often: the cost every process pays once the hook exists), ``open()`` + close of a
small file (another frequent audited event), and ``socket.getaddrinfo("127.0.0.1", 80)`` (a socket event the hook
checks; numeric, so no lookup). Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = """
import json, socket, sys, time
state, calls, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if state != "none":
    from clef_local.airgap import airgap
    guard = airgap()
    guard.__enter__()
    if state == "off":
        guard.__exit__(None, None, None)

def best(fn, n):
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn(n)
        times.append(time.perf_counter() - start)
    return 1e9 * min(times) / n

def frames(n):
    for _ in range(n):
        sys._getframe()

def opens(n):
    for _ in range(n // 20):
        open(path, "rb").close()

def lookups(n):
    for _ in range(n // 20):
        socket.getaddrinfo("127.0.0.1", 80)

print(json.dumps({"getframe": best(frames, calls), "open": best(opens, calls) * 20,
                  "getaddrinfo": best(lookups, calls) * 20}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000, help="calls per row (default 200,000)")
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.NamedTemporaryFile() as file:
        for state in ("none", "off", "on"):
            done = subprocess.run([sys.executable, "-c", CHILD, state, str(args.calls), file.name],
                                  capture_output=True, text=True, check=True)
            rows[state] = json.loads(done.stdout)
    labels = {"none": "no hook", "off": "hook installed, guard off", "on": "guard on"}
    print(f"{'state':<26} {'sys._getframe ns':>16} {'open+close ns':>14} {'getaddrinfo ns':>15}")
    for state, row in rows.items():
        print(f"{labels[state]:<26} {row['getframe']:>16.0f} {row['open']:>14.0f} {row['getaddrinfo']:>15.0f}")
    for key in ("getframe", "open", "getaddrinfo"):
        print(f"{key}: hook off +{rows['off'][key] - rows['none'][key]:.0f} ns, guard on "
              f"+{rows['on'][key] - rows['none'][key]:.0f} ns per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
