"""``clef-local batch`` on one machine: JSONL, CSV and Parquet in and out, refused rows, and resuming after SIGKILL
at several points of the commit protocol (the output must be the bytes of an uninterrupted run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from batch_inputs import SCHEMA, read_jsonl, states, write_jsonl, write_table

from clef_local.batch.io import InputSpec
from clef_local.batch.job import BatchJob, run_batch
from clef_local.batch.journal import JOURNAL
from clef_local.batch.replicas import RESERVED_CPUS, plan_replicas
from clef_local.cli import main
from clef_local.errors import BatchError
from clef_local.runtime.answers import round_floats

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pacsv = pytest.importorskip("pyarrow.csv")

FLOAT32 = {"dtype": "float32"}
# one torch thread in every process of these tests: two threads on a shared 2-core machine made a tiny decide 25×
# slower here, and the same thread count everywhere keeps the bytes of every run comparable
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _job(tiny_qwen: Path, source: Path, out: Path, **kw: Any) -> BatchJob:
    fmt = {".jsonl": "jsonl", ".csv": "csv", ".parquet": "parquet"}[source.suffix]
    spec_kw = {k: kw.pop(k) for k in ("questions", "state_column", "id_column") if k in kw}
    return BatchJob(model=tiny_qwen, input=InputSpec(source, fmt, **spec_kw), out=out, load_options=FLOAT32,
                    progress=False, **kw)


def test_jsonl_rows_are_answered_in_order_and_bad_rows_go_to_the_errors_file(tiny_qwen: Path, qwen_model,
                                                                             tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    ids = write_jsonl(source, 10)
    out = tmp_path / "out.jsonl"
    summary = run_batch(_job(tiny_qwen, source, out, chunk_rows=4), model=qwen_model)
    answers = read_jsonl(out)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    # every row exactly once: answered + refused = the input, in input order
    assert [a["id"] for a in answers] == [i for i in ids if i not in (7, "bad-type", "one-option")]
    assert [e["id"] for e in errors] == [7, "bad-type", "one-option"]
    assert (summary.rows, summary.answered, summary.errors, summary.decided_now) == (13, 10, 3, 13)
    assert [e["status"] for e in errors] == [422, 422, 422]
    assert errors[0]["row"] == 7 and "not valid JSON" in errors[0]["message"]
    assert errors[1]["detail"][0]["loc"] == ["body", "questions", "q", "type"]
    assert errors[2]["row"] == 10 and "criteria" in errors[2]["message"]  # the blank line 9 still counts
    # the same numbers as the public API, rounded as on the wire
    requests = [{"model": "clef-flash", "state": s, "questions": SCHEMA} for s in states(10)]
    expected = [round_floats(r, 4) for r in qwen_model.decide_batch(requests)]
    for got, want in zip(answers, expected, strict=True):
        assert got["model"] == "clef-flash" and got["usage"] == want["usage"]
        for qid in SCHEMA:
            assert got["answers"][qid]["type"] == want["answers"][qid]["type"]
            for option, p in want["answers"][qid].get("probabilities", {}).items():
                assert got["answers"][qid]["probabilities"][option] == pytest.approx(p, abs=2e-4)
    assert not (tmp_path / "out.jsonl.parts").exists()  # a finished job leaves no journal


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_table_with_a_schema_gives_the_jsonl_answers_as_columns(tiny_qwen: Path, qwen_model, tmp_path: Path,
                                                                  suffix: str) -> None:
    table = tmp_path / f"tickets{suffix}"
    ids = write_table(table, 9)
    as_jsonl = run_batch(_job(tiny_qwen, table, tmp_path / "a.jsonl", questions=SCHEMA, state_column="text",
                              id_column="ticket", chunk_rows=4), model=qwen_model)
    assert as_jsonl.answered == 9
    lines = read_jsonl(tmp_path / "a.jsonl")
    assert [line["id"] for line in lines] == ids
    for out_suffix in (".csv", ".parquet"):
        out = tmp_path / f"labels{out_suffix}"
        run_batch(_job(tiny_qwen, table, out, questions=SCHEMA, state_column="text", id_column="ticket",
                       chunk_rows=4), model=qwen_model)
        if out_suffix == ".parquet":
            got = pq.read_table(out)
            assert got.schema.field("team.probabilities").type == pa.struct(
                [pa.field(o, pa.float64()) for o in ("cards", "transfers", "other")])
            rows = got.to_pylist()
        else:
            rows = pacsv.read_csv(out, convert_options=pacsv.ConvertOptions(
                column_types={"id": pa.string(), "team.probabilities": pa.string()})).to_pylist()
            for row in rows:
                row["team.probabilities"] = json.loads(row["team.probabilities"])
        assert [r["id"] for r in rows] == ids
        assert list(rows[0]) == ["id", "urgent", "team", "team.confidence", "team.probabilities", "severity",
                                 "severity.confidence", "severity.probabilities"]
        for row, line in zip(rows, lines, strict=True):
            answers = line["answers"]
            assert row["urgent"] == answers["urgent"]["noul"]
            assert row["team"] == answers["team"]["choice"]
            assert row["team.confidence"] == answers["team"]["confidence"]
            assert row["team.probabilities"] == answers["team"]["probabilities"]
            assert row["severity"] == answers["severity"]["score"]


def test_parquet_without_an_id_column_numbers_its_rows_and_matches_jsonl(tiny_qwen: Path, qwen_model,
                                                                         tmp_path: Path) -> None:
    table = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"state": s} for s in states(5)]), table)
    source = tmp_path / "t.jsonl"
    source.write_text("".join(json.dumps({"model": "clef-local", "state": s, "questions": SCHEMA}) + "\n"
                              for s in states(5)))
    run_batch(_job(tiny_qwen, table, tmp_path / "p.jsonl", questions=SCHEMA), model=qwen_model)
    run_batch(_job(tiny_qwen, source, tmp_path / "j.jsonl"), model=qwen_model)
    assert (tmp_path / "p.jsonl").read_bytes() == (tmp_path / "j.jsonl").read_bytes()
    assert [line["id"] for line in read_jsonl(tmp_path / "p.jsonl")] == [1, 2, 3, 4, 5]


def test_command_line_refusals_name_the_problem(tiny_qwen: Path, tmp_path: Path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    write_jsonl(source, 2, bad=False)
    table = tmp_path / "t.csv"
    write_table(table, 2)
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    not_a_schema = tmp_path / "list.json"
    not_a_schema.write_text("[1, 2]")
    cases = [
        (["--in", str(source), "--out", str(out)], "exists; pass --force"),
        (["--in", str(source), "--out", str(tmp_path / "o.parquet")], "needs --schema"),
        (["--in", str(table), "--out", str(tmp_path / "o.jsonl")], "needs --schema FILE"),
        (["--in", str(source), "--out", str(tmp_path / "o.txt")], "unknown extension '.txt'"),
        (["--in", str(table), "--out", str(tmp_path / "o.jsonl"), "--schema", str(not_a_schema)],
         "expected the questions object"),
        (["--in", str(source), "--out", str(tmp_path / "o.jsonl"), "--replicas", "2"], "need --ray"),
    ]
    for args, message in cases:
        assert main(["batch", "--model", str(tiny_qwen), "--no-progress", *args]) == 2
        assert message in capsys.readouterr().err
    assert out.read_text() == "precious\n"
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"questions": SCHEMA}))
    assert main(["batch", "--model", str(tiny_qwen), "--in", str(table), "--out", str(tmp_path / "o.jsonl"),
                 "--schema", str(schema), "--state-column", "body"]) == 2
    assert "no column 'body' for the state; its columns are ticket, text, other" in capsys.readouterr().err


def test_without_ray_the_flag_names_the_extra(tiny_qwen: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    source = tmp_path / "in.jsonl"
    write_jsonl(source, 2, bad=False)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as on a machine without it
    assert main(["batch", "--model", str(tiny_qwen), "--in", str(source), "--out", str(tmp_path / "o.jsonl"),
                 "--ray", "local", "--no-progress"]) == 2
    assert "pip install 'clef-local[ray]'" in capsys.readouterr().err


# ---------------------------------------------------------------- resuming

# Runs `clef-local batch` with one public step of the commit protocol replaced by a SIGKILL of the process itself.
KILLER = r"""
import contextlib, os, signal, sys
import clef_local.batch.job as job
import clef_local.batch.journal as journal
point, n = sys.argv[1], int(sys.argv[2])
calls = []

