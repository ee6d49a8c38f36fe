"""``clef-local probe``: metamorphic robustness of a release — rewrites of each request that must not change its
answers (option order, question order, renamed question ids, renamed option ids, irrelevant context, the state as
JSON or text), each with its mean |Δp|, flipped share and their intervals; gates like drift's (exit 1 when one
fails). Without ``--data`` the built-in probe set is used. docs/quality.md#probe.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from clef_local.options import add_model_flags, load_options, model_path
from clef_local.quality import command
from clef_local.quality.command import add_output_flags, add_request_flags
from clef_local.quality.gates import Gate, Lookup, bound_of, parse_gates
from clef_local.quality.intervals import add_interval_flags
from clef_local.quality.probe import CHECKS, run_probe
from clef_local.quality.results import ProbeResult

METRICS = ("mean_abs_dp", "kl_mean", "max_abs_dp", "flip_rate", "flips")
ALIASES = {"dp": "mean_abs_dp", "kl": "kl_mean", "max_dp": "max_abs_dp", "flips": "flip_rate", "flip_count": "flips"}
BOUNDED = ("mean_abs_dp", "kl_mean", "flip_rate")


def probe_gates(text: str | None, level: str = "95") -> list[Gate]:
    """``"flips<=0.02@upper95,option_order.dp<=0.001"``: a gate without a check applies to every check."""
    return parse_gates(text, metrics=METRICS, scopes=CHECKS, aliases=ALIASES, bounded=BOUNDED, level=level,
                       example="dp<=0.05, option_order.flips<=0@upper95")


def probe_lookup(result: ProbeResult) -> Lookup:
    def lookup(check: str | None, metric: str, bound: str | None) -> float | None:
        entry = result.checks.get(check or "")
        if entry is None:
            return None
        if bound is not None:
            return bound_of(entry.get("intervals", {}).get(metric), bound)
        value = entry.get(metric)
        return None if value is None else float(value)

    return lookup


def check_gates(result: ProbeResult, gates: list[Gate]) -> list[dict[str, Any]]:
    """Each gate on each check it names (every check that ran, for a gate without one); checks a gate names that
    did not run, or that no request let change, fail it (not measured)."""
    lookup = probe_lookup(result)
    out = []
    for gate in gates:
        for check in [gate.kind] if gate.kind else list(result.checks):
            entry = Gate(f"{check}: {gate.expr}" if not gate.kind else gate.expr, check, gate.metric, gate.op,
                         gate.threshold, gate.bound).evaluate(lookup)
            out.append(entry)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clef-local probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    add_request_flags(parser, data="request JSONL (labels ignored; default: the built-in probe set)",
                      limit="first N requests (probe set: N requests drawn, default 64)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated checks (default all: {', '.join(CHECKS)})")
    parser.add_argument("--gate", help='e.g. "flips<=0.02@upper95,option_order.dp<=0.001"; exit 1 when one fails')
    add_interval_flags(parser)  # --seed also seeds the probe set's draw and the rewrites
    add_output_flags(parser, report="write the HTML report (with the plot)",
                     json_="write the result as JSON (re-render with clef-local report)",
                     md="write the table as Markdown", progress="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the checks; exit 0 (gates pass), 1 (a gate fails) or 2 (bad input)."""
    parser = build_parser()
    args = command.parse(parser, argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    if unknown := [c for c in checks if c not in CHECKS]:
        parser.error(f"--checks: unknown {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    if (checked := command.settings_and_gates(args, probe_gates)) is None:
        return 2
    settings, gates = checked
    from tqdm.auto import tqdm

    import clef_local
    from clef_local.airgap import airgap

    try:
        with airgap(not args.allow_network) as network:
            read = command.read_requests(args, seed=args.seed)
            requests, source = read.requests, read.source
            model = clef_local.load(model_path(args.model), **load_options(args))
            bar = tqdm(total=None, unit="req", desc="probe", disable=args.no_progress, file=sys.stderr)

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            result = run_probe(model, requests, checks=checks, seed=args.seed, batch_size=args.batch_size,
                               settings=settings, data_name=source, progress=progress)
            bar.close()
    except command.INPUT_ERRORS as exc:
        return command.input_error(exc)
    result.meta.update(network=network, dtype=args.dtype, gates=check_gates(result, gates))
    return _finish(args, result, network)


def _finish(args: argparse.Namespace, result: ProbeResult, network: str) -> int:
    from clef_local.quality.report import markdown_table, probe_table_rows

    print(f"network: {network}")
    print(markdown_table(probe_table_rows(result)))
    command.write_outputs(args, [], network, probes=[result])
    failed = [("", g) for g in result.meta["gates"] if not g["ok"]]
    return command.gate_verdict(failed, [g["expr"] for g in result.meta["gates"]])


if __name__ == "__main__":
    sys.exit(main())
