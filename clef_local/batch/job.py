"""``clef-local batch``: decide every row of a JSONL, CSV or Parquet file; resumable, exact-once, optionally on Ray.

Rows are encoded a chunk ahead on a second thread and decided in chunks of ``--chunk-rows``, each committed to
``OUT.parts/`` (:mod:`.journal`); rows the server would refuse go to ``--errors`` and the job goes on.
docs/batch.md has the command, the formats and the cluster.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.batch.io import (
    InputSpec,
    Row,
    concatenate,
    count_rows,
    file_format,
    iter_rows,
    read_schema,
    write_table,
)
from clef_local.batch.journal import JOURNAL, Journal, file_sha256, model_fingerprint, replacing
from clef_local.batch.ray_runner import RaySettings, add_ray_flags, check_reach, ray_settings
from clef_local.batch.work import ChunkResult, ChunkSettings, EncodedChunk, decide_encoded, encode_chunk
from clef_local.errors import BatchError
from clef_local.options import (
    add_confidence_flag,
    add_max_length_flag,
    add_model_flags,
    add_network_flag,
    load_options,
    model_path,
)

if TYPE_CHECKING:
    from clef_local.model import ClefModel

log = logging.getLogger(__name__)

DEFAULT_CHUNK_ROWS = 64


@dataclass(frozen=True)
class BatchJob:
    """Everything one ``clef-local batch`` run needs (the command line builds it; so can a program)."""

    model: Path
    input: InputSpec
    out: Path
    errors: Path | None = None  # None: OUT-stem.errors.jsonl beside the output
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    settings: ChunkSettings = field(default_factory=ChunkSettings)
    load_options: dict[str, Any] = field(default_factory=dict)
    force: bool = False
    ray: RaySettings | None = None
    airgapped: bool = True
    progress: bool = True
    schema_path: Path | None = None

    @property
    def errors_path(self) -> Path:
        return self.errors or self.out.with_name(f"{self.out.stem}.errors.jsonl")

    @property
    def parts(self) -> Path:
        return self.out.with_name(f"{self.out.name}.parts")


@dataclass(frozen=True)
class Summary:
    """What a finished job did: rows in the input, answered, refused; rows decided by this run and its time."""

    rows: int
    answered: int
    errors: int
    decided_now: int
    seconds: float
    out: Path
    errors_path: Path

    @property
    def rows_per_s(self) -> float:
        return self.decided_now / self.seconds if self.seconds > 0 else float("nan")

    def text(self) -> str:
        resumed = self.rows - self.decided_now
        earlier = f"; {resumed} decided by an earlier run" if resumed else ""
        return (f"{self.rows} rows: {self.answered} answered → {self.out}, {self.errors} errors → {self.errors_path}; "
                f"{self.decided_now} decided in {self.seconds:.1f} s ({self.rows_per_s:.2f} rows/s){earlier}")


def chunked(rows: Iterable[Row], size: int) -> Iterator[tuple[int, list[Row]]]:
    """``(chunk number, its rows)``: chunk k holds rows k·size … k·size+size−1 of the input."""
    iterator = iter(rows)
    number = 0
    while part := list(islice(iterator, size)):
        yield number, part
        number += 1


def _identity(job: BatchJob, questions: dict[str, Any] | None) -> dict[str, Any]:
    """The journal's description of the job: what must match for a rerun to continue it."""
    digest = file_sha256(job.input.path)
    fingerprint = model_fingerprint(job.model)
    schema = None
    if questions is not None:
        text = json.dumps(questions, sort_keys=True, ensure_ascii=False).encode()
        schema_digest = hashlib.sha256(text).hexdigest()
        schema = {"value": schema_digest, "shown": f"{job.schema_path} (sha256 {schema_digest[:12]})"}
    s = job.settings
    return {
        "input": {"value": digest, "shown": f"{job.input.path} (sha256 {digest[:12]})"},
        "model": {"value": fingerprint, "shown": f"{job.model} (fingerprint {fingerprint[:12]})"},
        "schema": schema,
        "state_column": job.input.state_column if job.input.format != "jsonl" else None,
        "id_column": job.input.id_column,
        "chunk_rows": job.chunk_rows,
        "batch_size": s.batch_size,
        "confidence": s.confidence or "jev",  # None: the model's, and the job loads it with the default
        "truncate_state": s.truncate_state,
        "digits": s.digits,
        # as the flags say them (None and "auto" are the same request)
        **{key: job.load_options.get(key) or "auto" for key in ("backend", "device", "dtype")},
        # which rows fit is part of the answers: None is the model's default context
        "max_length": job.load_options.get("max_length"),
    }


