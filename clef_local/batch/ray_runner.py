"""The same job on a Ray cluster: chunks as a Ray Data dataset, decided by an actor pool of model replicas.

Each :class:`Replica` loads the model once and runs :func:`clef_local.batch.work.decide_chunk`, the local job's code;
the driver commits what comes back through the same journal, and Ray's actor pools restart a killed replica and
retry its chunk. ``eval`` and ``drift`` use the pool through :class:`RayPredictor`. docs/batch.md#on-a-ray-cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pickle
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.batch.replicas import ReplicaPlan, plan_replicas
from clef_local.errors import BatchError, ClefError

if TYPE_CHECKING:
    from clef_local.batch.io import Row
    from clef_local.batch.work import ChunkResult, ChunkSettings
    from clef_local.model import Prediction

log = logging.getLogger(__name__)

RAY_EXTRA = "pip install 'clef-local[ray]'"
DEFAULT_TIMEOUT_S = 300.0
# A cluster this job starts itself stays on this machine: every Ray process on loopback, no usage report.
LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass(frozen=True)
class RaySettings:
    """``--ray``: ``auto`` (a running cluster, else one started on this machine), ``local`` (always a new one on
    this machine) or a cluster's ``ADDRESS``; the replicas and what each reserves; how long the pool may take."""

    address: str = "auto"
    replicas: int | None = None
    gpus_per_replica: float = 0.0
    cpus_per_replica: float | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    """``--ray``, ``--replicas``, ``--gpus-per-replica``, ``--cpus-per-replica``, ``--ray-timeout``."""
    group = parser.add_argument_group("Ray (pip install 'clef-local[ray]'; docs/batch.md)")
    group.add_argument("--ray", metavar="auto|local|ADDRESS",
                       help="run on Ray: auto (the running cluster, else one started on this machine), local (a new "
                            "one on this machine), or a cluster address (host:port, ray://host:port)")
    group.add_argument("--replicas", type=int, help="model replicas (default: one per GPU share, else one per node)")
    group.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs each replica reserves (default 0)")
    group.add_argument("--cpus-per-replica", type=float,
                       help="CPUs each replica reserves (default: the nodes' CPUs shared out, half a CPU per node "
                            "kept for Ray Data's own tasks)")
    group.add_argument("--ray-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help=f"seconds the replicas may take to start (default {DEFAULT_TIMEOUT_S:g})")


def ray_settings(args: argparse.Namespace) -> RaySettings | None:
    """The :class:`RaySettings` of parsed :func:`add_ray_flags` flags, or None without ``--ray``."""
    if not args.ray:
        if args.replicas is not None or args.gpus_per_replica or args.cpus_per_replica is not None:
            raise BatchError("--replicas, --gpus-per-replica and --cpus-per-replica need --ray auto|local|ADDRESS")
        return None
    return RaySettings(args.ray, args.replicas, args.gpus_per_replica, args.cpus_per_replica, args.ray_timeout)


def import_ray() -> Any:
    """``ray`` with Ray Data, or a :class:`BatchError` that says which extra installs it."""
    try:
        import ray
        import ray.data  # Ray Data is the part the job needs
    except ImportError:
        raise BatchError(f"--ray needs Ray (with Ray Data): {RAY_EXTRA}") from None
    return ray


def _address_host(address: str) -> str:
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 or rest.startswith("[") else rest


def check_reach(settings: RaySettings, airgapped: bool) -> None:
    """An ``ADDRESS`` on another machine needs ``--allow-network`` (clef-local runs air-gapped by default)."""
    from clef_local.airgap import is_local_host

    if settings.address in ("auto", "local") or not airgapped:
        return
    if not is_local_host(_address_host(settings.address)):
        raise BatchError(f"--ray {settings.address} is another machine and clef-local runs air-gapped; pass "
                         "--allow-network to reach the cluster")


@contextlib.contextmanager
def ray_session(settings: RaySettings, *, airgapped: bool = True) -> Iterator[Any]:
    """Connect to (or start) the cluster for one job and leave it as found: a cluster this session started is shut
    down at the end; one that was connected already (``ray.is_initialized()``, e.g. a test's) is kept."""
    ray = import_ray()
    check_reach(settings, airgapped)
    if ray.is_initialized():
        yield ray
        return
    saved = {key: os.environ.get(key) for key in LOCAL_ENV}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    quiet = {"include_dashboard": False, "logging_level": logging.WARNING, "configure_logging": False}
    try:
        if settings.address == "auto":
            try:
                ray.init(address="auto", **quiet)
                log.info("connected to the running Ray cluster")
            except ConnectionError:
                log.info("no running Ray cluster found; starting one on this machine (%d CPUs)", os.cpu_count() or 1)
                _start_local(ray, quiet)
        elif settings.address == "local":
            _start_local(ray, quiet)
        else:
            ray.init(address=settings.address, **quiet)
        yield ray
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_local(ray: Any, options: dict[str, Any]) -> None:
    os.environ.update(LOCAL_ENV)  # inherited by the raylet and every worker: all of them bind to loopback
    ray.init(num_cpus=os.cpu_count() or 1, _node_ip_address="127.0.0.1", **options)


def cluster_plan(ray: Any, settings: RaySettings) -> ReplicaPlan:
    """:func:`plan_replicas` on the live nodes of the connected cluster."""
    nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    plan = plan_replicas(nodes, replicas=settings.replicas, gpus_per_replica=settings.gpus_per_replica,
                         cpus_per_replica=settings.cpus_per_replica)
    log.info("Ray: %s", plan.describe())
    return plan


class Replica:
    """One model replica (a Ray Data actor): loads the model once, then decides one payload per call.

    A payload is a pickled ``("batch", chunk, rows, ChunkSettings)`` or ``("predict", chunk, requests,
    batch_size)``; the answer a pickled ``("ok", ChunkResult | (predictions, batch seconds))`` or ``("error",
    message)``, so an error that is not a row's (a request ``eval`` cannot score) reaches the driver as one line.
    """

    def __init__(self, model_path: str, load_options: dict[str, Any], airgapped: bool, threads: int) -> None:
        import clef_local
        from clef_local.airgap import airgap

        if load_options.get("backend", "auto") in ("auto", "torch"):
            import torch

            torch.set_num_threads(threads)  # the replica's CPU share, not every core of the node
        try:
            with airgap(airgapped):
                self.model = clef_local.load(model_path, **load_options)
        except (FileNotFoundError, ClefError) as exc:
            raise BatchError(f"node {socket.gethostname()}: cannot load the model {model_path} ({exc}); model files "
                             "must be on every node at that path, or on a shared filesystem") from exc

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        from clef_local.batch.work import decide_chunk

        results = []
        for blob in batch["payload"]:
            task, chunk, items, options = pickle.loads(blob)
            try:
                if task == "batch":
                    answer: Any = ("ok", decide_chunk(self.model, chunk, items, options))
                else:
                    seconds: list[float] = []
                    predictions = self.model.predict(items, batch_size=options, batch_seconds=seconds)
                    answer = ("ok", (predictions, seconds))
            except ClefError as exc:  # sent as text: the error classes' own arguments do not survive pickling
                answer = ("error", str(exc))
            results.append(pickle.dumps(answer))
        return {"chunk": np.asarray(batch["chunk"]), "result": np.asarray(results, dtype=object)}


def run_payloads(ray: Any, payloads: Sequence[tuple[int, bytes]], *, model_path: Path,
                 load_options: dict[str, Any], plan: ReplicaPlan, airgapped: bool,
                 timeout_s: float) -> Iterator[tuple[int, Any]]:
    """``(chunk, result)`` for each payload as its replica finishes (any order). A :class:`ClefError` a replica
    returned, and a pool that cannot start or make progress, end as a :class:`BatchError` with the message."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the job draws its own
    context.wait_for_min_actors_s = timeout_s
    context.execution_options.preserve_order = False  # chunks are committed by number, in any order
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if not payloads:
        return
    dataset = ray.data.from_items([{"chunk": chunk, "payload": blob} for chunk, blob in payloads],
                                  override_num_blocks=len(payloads))
    dataset = dataset.map_batches(
        Replica, batch_size=1, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=plan.replicas),
        fn_constructor_kwargs={"model_path": str(model_path), "load_options": load_options, "airgapped": airgapped,
                               "threads": plan.threads},
        num_cpus=plan.cpus, num_gpus=plan.gpus or None)  # actor pools restart and retry without limit by default
    try:
        for row in dataset.iter_rows():
            status, value = pickle.loads(row["result"])
            if status == "error":
                raise BatchError(value)
            yield int(row["chunk"]), value
    except ray.exceptions.GetTimeoutError:
        raise BatchError(f"the Ray replicas did not start within {timeout_s:g} s ({plan.describe()}); the cluster "
                         "is busy or too small for them: lower --replicas / --cpus-per-replica, or raise "
                         "--ray-timeout") from None
    except ray.exceptions.RayError as exc:
        raise BatchError(f"the Ray job failed: {_last_line(exc)}") from exc


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def ray_decide_chunks(chunks: Sequence[tuple[int, list[Row]]], settings: ChunkSettings, *, ray: Any,
                      plan: ReplicaPlan, model_path: Path, load_options: dict[str, Any], airgapped: bool,
                      timeout_s: float) -> Iterator[ChunkResult]:
    """:func:`clef_local.batch.work.decide_chunk` of each chunk, on the replicas (results in any order)."""
    payloads = [(chunk, pickle.dumps(("batch", chunk, rows, settings))) for chunk, rows in chunks]
    for _, result in run_payloads(ray, payloads, model_path=model_path, load_options=load_options, plan=plan,
                                  airgapped=airgapped, timeout_s=timeout_s):
        yield result


class RayPredictor:
    """:meth:`ClefModel.predict` on a Ray actor pool, for ``eval --ray`` and ``drift --ray``: the requests go out in
    chunks of ``chunk_requests``, the predictions come back in request order."""

    def __init__(self, path: str | Path, settings: RaySettings, *, load_options: dict[str, Any] | None = None,
                 airgapped: bool = True, chunk_requests: int = 64) -> None:
        self.path = Path(path)
        self.settings = settings
        self.load_options = dict(load_options or {})
        self.airgapped = airgapped
        self.chunk_requests = chunk_requests

    def predict(self, requests: Sequence[Any], *, batch_size: int = 8,
                progress: Callable[[int, int], None] | None = None,
                batch_seconds: list[float] | None = None) -> list[Prediction]:
        """Every request's :class:`Prediction`, in order; ``batch_seconds`` receives the replicas' batch times."""
        parts: dict[int, list[Prediction]] = {}
        done = 0
        started = time.perf_counter()
        with ray_session(self.settings, airgapped=self.airgapped) as ray:
            plan = cluster_plan(ray, self.settings)
            # at least four chunks per replica (a short file still spreads), at most chunk_requests each
            n = max(1, min(self.chunk_requests, -(-len(requests) // (4 * plan.replicas))))
            payloads = [(k, pickle.dumps(("predict", k, list(requests[k * n:(k + 1) * n]), batch_size)))
                        for k in range(-(-len(requests) // n))]
            for chunk, (predictions, seconds) in run_payloads(
                    ray, payloads, model_path=self.path, load_options=self.load_options, plan=plan,
                    airgapped=self.airgapped, timeout_s=self.settings.timeout_s):
                parts[chunk] = predictions
                if batch_seconds is not None:
                    batch_seconds.extend(seconds)
                done += len(predictions)
                if progress is not None:
                    progress(done, len(requests))
        log.info("%d predictions on Ray in %.1f s", len(requests), time.perf_counter() - started)
        return [p for k in sorted(parts) for p in parts[k]]
