"""``clef-local mcp``'s ``ask_again``: a second schema about a state, by its digest, against a cold call.

    python benchmarks/mcp_ask_again.py                        # the default model, states of ~250 / 1K / 4K tokens
    python benchmarks/mcp_ask_again.py --model DIR --repeats 5 --dtype float32

The real command over stdio (a subprocess, as a desktop host launches it), driven by the MCP SDK's client. Per
state length, ``--repeats`` times: *cold*: ``decide`` with the triage example's 3-question schema on a state not sent
before (the whole state runs); *ask_again*: the same schema through ``ask_again`` on a state sent just before (the
state cache holds it: only the schema's tokens run); *direct*: ``ClefModel.decide`` on the same cold request in this
process, without MCP, for the protocol's cost. Medians; the cache's hit counter (from the ``models`` tool) must grow
by one per ``ask_again``. On a small shared machine set ``OMP_NUM_THREADS=1``. Table in
docs/benchmarks.md#mcp-ask_again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ("my card payment {i} was declined at the shop", "I was still charged for order {i}",
             "the refund for order {i} never arrived", "support ticket {i} was closed without an answer")


def state(tokens: int, salt: int) -> str:
    """A varied text of about ``tokens`` tokens (six to eight per sentence), distinct per ``salt``."""
    parts = [f"Message {salt}.{i}: " + SENTENCES[i % len(SENTENCES)].format(i=i * 7 + salt)
             for i in range(max(1, tokens // 12))]
    return " ".join(parts) + "."


async def measure(args: argparse.Namespace, model_path: str) -> list[dict[str, Any]]:
    from mcp import Client, StdioServerParameters

    import clef_local

    questions = json.loads(resources.files("clef_local.demo.examples").joinpath("triage.json").read_text())[
        "questions"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = ["-m", "clef_local.cli", "mcp", "--model", f"clef-local={model_path}",
               *(["--dtype", args.dtype] if args.dtype else [])]
    direct = clef_local.load(model_path, dtype=args.dtype, state_cache=0)
    rows = []
    params = StdioServerParameters(command=sys.executable, args=command, env=env, cwd=str(ROOT))
    async with Client(params, read_timeout_seconds=600) as client:
        async def timed(tool: str, arguments: dict[str, Any]) -> tuple[float, Any]:
            began = time.perf_counter()
            result = await client.call_tool(tool, arguments)
            if result.is_error:
                raise RuntimeError(result.content[0].text)
            return (time.perf_counter() - began) * 1000, result

        async def hits() -> int:
            listing = (await client.call_tool("models")).structured_content
            return int(listing["models"][0]["state_cache"]["hits"])

        await timed("decide", {"state": state(64, 999), "questions": questions})  # warm-up
        salt = 0
        for tokens in args.tokens:
            cold, warm, plain = [], [], []
            for _ in range(args.repeats):
                salt += 1
                request = {"state": state(tokens, salt), "questions": questions}
                cold.append((await timed("decide", request))[0])
                began = time.perf_counter()
                direct.decide({"model": "clef-local", **request})
                plain.append((time.perf_counter() - began) * 1000)
                salt += 1
                _, first = await timed("ask_yes_no", {"state": state(tokens, salt), "question": "Is it urgent?"})
                before = await hits()
                ms, _ = await timed("ask_again", {"state": first.meta["clef-local/state"], "questions": questions})
                if await hits() != before + 1:
                    raise RuntimeError("ask_again did not hit the state cache")
                warm.append(ms)
            counted = direct.encode({"model": "clef-local", "state": state(tokens, 1), "questions": questions})
            rows.append({"state_tokens": counted.state_tokens, "schema_tokens": len(counted.input_ids) -
                         counted.state_start - counted.state_tokens, "cold_ms": statistics.median(cold),
                         "ask_again_ms": statistics.median(warm), "direct_ms": statistics.median(plain)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="release directory (default: the built-in default model)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[250, 1000, 4000], help="state lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the loader's)")
    args = parser.parse_args()
    from clef_local.demo.default import default_model_path

    rows = asyncio.run(measure(args, str(args.model or default_model_path())))
    print("| state tokens | schema tokens | cold `decide` (MCP) | `ask_again` (MCP) | ratio | `ClefModel.decide`, "
          "cold, no MCP |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['state_tokens']:,} | {r['schema_tokens']} | {r['cold_ms']:,.0f} ms | {r['ask_again_ms']:,.0f} ms"
              f" | {r['cold_ms'] / r['ask_again_ms']:.1f}× | {r['direct_ms']:,.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
