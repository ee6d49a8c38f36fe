"""What an export keeps when validation refuses it, and the disk check before it starts (docs/quantization.md).

A refused variant (:class:`~clef_local.export.validate.ValidationRefused`: failed, or undecided) is never renamed to
``--out``, but what was measured is kept: ``validation.json`` as ``OUT.validation.json`` beside ``--out`` (a file, so
no loader can take it for a variant, and never inside ``--out``, which stays as it was), the HTML report at
``--report`` when one was asked for, and with ``--quarantine DIR`` the whole variant in ``DIR``, marked (a
:data:`~clef_local.formats.variant.QUARANTINED` file and ``quantization_config.clef_local.quarantined``) so that
every loader refuses to run it (:func:`clef_local.formats.variant.check_not_quarantined`). The error's one line names
each path kept.

:func:`check_disk` compares the variant's estimated bytes (the planner's census: the registry's stored-bytes formula
per scheme) and the other files with the free space beside ``--out`` before any tensor is read.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.errors import ClefError, one_line
from clef_local.export.staging import ExportError, check_paths, resolve_out, staged
from clef_local.export.validate import VALIDATION, ValidationRefused
from clef_local.formats.manifest import MANIFEST, list_files
from clef_local.formats.variant import QUARANTINED
from clef_local.units import format_size

if TYPE_CHECKING:
    from clef_local.formats.release import Release

log = logging.getLogger(__name__)

REFUSED_SUFFIX = ".validation.json"
# beyond the census: safetensors headers, the index, config.json, validation.json and the HTML report (a few hundred
# KB for a 9B model), and 1% for whatever the formulas round
SLACK_BYTES = 1 << 20
SLACK_RATIO = 0.01


def refused_report(out: Path) -> Path:
    """Where a refused export to ``out`` keeps its ``validation.json``: ``OUT.validation.json``, beside ``out``."""
    return out.with_name(out.name + REFUSED_SUFFIX)


def _is_within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


@dataclass(frozen=True)
class Keep:
    """What an export keeps of its validation, and where: ``report`` (``--report FILE.html``: written whether the
    variant passed or not), ``quarantine`` (``--quarantine DIR``: a refused variant kept whole in ``DIR``).
    ``force`` replaces an existing ``DIR``, as it does ``out``."""

    source: Path
    out: Path
    report: Path | None = None
    quarantine: Path | None = None
    force: bool = False

    @classmethod
    def of(cls, source: Path, out: Path, *, report: str | Path | None = None, quarantine: str | Path | None = None,
           force: bool = False) -> Keep:
        """The paths resolved (as ``out`` is) and checked (:meth:`check`) before any work."""
        keep = cls(source, out, Path(report).expanduser().absolute() if report is not None else None,
                   resolve_out(quarantine) if quarantine is not None else None, force)
        keep.check()
        return keep

    def check(self) -> None:
        """Refuse a ``--quarantine`` that is (inside) ``--out`` or the source, or lies where ``--out`` could not
        (:func:`~clef_local.export.staging.check_paths`), and a ``--report`` inside either or in a missing directory."""
        if self.quarantine is not None:
            if _is_within(self.quarantine, self.out) or _is_within(self.out, self.quarantine):
                raise ExportError(f"--quarantine {self.quarantine} and --out {self.out} overlap; a refused variant "
                                  f"must never be where a validated one goes: choose another --quarantine")
            check_paths(self.source, self.quarantine, self.force)
        if self.report is not None:
            for flag, where in (("--out", self.out), ("--quarantine", self.quarantine), ("the source", self.source)):
                if where is not None and _is_within(self.report, where):
                    raise ExportError(f"--report {self.report} is inside {flag} {where}; write it elsewhere")
            if not self.report.parent.is_dir():
                raise ExportError(f"--report {self.report}: the directory {self.report.parent} does not exist; "
                                  f"create it first or choose another path")

    def passed(self, validation: dict[str, Any]) -> None:
        """After the variant was renamed to ``out``: write the HTML report, and remove the ``OUT.validation.json``
        an earlier refused export to ``out`` left (it described a variant that is not there)."""
        if self.report is not None and "skipped" not in validation:
            write_html(self.report, validation, None)
            log.info("validation report: %s", self.report)
        stale = refused_report(self.out)
        if stale.is_file():
            stale.unlink()
            log.info("removed %s: it was the report of an earlier refused export to %s", stale, self.out)

    def refused(self, exc: ValidationRefused, tmp: Path) -> ValidationRefused:
        """Keep what ``exc``'s validation measured (module docstring) from the staging directory ``tmp`` before it
        is removed; the same exception, its message naming ``out`` untouched and each path kept (or why not)."""
        result = exc.result
        if result is None and (tmp / VALIDATION).is_file():
            result = json.loads((tmp / VALIDATION).read_text(encoding="utf-8"))
        kept = [f"nothing was written to {self.out}"]
        if result is None:
            kept.append("no report: nothing was measured")
        else:
            path = refused_report(self.out)
            try:
                path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
                kept.append(f"report: {path}")
            except OSError as err:
                kept.append(f"the report could not be written to {path} ({err.strerror or err})")
            if self.report is not None:
                try:
                    write_html(self.report, result, one_line(exc))
                    kept.append(f"HTML report: {self.report}")
                except OSError as err:
                    kept.append(f"the HTML report could not be written to {self.report} ({err.strerror or err})")
        if self.quarantine is not None:
            kept.append(self._quarantine(self.quarantine, exc, tmp, result))
        return type(exc)(f"{exc}; {'; '.join(kept)}", result)

    def _quarantine(self, quarantine: Path, exc: ValidationRefused, tmp: Path, result: dict[str, Any] | None) -> str:
        """Mark the variant in ``tmp`` quarantined and move it to ``quarantine`` (atomically: staged beside it,
        renamed when whole). The clause for the error line: where it is, or why it could not be kept."""
        reason = one_line(exc)
        try:
            mark_quarantined(tmp, reason, result)
            with staged(self.source, quarantine, self.force) as target:
                for entry in sorted(tmp.iterdir()):  # renames on one filesystem; copies (then deletes) across
                    shutil.move(str(entry), str(target / entry.name))
        except (OSError, ClefError) as err:
            kept = "its report is kept (above)" if result is not None else "nothing was kept"
            return f"--quarantine {quarantine}: the variant could not be kept there ({one_line(err)}); {kept}"
        log.warning("kept the refused variant in %s (quarantined: clef-local refuses to run it)", quarantine)
        return f"the variant is kept, quarantined (clef-local will not run it), in {quarantine}"


def write_html(path: Path, result: dict[str, Any], verdict: str | None) -> None:
    """The validation ``result`` as the HTML page of :func:`clef_local.quality.report.render_validation_html`."""
    from clef_local.quality.report import render_validation_html

    path.write_text(render_validation_html(result, verdict=verdict), encoding="utf-8")


def mark_quarantined(variant: Path, reason: str, result: dict[str, Any] | None) -> None:
    """Mark the variant directory ``variant`` as refused by validation: ``validated: false`` and ``quarantined:
    REASON`` in ``quantization_config.clef_local``, a :data:`QUARANTINED` file saying why, and ``validation.json``
    (``result``, or a record of the refusal when nothing was measured). No manifest: it was never complete."""
    from clef_local.formats.release import CONFIG, read_json, write_json

    config = read_json(variant / CONFIG)
    quant = config.setdefault("quantization_config", {})
    member = quant.setdefault("clef_local", {})
    member.update({"validated": False, "quarantined": reason})
    write_json(variant / CONFIG, config)
    if not (variant / VALIDATION).is_file():
        write_json(variant / VALIDATION, result or {"validated": False, "passed": False, "refused": reason})
    (variant / QUARANTINED).write_text(
        f"{reason}\n\nclef-local quantize refused this variant: export validation did not pass (validation.json "
        f"holds what it measured). It is kept for inspection only; clef-local refuses to load, serve or decide with "
        f"it. Export again to get a validated variant.\n", encoding="utf-8")
    (variant / MANIFEST).unlink(missing_ok=True)


def estimate_bytes(release: Release, scheme: str | None, group_size: int | None, written: set[str]) -> dict[str, int]:
    """The bytes an export of ``release`` writes: ``weights`` (the backbone in ``scheme`` by the planner's census,
    read from the safetensors headers; None: as released, the bound of a mixed variant), ``other`` (every other
    file, copied; ``written``: the source's files the export rewrites instead), ``slack``; and ``total``."""
    from clef_local.planning.census import DEFAULT_GROUP_SIZE, census_from_release

    census = census_from_release(release.path, release.weight_files, release.config, scheme,
                                 group_size=group_size or DEFAULT_GROUP_SIZE)
    weights = census.backbone
    other = sum((release.path / name).stat().st_size for name in list_files(release.path) if name not in written)
    slack = SLACK_BYTES + int(SLACK_RATIO * weights)
    return {"weights": weights, "other": other, "slack": slack, "total": weights + other + slack}


def check_disk(release: Release, out: Path, scheme: str | None, group_size: int | None, *, what: str) -> int:
    """Refuse (:class:`ExportError`, before any tensor is read) an export whose estimate (:func:`estimate_bytes`)
    exceeds the free space where it is staged, beside ``out``; returns the estimate. ``what`` names the variant."""
    from clef_local.export.shards import INDEX
    from clef_local.formats.release import CONFIG

    written = {*(f.name for f in release.weight_files), INDEX, CONFIG, MANIFEST, VALIDATION}
    need = estimate_bytes(release, scheme, group_size, written)
    free = shutil.disk_usage(out.parent).free
    log.info("disk: the %s variant needs about %s (weights %s, other files %s), %s free in %s", what,
             format_size(need["total"]), format_size(need["weights"]), format_size(need["other"]), format_size(free),
             out.parent)
    if need["total"] > free:
        raise ExportError(f"not enough disk space for {out}: the {what} variant needs about "
                          f"{format_size(need['total'])} ({format_size(need['weights'])} of weights, "
                          f"{format_size(need['other'])} of other files, {format_size(need['slack'])} of slack) and "
                          f"{out.parent} has {format_size(free)} free; free {format_size(need['total'] - free)} "
                          f"there or choose an --out on another disk (nothing was written)")
    return need["total"]
