"""How many model replicas a Ray cluster holds and what each reserves: sized from the cluster, never guessed.

Replicas that each reserve a whole CPU can leave nothing for Ray Data's own read tasks, and the job then waits for a
CPU forever without an error; so every node keeps :data:`RESERVED_CPUS` free and replicas share the rest. Pure
arithmetic on ``ray.nodes()``, tested without a cluster (docs/batch.md#on-a-ray-cluster).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clef_local.errors import BatchError

RESERVED_CPUS = 0.5  # per node, for Ray Data's read and bookkeeping tasks
MIN_REPLICA_CPUS = 0.1  # below this a replica would wait on the CPU more than it computes
GPU_REPLICA_CPUS = 1.0  # what a GPU replica reserves for tokenization when the node has it to spare


@dataclass(frozen=True)
class ReplicaPlan:
    """``replicas`` actors, each reserving ``cpus`` CPUs and ``gpus`` GPUs, running ``threads`` torch threads."""

    replicas: int
    cpus: float
    gpus: float
    threads: int

    def describe(self) -> str:
        gpus = f", {self.gpus:g} GPU" if self.gpus else ""
        return f"{self.replicas} replica(s) × {self.cpus:.3g} CPU{gpus}, {self.threads} thread(s) each"


def _fits(free: Sequence[float], size: float, count: int) -> bool:
    return sum(math.floor(f / size + 1e-9) for f in free) >= count


def _cluster(nodes: Sequence[Mapping[str, float]]) -> str:
    cpus = sum(n.get("CPU", 0.0) for n in nodes)
    gpus = sum(n.get("GPU", 0.0) for n in nodes)
    return f"the cluster has {len(nodes)} node(s), {cpus:g} CPU(s), {gpus:g} GPU(s)"


def _cpu_share(free: Sequence[float], replicas: int) -> float:
    """The largest equal CPU share with which ``replicas`` actors fit on the nodes' free CPUs."""
    candidates = sorted({f / k for f in free if f > 0 for k in range(1, replicas + 1)}, reverse=True)
    for share in candidates:
        if _fits(free, share, replicas):
            return share
    return 0.0


def plan_replicas(nodes: Sequence[Mapping[str, float]], *, replicas: int | None = None, gpus_per_replica: float = 0,
                  cpus_per_replica: float | None = None) -> ReplicaPlan:
    """Size ``replicas`` (default: one per GPU share with ``gpus_per_replica``, else one per node) on ``nodes``.

    Each node is a mapping of its total resources (``{"CPU": 16.0, "GPU": 2.0}``). Raises :class:`BatchError`
    naming the cluster's resources when the replicas cannot all be placed.
    """
    if not nodes:
        raise BatchError("the Ray cluster has no live node")
    if replicas is not None and replicas < 1:
        raise BatchError(f"--replicas must be ≥ 1, got {replicas}")
    if gpus_per_replica < 0 or (cpus_per_replica is not None and cpus_per_replica <= 0):
        raise BatchError("--gpus-per-replica must be ≥ 0 and --cpus-per-replica > 0")
    free_cpus = [max(0.0, n.get("CPU", 0.0) - RESERVED_CPUS) for n in nodes]
    if gpus_per_replica:
        gpu_slots = sum(math.floor(n.get("GPU", 0.0) / gpus_per_replica + 1e-9) for n in nodes)
        count = replicas or gpu_slots
        if count < 1 or gpu_slots < count:
            need = max(count, 1)
            raise BatchError(f"{need} replica(s) × {gpus_per_replica:g} GPU need {need * gpus_per_replica:g} GPU(s) but"
                             f" {_cluster(nodes)}; lower --replicas or --gpus-per-replica, add GPU "
                             "workers, or run on CPUs (--gpus-per-replica 0)")
    else:
        count = replicas or len(nodes)
    if cpus_per_replica is not None:
        cpus = cpus_per_replica
        if not _fits(free_cpus, cpus, count):
            raise BatchError(f"{count} replica(s) × {cpus:g} CPU do not fit: {_cluster(nodes)} and each node keeps "
                             f"{RESERVED_CPUS:g} CPU for Ray Data's own tasks; lower --replicas or "
                             "--cpus-per-replica, or leave --cpus-per-replica out to size it from the cluster")
    else:
        cpus = _cpu_share(free_cpus, count)
        if gpus_per_replica:
            cpus = min(cpus, GPU_REPLICA_CPUS)
        if cpus < MIN_REPLICA_CPUS:
            raise BatchError(f"{count} replica(s) would get {cpus:.3g} CPU each: {_cluster(nodes)} and each node "
                             f"keeps {RESERVED_CPUS:g} CPU for Ray Data's own tasks; lower --replicas or add workers")
    # torch threads: never more than the CPUs reserved (at least one). More threads than cores oversubscribe a busy
    # machine: 2 threads on a 1.5-CPU share of a shared 2-core machine ran several times slower (docs/benchmarks.md)
    threads = max(1, math.floor(cpus + 1e-9))
    return ReplicaPlan(count, math.floor(cpus * 1e4) / 1e4, float(gpus_per_replica), threads)
