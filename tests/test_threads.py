"""Inference threads: physical cores (hyper-threads and cgroup quotas counted right), the rule and its overrides,
and the server's inference thread / ONNX Runtime sessions actually running with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clef_local.errors import ApiUsageError
from clef_local.planning.hardware import (
    RESERVED_CORES,
    ThreadPlan,
    cgroup_cpu_limit,
    physical_cores,
    thread_plan,
)


def _sysfs(root: Path, topology: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in topology.items():
        directory = root / f"cpu{cpu}" / "topology"
        directory.mkdir(parents=True)
        (directory / "physical_package_id").write_text(f"{package}\n")
        (directory / "core_id").write_text(f"{core}\n")
    return root


def test_physical_cores_count_hyperthreads_once(tmp_path: Path) -> None:
    # 2 packages × 2 cores × 2 hyper-threads: CPUs 0-3 on package 0, 4-7 on package 1; siblings n and n+2
    topology = {cpu: (cpu // 4, cpu % 2) for cpu in range(8)}
    sysfs = _sysfs(tmp_path, topology)
    assert physical_cores(range(8), sysfs, quota=0) == 4
    assert physical_cores({0, 2}, sysfs, quota=0) == 1  # two siblings of one core
    assert physical_cores({0, 1, 4}, sysfs, quota=0) == 3  # core_id 0 of package 0 and of package 1 differ
    assert physical_cores(range(8), sysfs, quota=2.5) == 2  # a container limited to 2.5 CPUs
    assert physical_cores(range(8), sysfs, quota=0.5) == 1
    assert physical_cores({11, 12}, sysfs, quota=0) == 2  # no topology files: each CPU counts


def test_cgroup_quota_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "app" / "worker").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "app" / "cpu.max").write_text("150000 100000\n")  # the parent is tighter than the leaf
    (v2 / "app" / "worker" / "cpu.max").write_text("400000 100000\n")
    assert cgroup_cpu_limit(v2, {"": "/app/worker"}) == 1.5
    (v2 / "app" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2, {"": "/app/worker"}) == 4.0
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1, {"cpu": "/"}) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    assert cgroup_cpu_limit(v1, {"cpu": "/"}) == 2.0
    assert cgroup_cpu_limit(tmp_path / "none", {}) is None


@pytest.mark.parametrize(("cores", "workers", "expected"), [(1, 1, 1), (2, 1, 1), (4, 1, 3), (16, 1, 15), (16, 2, 7),
                                                            (16, 3, 5), (2, 4, 1)])
def test_the_servers_rule(cores: int, workers: int, expected: int) -> None:
    assert RESERVED_CORES["server"] == 1
    plan = thread_plan(workers, role="server", cores=cores, environ={})
    assert (plan.intra_op, plan.inter_op, plan.source, plan.role) == (expected, 1, "rule", "server")
    reserve = RESERVED_CORES["server"]
    assert plan.intra_op * workers + reserve <= max(cores, workers + reserve)  # never oversubscribed
    assert f"{cores} physical core(s) − 1 for the event loop" in plan.describe()
    assert thread_plan(workers, cores=cores, environ={}) == plan  # the library's default role


@pytest.mark.parametrize(("cores", "workers", "expected"), [(1, 1, 1), (2, 1, 2), (4, 1, 4), (16, 1, 16), (16, 2, 8),
                                                            (16, 3, 5), (2, 4, 1)])
def test_one_shot_commands_use_every_physical_core(cores: int, workers: int, expected: int) -> None:
    assert RESERVED_CORES["command"] == 0
    plan = thread_plan(workers, role="command", cores=cores, environ={})
    assert (plan.intra_op, plan.inter_op, plan.source, plan.role) == (expected, 1, "rule", "command")
    assert plan.intra_op * workers <= max(cores, workers)
    assert f"all {cores} physical core(s)" in plan.describe()


@pytest.mark.parametrize(("command", "args", "role"), [
    ("decide", ["--example", "triage"], "command"), ("quantize", ["--bits", "4"], "command"), ("eval", [], "command"),
    ("drift", [], "command"), ("calibrate", [], "command"), ("batch", ["in.jsonl"], "command"),
    ("batch", ["--ray-timeout", "5"], "command"), ("batch", ["--", "--ray"], "command"),
    ("batch", ["--ray", "local"], "server"), ("eval", ["--ray=auto"], "server"), ("drift", ["--ray", "x:1"], "server"),
    ("serve", [], "server"), ("ui", [], "server"),
])
def test_the_cli_picks_each_commands_rule(command: str, args: list[str], role: str) -> None:
    from clef_local.cli import thread_role

    assert thread_role(command, args) == role


def test_threads_error_on_an_unknown_role() -> None:
    with pytest.raises(ApiUsageError, match="thread role must be one of command, server, got 'batch'"):
        thread_plan(role="batch", cores=4, environ={})  # type: ignore[arg-type]


@pytest.mark.parametrize("role", ["command", "server"])
def test_overrides_in_order(role: str) -> None:
    env = {"CLEF_LOCAL_THREADS": "3", "OMP_NUM_THREADS": "5"}
    assert thread_plan(threads=2, role=role, cores=8, environ=env).intra_op == 2  # type: ignore[arg-type]
    assert thread_plan(role=role, cores=8, environ={"OMP_NUM_THREADS": "5"}).intra_op == 5  # type: ignore[arg-type]
    assert (thread_plan(cores=8, environ=env).intra_op, thread_plan(cores=8, environ=env).source) == \
        (3, "CLEF_LOCAL_THREADS")
    assert thread_plan(cores=8, environ={"OMP_NUM_THREADS": "4,2"}).intra_op == 4
    assert thread_plan(cores=8, environ={"OMP_NUM_THREADS": ""}).source == "rule"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"environ": {"CLEF_LOCAL_THREADS": "many"}}, "CLEF_LOCAL_THREADS='many' is not a thread count"),
    ({"environ": {"CLEF_LOCAL_THREADS": "0"}}, "CLEF_LOCAL_THREADS='0'"),
    ({"environ": {"OMP_NUM_THREADS": "-2"}}, "OMP_NUM_THREADS='-2'"),
    ({"threads": 0, "environ": {}}, "threads must be ≥ 1, got 0"),
    ({"workers": 0, "environ": {}}, "workers must be ≥ 1, got 0"),
])
def test_bad_settings_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ApiUsageError, match=message.replace("(", r"\(")):
        thread_plan(cores=4, **kwargs)


SERVER = """
import asyncio, json, sys
import torch
from clef_local.server.scheduler import BatchScheduler