def die_on(count):
    calls.append(1)
    if len(calls) == count:
        os.kill(os.getpid(), signal.SIGKILL)

if point == "commit":  # before the n-th chunk's commit: between two chunks
    commit = journal.Journal.commit
    def killing_commit(self, *a, **k):
        die_on(n)
        return commit(self, *a, **k)
    journal.Journal.commit = killing_commit
elif point == "file":  # after the n-th chunk file is renamed into place (odd: answers, even: errors; no journal line)
    replacing = journal.replacing
    @contextlib.contextmanager
    def killing_replacing(path):
        with replacing(path) as tmp:
            yield tmp
        if path.name != journal.JOURNAL:
            die_on(n)
    journal.replacing = killing_replacing
elif point == "assemble":  # while the final files are written: the output is in place, the errors file is not
    concatenate = job.concatenate
    def killing_concatenate(parts, out):
        die_on(n)
        return concatenate(parts, out)
    job.concatenate = killing_concatenate
from clef_local.cli import main
sys.exit(main(["batch", *sys.argv[3:]]))
"""


def _killed_run(point: str, n: int, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLER, point, str(n), *args], capture_output=True, text=True,
                          env=ONE_THREAD, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(tiny_qwen: Path, qwen_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, bytes]:
    """The input of the resume tests and the bytes an uninterrupted run writes (answers, errors)."""
    folder = tmp_path_factory.mktemp("resume")
    source = folder / "in.jsonl"
    write_jsonl(source, 10)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_batch(_job(tiny_qwen, source, folder / "ref.jsonl", chunk_rows=3), model=qwen_model)
    finally:
        torch.set_num_threads(before)
    return source, (folder / "ref.jsonl").read_bytes(), (folder / "ref.errors.jsonl").read_bytes()


@pytest.mark.parametrize(("point", "n", "committed"), [
    ("commit", 1, 0),  # killed before the first commit: the journal holds the job only
    ("commit", 3, 2),  # between chunks
    ("file", 3, 1),  # chunk 1's answers renamed into place, its errors not yet, no journal line: decided again
    ("file", 4, 1),  # both of chunk 1's files in place, its journal line not written: decided again
    ("assemble", 2, 5),  # every chunk committed, the output written, killed before the errors file
])
def test_resume_after_sigkill_writes_the_same_bytes(tiny_qwen: Path, qwen_model, tmp_path: Path,
                                                    uninterrupted: tuple[Path, bytes, bytes], point: str, n: int,
                                                    committed: int) -> None:
    source, ref_out, ref_err = uninterrupted
    out = tmp_path / "out.jsonl"
    args = ["--model", str(tiny_qwen), "--dtype", "float32", "--in", str(source), "--out", str(out),
            "--chunk-rows", "3", "--no-progress"]
    killed = _killed_run(point, n, args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    journal = (tmp_path / "out.jsonl.parts" / JOURNAL).read_text().splitlines()
    assert len(journal) - 1 == committed
    if point == "assemble":
        assert out.read_bytes() == ref_out and not (tmp_path / "out.errors.jsonl").exists()
    # the same command again finishes the job: the journal's chunks are kept, the rest decided
    summary = run_batch(_job(tiny_qwen, source, out, chunk_rows=3), model=qwen_model)
    assert summary.rows - summary.decided_now == sum(json.loads(line)["rows"] for line in journal[1:])
    assert out.read_bytes() == ref_out
    assert (tmp_path / "out.errors.jsonl").read_bytes() == ref_err


def test_a_torn_journal_line_and_a_different_job(tiny_qwen: Path, tiny_llama: Path, qwen_model, tmp_path: Path,
                                                 uninterrupted: tuple[Path, bytes, bytes]) -> None:
    source, ref_out, _ = uninterrupted
    out = tmp_path / "out.jsonl"
    job = _job(tiny_qwen, source, out, chunk_rows=3)
    from clef_local.batch import journal as journal_module

    commit = journal_module.Journal.commit

    def interrupted(self: Any, chunk: int, *args: Any, **kwargs: Any) -> None:
        if chunk == 2:
            raise KeyboardInterrupt
        commit(self, chunk, *args, **kwargs)

    journal_module.Journal.commit = interrupted  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            run_batch(job, model=qwen_model)
    finally:
        journal_module.Journal.commit = commit  # type: ignore[method-assign]
    path = tmp_path / "out.jsonl.parts" / JOURNAL
    with path.open("a") as f:
        f.write('{"chunk": 2, "rows": 3, "err')  # a commit line cut short by the kill
    # another model, another schema handling, another chunk size: refused, every difference named
    other = _job(tiny_llama, source, out, chunk_rows=4)
    with pytest.raises(BatchError) as refused:
        run_batch(other)
    message = str(refused.value)
    assert "model: " in message and str(tiny_qwen) in message and str(tiny_llama) in message
    assert "chunk_rows: 3 in the journal, 4 now" in message and "--force" in message
    summary = run_batch(job, model=qwen_model)
    assert summary.decided_now == summary.rows - 6  # chunks 0 and 1 were kept
    assert out.read_bytes() == ref_out


def test_force_starts_over(tiny_qwen: Path, qwen_model, tmp_path: Path,
                           uninterrupted: tuple[Path, bytes, bytes]) -> None:
    source, ref_out, _ = uninterrupted
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    summary = run_batch(_job(tiny_qwen, source, out, chunk_rows=3, force=True), model=qwen_model)
    assert summary.decided_now == summary.rows == 13
    assert out.read_bytes() == ref_out


# ---------------------------------------------------------------- replica sizing (no cluster needed)


def test_replicas_are_sized_from_the_cluster_and_leave_room_for_ray_data() -> None:
    two_cpus = [{"CPU": 2.0}]
    plan = plan_replicas(two_cpus, replicas=2)
    assert (plan.replicas, plan.cpus, plan.threads) == (2, 0.75, 1)
    assert 2 * plan.cpus <= 2 - RESERVED_CPUS  # the trap: 2 × 1 CPU on 2 CPUs starves Ray Data's read tasks
    assert plan_replicas(two_cpus).replicas == 1 and plan_replicas(two_cpus).threads == 1  # 1.5 CPUs: one thread
    nodes = [{"CPU": 16.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}]
    gpu = plan_replicas(nodes, gpus_per_replica=1)
    assert (gpu.replicas, gpu.gpus, gpu.cpus) == (3, 1.0, 1.0)
    cpu = plan_replicas(nodes, replicas=4)  # three on the 16-CPU node, one on the 8-CPU node
    assert cpu.cpus == pytest.approx(15.5 / 3, abs=1e-4) and cpu.threads == 5
    with pytest.raises(BatchError, match=r"2 replica\(s\) × 1 CPU do not fit: the cluster has 1 node\(s\), 2 CPU"):
        plan_replicas(two_cpus, replicas=2, cpus_per_replica=1)
    with pytest.raises(BatchError, match=r"need 2 GPU\(s\) but the cluster has 1 node\(s\), 2 CPU\(s\), 0 GPU"):
        plan_replicas(two_cpus, replicas=2, gpus_per_replica=1)
    with pytest.raises(BatchError, match=r"would get 0\.075 CPU each"):
        plan_replicas(two_cpus, replicas=20)