def _local_results(model: ClefModel, chunks: Iterator[tuple[int, list[Row]]], settings: ChunkSettings,
                   progress: Callable[[int], None]) -> Iterator[ChunkResult]:
    """Decide chunks in order; the next chunk is validated and tokenized on a thread while this one runs."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-batch-encode") as pool:
        ahead: Future[EncodedChunk] | None = None
        for chunk, rows in chunks:
            future = pool.submit(encode_chunk, model, chunk, rows, settings)
            if ahead is not None:
                yield decide_encoded(model, ahead.result(), settings, progress)
            ahead = future
        if ahead is not None:
            yield decide_encoded(model, ahead.result(), settings, progress)


def _check_output(job: BatchJob, out_format: str, questions: dict[str, Any] | None) -> None:
    if job.input.format != "jsonl" and questions is None:
        raise BatchError(f"--in {job.input.path}: a {job.input.format.upper()} input needs --schema FILE (the "
                         "questions every row is asked)")
    if out_format != "jsonl" and questions is None:
        raise BatchError(f"--out {job.out}: a {out_format.upper()} output has one column per question, so it needs "
                         "--schema FILE; write JSONL for requests that bring their own questions")
    if not job.out.parent.is_dir():
        raise BatchError(f"--out {job.out}: the folder {job.out.parent} does not exist")
    if job.errors_path.resolve() in (job.out.resolve(), job.input.path.resolve()):
        raise BatchError(f"--errors {job.errors_path} is the input or the output; name another file")
    if job.out.resolve() == job.input.path.resolve():
        raise BatchError(f"--out {job.out} is the input file; name another file")
    if job.chunk_rows < 1 or job.settings.batch_size < 1:
        raise BatchError(f"--chunk-rows and --batch-size must be ≥ 1, got {job.chunk_rows} and "
                         f"{job.settings.batch_size}")
    resumable = (job.parts / JOURNAL).is_file()
    if job.out.exists() and not resumable and not job.force:
        raise BatchError(f"--out {job.out} exists; pass --force to overwrite it")


def _assemble(job: BatchJob, journal: Journal, chunks: int, out_format: str,
              questions: dict[str, Any] | None) -> None:
    missing = [k for k in range(chunks) if k not in journal.committed]
    if missing:
        raise BatchError(f"{job.parts}: chunks {missing[:5]} were not decided; rerun the same command to finish")
    outs = [Journal.paths(job.parts, k)[0] for k in range(chunks)]
    errs = [Journal.paths(job.parts, k)[1] for k in range(chunks)]
    with replacing(job.out) as tmp:
        if out_format == "jsonl":
            concatenate(outs, tmp)
        else:
            write_table(outs, tmp, out_format, questions or {})
    with replacing(job.errors_path) as tmp:
        concatenate(errs, tmp)


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="row", desc="batch", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def run_batch(job: BatchJob, *, model: ClefModel | None = None) -> Summary:
    """Run (or resume) ``job``; returns its :class:`Summary`. Bad rows go to the errors file, not up as errors.

    ``model``: a loaded model of ``job.model`` to use instead of loading it again (not with ``job.ray``, whose
    replicas load their own).
    """
    from clef_local.airgap import airgap

    started = time.perf_counter()
    if model is not None and job.ray is not None:
        raise BatchError("a job on Ray loads the model in its replicas; pass model=None")
    if not job.input.path.is_file():
        raise BatchError(f"--in {job.input.path}: no such file")
    out_format = file_format(job.out, "--out")
    questions = job.input.questions
    _check_output(job, out_format, questions)
    if job.ray is not None:
        check_reach(job.ray, job.airgapped)
    total = count_rows(job.input)  # reads the whole input once: a missing column fails here, before any journal
    journal = Journal.open(job.parts, _identity(job, questions), force=job.force)
    chunks = (total + job.chunk_rows - 1) // job.chunk_rows
    done_rows = sum(c.rows for c in journal.committed.values())
    pending = (item for item in chunked(iter_rows(job.input), job.chunk_rows) if item[0] not in journal.committed)
    if journal.committed:
        log.info("resuming %s: %d of %d chunks committed (%d rows)", job.parts, len(journal.committed), chunks,
                 done_rows)
    bar = _progress_bar(total, done_rows, job.progress)
    decided = 0
    try:
        with airgap(job.airgapped):
            for result in _results(job, pending, bar.update, model) if len(journal.committed) < chunks else ():
                journal.commit(result.chunk, result.out, result.err, rows=result.rows, errors=result.errors)
                decided += result.rows
    finally:
        bar.close()
    _assemble(job, journal, chunks, out_format, questions)
    answered = sum(c.rows - c.errors for c in journal.committed.values())
    errors = sum(c.errors for c in journal.committed.values())
    journal.remove()
    return Summary(total, answered, errors, decided, time.perf_counter() - started, job.out, job.errors_path)


def _results(job: BatchJob, pending: Iterator[tuple[int, list[Row]]], progress: Callable[[int], Any],
             model: ClefModel | None) -> Iterator[ChunkResult]:
    if job.ray is None:
        import clef_local

        model = model or clef_local.load(job.model, **job.load_options)
        yield from _local_results(model, pending, job.settings, progress)
        return
    from clef_local.batch.ray_runner import cluster_plan, ray_decide_chunks, ray_session

    work = list(pending)  # Ray Data takes the chunks as one list of items
    if not work:
        return
    with ray_session(job.ray, airgapped=job.airgapped) as ray:
        plan = cluster_plan(ray, job.ray)
        for result in ray_decide_chunks(work, job.settings, ray=ray, plan=plan, model_path=job.model,
                                        load_options=job.load_options, airgapped=job.airgapped,
                                        timeout_s=job.ray.timeout_s):
            progress(result.rows)
            yield result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clef-local batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--in", dest="input", type=Path, required=True,
                        help="the requests: .jsonl (one request body per line), .csv or .parquet (one state per row)")
    parser.add_argument("--out", type=Path, required=True,
                        help="the answers: .jsonl (one response per row), .csv or .parquet (one column per question)")
    parser.add_argument("--errors", type=Path, help="rows that got no answer, as JSONL (default OUT-stem.errors.jsonl)")
    parser.add_argument("--schema", type=Path,
                        help="the questions every row is asked (JSON: the questions object); needed for CSV/Parquet")
    parser.add_argument("--state-column", default="state", help="CSV/Parquet: the state's column (default state)")
    parser.add_argument("--id-column", help="CSV/Parquet: the id column (default: id when present, else row numbers)")
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                        help=f"rows per committed chunk (default {DEFAULT_CHUNK_ROWS})")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    add_confidence_flag(parser)
    add_max_length_flag(parser)
    parser.add_argument("--truncate-state", action="store_true",
                        help="drop the end of a state that does not fit instead of refusing the row")
    parser.add_argument("--full-precision", action="store_true", help="do not round floats to 4 decimals")
    parser.add_argument("--force", action="store_true", help="start over: discard a journal, overwrite the output")
    add_network_flag(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_ray_flags(parser)
    return parser


def job_from_args(args: argparse.Namespace) -> BatchJob:
    """The :class:`BatchJob` of parsed ``clef-local batch`` arguments."""
    in_format = file_format(args.input, "--in")
    if in_format == "jsonl" and args.id_column:
        raise BatchError("--id-column is for CSV/Parquet input; a JSONL line's id is its \"id\" field")
    questions = read_schema(args.schema) if args.schema else None
    spec = InputSpec(args.input, in_format, questions, args.state_column, args.id_column)
    settings = ChunkSettings(batch_size=args.batch_size, confidence=args.confidence,
                             truncate_state=args.truncate_state, digits=None if args.full_precision else 4)
    return BatchJob(model=model_path(args.model), input=spec, out=args.out, errors=args.errors,
                    chunk_rows=args.chunk_rows, settings=settings, load_options=load_options(args), force=args.force,
                    ray=ray_settings(args), airgapped=not args.allow_network, progress=not args.no_progress,
                    schema_path=args.schema)


def main(argv: list[str] | None = None) -> int:
    """``clef-local batch``: answer every row of a file; prints a one-line summary."""
    args = build_parser().parse_args(argv)
    summary = run_batch(job_from_args(args))
    print(summary.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