seen = {}

class Answer:
    def response(self, confidence):
        return {"ok": True}

class Model:
    def run(self, records, batch_size):
        seen.update(intra=torch.get_num_threads(), inter=torch.get_num_interop_threads())
        yield list(range(len(records))), [Answer() for _ in records]

async def main():
    torch.set_num_threads(3)  # what the process ran with before the server started
    scheduler = BatchScheduler({"m": Model()}, threads=None if sys.argv[1] == "auto" else int(sys.argv[1]))
    await scheduler.start()
    await scheduler.submit("m", object())
    await scheduler.stop()
    seen["after"] = torch.get_num_threads()
    seen["plan"] = scheduler.thread_plan.intra_op

asyncio.run(main())
print(json.dumps(seen))
"""


@pytest.mark.parametrize(("setting", "env"), [("auto", {}), ("2", {}), ("auto", {"CLEF_LOCAL_THREADS": "2"})],
                         ids=["rule", "argument", "environment"])
def test_the_inference_thread_runs_with_the_plan(setting: str, env: dict[str, str]) -> None:
    """In a fresh process (torch's inter-op count can be set once per process): the forward sees the plan's
    intra-op threads and one inter-op thread; stopping restores what the process had."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CLEF_LOCAL_THREADS")}
    done = subprocess.run([sys.executable, "-c", SERVER, setting], capture_output=True, text=True, timeout=120,
                          env={**clean, **env}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    expected = thread_plan(environ={}).intra_op if setting == "auto" and not env else 2
    assert seen == {"intra": expected, "inter": 1, "after": 3, "plan": expected}


def test_onnx_sessions_use_the_plan(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from clef_local.backends.onnx_backend import session_options

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    options = session_options(ThreadPlan(3, 1, 4, 1, "argument"))
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 1)
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert session.get_session_options().intra_op_num_threads == 3
    assert session.run(None, {"x": [-1.0, 2.0]})[0].tolist() == [0.0, 2.0]
    assert session_options().intra_op_num_threads == thread_plan(workers=1).intra_op


def test_doctor_shows_the_threads(capsys: pytest.CaptureFixture[str]) -> None:
    from clef_local.planning import doctor

    assert doctor.main(["--json", "--no-probe"]) == 0
    info = json.loads(capsys.readouterr().out)
    for role in ("command", "server"):
        plan = thread_plan(workers=1, role=role)  # type: ignore[arg-type]
        shown = info["threads"][role]
        assert (shown["intra_op"], shown["inter_op"], shown["role"]) == (plan.intra_op, 1, role)
        assert shown["physical_cores"] == physical_cores()
    assert doctor.main(["--no-probe"]) == 0
    out = capsys.readouterr().out
    assert thread_plan(role="command").describe() in out and thread_plan(role="server").describe() in out


PROCESS = """
import json, os, sys
from clef_local.planning.hardware import thread_plan, use_process_threads
use_process_threads(sys.argv[1])
import torch
from clef_local.backends.onnx_backend import session_options
plan = thread_plan()
print(json.dumps({"omp": os.environ["OMP_NUM_THREADS"], "torch": torch.get_num_threads(), "source": plan.source,
                  "role": plan.role, "onnx": session_options().intra_op_num_threads,
                  "server": thread_plan(role="server").intra_op}))
"""


@pytest.mark.parametrize(("role", "env"), [("command", {}), ("server", {}), ("command", {"OMP_NUM_THREADS": "1"}),
                                           ("command", {"CLEF_LOCAL_THREADS": "1"})],
                         ids=["command", "server", "users-omp", "clef-local-threads"])
def test_a_process_runs_torch_and_onnx_with_its_roles_plan(role: str, env: dict[str, str]) -> None:
    """What the CLI does before a command's imports (use_process_threads), in a fresh process: torch's threads and
    ONNX Runtime's session options follow the role's rule; the OMP_NUM_THREADS it set is the rule's, not a user's;
    a user's OMP_NUM_THREADS / CLEF_LOCAL_THREADS still wins."""
    pytest.importorskip("onnxruntime")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CLEF_LOCAL_THREADS")}
    done = subprocess.run([sys.executable, "-c", PROCESS, role], capture_output=True, text=True, timeout=120,
                          env={**clean, **env}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    cores = physical_cores()
    rule = {"command": cores, "server": max(1, cores - 1)}
    if not env:
        expected = {"omp": str(rule[role]), "torch": rule[role], "source": "rule", "role": role, "onnx": rule[role],
                    "server": rule["server"]}
    else:
        (name, value), = env.items()
        expected = {"omp": value, "torch": int(value), "source": name, "role": role, "onnx": int(value),
                    "server": int(value)}
    assert seen == expected


ONE_SHOT = """
import json, sys
import clef_local.cli
sys.argv = ["clef-local", *sys.argv[1:]]
code = clef_local.cli.main()  # argv None: the console script's path, a process of its own
import torch
print(json.dumps({"code": code, "torch": torch.get_num_threads()}), file=sys.stderr)
"""


@pytest.mark.parametrize("command", ["decide", "inspect"])
def test_a_one_shot_command_computes_on_every_core(command: str, tiny_qwen: Path) -> None:
    """``clef-local decide`` / ``inspect`` as their own process: torch runs on every physical core."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CLEF_LOCAL_THREADS")}
    args = [command, "--model", str(tiny_qwen), *(["--example", "triage"] if command == "decide" else [])]
    done = subprocess.run([sys.executable, "-c", ONE_SHOT, *args], capture_output=True, text=True, timeout=180,
                          env=clean, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stderr.strip().splitlines()[-1])
    assert seen == {"code": 0, "torch": physical_cores()}
