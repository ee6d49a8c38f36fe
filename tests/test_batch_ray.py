"""``clef-local batch --ray`` (and ``eval --ray``) on a local Ray cluster the tests start: 2 CPUs, loopback only, no
dashboard. Two replicas write the bytes one process writes, and a replica killed mid-job is replaced with every row
answered exactly once. Skipped where Ray is not installed (``pip install 'clef-local[ray]'``; CI installs it)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from batch_inputs import read_jsonl, write_jsonl

from clef_local.batch.io import InputSpec
from clef_local.batch.job import BatchJob, Summary, run_batch
from clef_local.batch.journal import JOURNAL
from clef_local.batch.ray_runner import LOCAL_ENV, RaySettings
from clef_local.cli import main

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds replica processes in /proc")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A 2-CPU Ray cluster on loopback for this module (the job connects to it instead of starting its own)."""
    saved = {key: os.environ.get(key) for key in LOCAL_ENV}
    os.environ.update(LOCAL_ENV)  # every Ray process binds to 127.0.0.1 and sends no usage report
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="warning",
             configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _descendants(root: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every process below ``root``, from /proc."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent:
                found.append((pid, commands.get(pid, "")))
                frontier.append(pid)
    return found


def _replicas() -> list[int]:
    return [pid for pid, command in _descendants(os.getpid()) if "MapWorker(MapBatches(Replica))" in command]


def _job(tiny_qwen: Path, source: Path, out: Path, ray_settings: RaySettings | None) -> BatchJob:
    return BatchJob(model=tiny_qwen, input=InputSpec(source, "jsonl"), out=out, chunk_rows=2,
                    load_options={"dtype": "float32"}, progress=False, ray=ray_settings)


@pytest.mark.slow  # ~60 s on a quiet 2-core machine (two replicas load and one is restarted), 125 s on a busy one
def test_two_replicas_write_what_one_process_writes_even_when_one_is_killed(cluster: Any, tiny_qwen: Path,
                                                                            qwen_model, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    ids = write_jsonl(source, 24)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the replicas' thread count (0.75 CPU each), so the bytes are comparable
    try:
        local = run_batch(_job(tiny_qwen, source, tmp_path / "local.jsonl", None), model=qwen_model)
    finally:
        torch.set_num_threads(before)
    out = tmp_path / "ray.jsonl"
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["summary"] = run_batch(_job(tiny_qwen, source, out, RaySettings("auto", replicas=2)))
        except BaseException as exc:  # handed to the test thread, which raises it
            outcome["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    journal = tmp_path / "ray.jsonl.parts" / JOURNAL
    killed = None
    deadline = time.monotonic() + 240
    while worker.is_alive() and time.monotonic() < deadline:
        # once a chunk is committed the pool is busy: kill one replica in the middle of the job
        if journal.is_file() and len(journal.read_text().splitlines()) >= 2 and len(_replicas()) == 2:
            killed = _replicas()[0]
            os.kill(killed, signal.SIGKILL)
            break
        time.sleep(0.05)
    worker.join(timeout=240)
    assert not worker.is_alive(), "the Ray job did not finish"
    if "error" in outcome:
        raise outcome["error"]
    summary: Summary = outcome["summary"]
    assert killed is not None, "the job ended before a replica could be killed; give it more rows"
    assert killed not in _replicas()
    assert summary.rows == local.rows == 27 and summary.answered == 24 and summary.errors == 3
    answered = [line["id"] for line in read_jsonl(out)] + [e["id"] for e in read_jsonl(tmp_path / "ray.errors.jsonl")]
    assert sorted(map(str, answered)) == sorted(map(str, ids)) and len(answered) == len(set(map(str, answered)))
    assert out.read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    assert (tmp_path / "ray.errors.jsonl").read_bytes() == (tmp_path / "local.errors.jsonl").read_bytes()


@pytest.mark.slow  # ~30–55 s: a local eval and a Ray eval whose two replicas each load the model
def test_eval_with_ray_gives_the_metrics_of_one_process(cluster: Any, tiny_qwen: Path, tmp_path: Path) -> None:
    data = tmp_path / "b77.jsonl"
    assert main(["data", "convert", "--dataset", "banking77", "--k", "4", "--limit", "10", "--out", str(data)]) == 0
    metrics = {}
    for name, extra in (("local", []), ("ray", ["--ray", "auto", "--replicas", "2"])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--model", str(tiny_qwen), "--dtype", "float32", "--data", str(data), "--json",
                     str(out), "--no-progress", *extra]) == 0
        metrics[name] = json.loads(out.read_text())["metrics"]
    for kind, values in metrics["local"].items():
        for key, value in values.items():
            assert metrics["ray"][kind][key] == pytest.approx(value, abs=1e-5), (kind, key)


def test_a_cluster_too_small_fails_at_once_naming_its_resources(cluster: Any, tiny_qwen: Path, tmp_path: Path,
                                                                capsys) -> None:
    source = tmp_path / "in.jsonl"
    write_jsonl(source, 2, bad=False)
    assert main(["batch", "--model", str(tiny_qwen), "--in", str(source), "--out", str(tmp_path / "o.jsonl"),
                 "--ray", "auto", "--replicas", "2", "--cpus-per-replica", "1", "--no-progress"]) == 2
    assert "do not fit: the cluster has 1 node(s), 2 CPU(s)" in capsys.readouterr().err
    assert main(["batch", "--model", str(tiny_qwen), "--in", str(source), "--out", str(tmp_path / "o.jsonl"),
                 "--ray", "10.1.2.3:6379", "--no-progress"]) == 2  # refused before any connection is tried
    assert "pass --allow-network" in capsys.readouterr().err


@pytest.mark.slow  # 84 s on a busy 2-core machine: two actor pools (reference, candidate) each load the model
def test_drift_with_ray_compares_what_a_local_run_compares(cluster: Any, tiny_llama: Path, tmp_path: Path) -> None:
    from clef_local.quality.drift_cli import main as drift_main

    bundles = {}
    for name, extra in (("local", []), ("ray", ["--ray", "auto", "--replicas", "2"])):
        out = tmp_path / f"{name}.json"
        assert drift_main(["--reference", str(tiny_llama), "--candidate", str(tiny_llama), "--limit", "6",
                           "--dtype", "float32", "--no-progress", "--json", str(out), *extra]) == 0
        bundles[name] = json.loads(out.read_text())["drift"][0]["summary"]
    assert bundles["ray"]["questions"] == bundles["local"]["questions"] > 0
    assert bundles["ray"]["flips"] == 0 and bundles["ray"]["kl_max"] < 1e-9
