"""``--gate`` expressions, shared by ``drift`` and ``probe``: ``[scope.]metric OP number[@upperNN|@lowerNN]``.

The plain form compares the point value; ``@upper95`` compares the upper end of the 95% interval (``@lower95`` the
lower end), so ``flips<=0.02@upper95`` passes only when the data rule out a flip rate above 2% at 95% confidence.
NN must be the level the run computed its intervals at (``--confidence``, default 0.95). Syntax and metrics:
docs/quality.md#gates.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

_GATE = re.compile(r"^\s*(?:([a-z_0-9]+)\.)?([a-z_0-9]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)"
                   r"\s*(?:@\s*(upper|lower)\s*([0-9]+(?:\.[0-9]+)?))?\s*$")
OPS: dict[str, Callable[[float, float], bool]] = {"<=": float.__le__, "<": float.__lt__, ">=": float.__ge__,
                                                  ">": float.__gt__}
# lookup(scope, metric, bound) -> the value to compare (bound None: the point value), None when not measured
Lookup = Callable[[str | None, str, str | None], float | None]


class GateSyntaxError(ValueError):
    """A ``--gate`` expression that does not parse or names an unknown metric, scope or bound."""


@dataclass(frozen=True)
class Gate:
    """``[scope.]metric OP threshold[@boundNN]``; ``bound`` is None (the point value), ``"upper"`` or ``"lower"``."""

    expr: str
    kind: str | None  # the scope: a question type for drift, a check for probe
    metric: str
    op: str
    threshold: float
    bound: str | None = None

    def evaluate(self, lookup: Lookup) -> dict[str, Any]:
        """``{"expr", "value", "ok"}``: a metric that was not measured (None or NaN) fails the gate."""
        value = lookup(self.kind, self.metric, self.bound)
        ok = value is not None and math.isfinite(float(value)) and OPS[self.op](float(value), self.threshold)
        return {"expr": self.expr, "value": value, "ok": bool(ok)}


def parse_gates(text: str | None, *, metrics: Collection[str], scopes: Collection[str],
                aliases: Mapping[str, str] | None = None, bounded: Collection[str] = (),
                level: str = "95", example: str = "flips<=0.01") -> list[Gate]:
    """Comma-separated gates → :class:`Gate` list. ``metrics``: the names a gate may compare (after ``aliases``);
    ``bounded``: those that have an interval (the only ones ``@upper``/``@lower`` may name); ``level``: the
    intervals' level as a percentage string (``"95"``). :class:`GateSyntaxError` names the bad part and the fix."""
    if not text:
        return []
    aliases = aliases or {}
    gates = []
    for part in text.split(","):
        expr = part.strip()
        match = _GATE.match(part)
        if not match:
            raise GateSyntaxError(f"gate {expr!r} is not '[scope.]metric OP number[@upper{level}]' (e.g. "
                                  f"{example})")
        scope, name, op, number, bound, percent = match.groups()
        if scope is not None and scope not in scopes:
            raise GateSyntaxError(f"gate {expr!r}: unknown scope {scope!r}; known: {', '.join(sorted(scopes))}")
        metric = aliases.get(name, name)
        if metric not in metrics:
            shown = sorted({*aliases, *metrics})
            raise GateSyntaxError(f"gate {expr!r}: unknown metric {name!r}; known: {', '.join(shown)}")
        try:
            threshold = float(number)
        except ValueError:
            raise GateSyntaxError(f"gate {expr!r}: {number!r} is not a number") from None
        if bound is not None:
            if metric not in bounded:
                with_bounds = sorted(n for n in {*aliases, *bounded} if aliases.get(n, n) in bounded)
                raise GateSyntaxError(f"gate {expr!r}: {name} has no interval; @{bound}{percent} takes one of "
                                      f"{', '.join(with_bounds)}")
            if f"{float(percent):g}" != level:
                raise GateSyntaxError(f"gate {expr!r}: the intervals of this run are {level}%; write @{bound}{level} "
                                      f"or pass --confidence {float(percent) / 100:g}")
        gates.append(Gate(expr, scope, metric, op, threshold, bound))
    return gates


def bound_of(interval: Any, bound: str | None) -> float | None:
    """The end of a ``[low, high]`` interval that ``bound`` names (None when the interval is missing)."""
    if not isinstance(interval, list | tuple) or len(interval) != 2:
        return None
    value = interval[1] if bound == "upper" else interval[0]
    return None if value is None else float(value)
