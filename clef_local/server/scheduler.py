"""Dynamic batching: queued encoded requests become ``ClefModel.run`` batches on one inference thread, never on the
event loop (torch is not safe for concurrent forwards on one model); its threads follow
:func:`~clef_local.planning.hardware.thread_plan`. A failed batch is re-run one request at a time, so errors stay
per request; a full queue is :class:`QueueFullError` (429). docs/serving.md#batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clef_local.errors import ClefError
from clef_local.planning.hardware import ThreadPlan, thread_plan
from clef_local.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from clef_local.runtime.encoding import EncodedRecord

log = logging.getLogger(__name__)


class QueueFullError(ClefError):
    """The scheduler's queue is full (HTTP 429, ``rate_limit_error``); retry after ``retry_after`` seconds."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(ClefError):
    """The server is stopping and takes no new work (HTTP 503)."""

    status_code = 503
    error_type = "unavailable"


@dataclass
class _Job:
    model: str
    record: EncodedRecord
    future: asyncio.Future[dict[str, Any]]
    enqueued: float = field(default_factory=time.perf_counter)


def apply_torch_threads(plan: ThreadPlan) -> int | None:
    """Set torch's intra-op threads to ``plan.intra_op`` and its inter-op threads to ``plan.inter_op`` (the latter
    only where torch still allows it: once per process, before any inter-op work). Returns the intra-op count it
    replaced, or None when torch is not loaded (an ONNX or MLX model: their sessions size their own threads)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    before = int(torch.get_num_threads())
    torch.set_num_threads(plan.intra_op)
    if torch.get_num_interop_threads() != plan.inter_op:
        try:
            torch.set_num_interop_threads(plan.inter_op)
        except RuntimeError as exc:  # torch allows it once, before inter-op work: a second server in one process
            log.info("torch inter-op threads stay at %d (%s)", torch.get_num_interop_threads(), exc)
    return before


class BatchScheduler:
    """Collects requests into batches and runs them on one inference thread.

    ``threads``: intra-op threads of that thread's forwards (None: :func:`~clef_local.planning.hardware.thread_plan`).
    """

    def __init__(self, models: Mapping[str, Any], *, max_batch: int = 8, max_wait_ms: float = 5.0,
                 max_queue: int = 64, confidence: str = "jev", metrics: ServerMetrics | None = None,
                 threads: int | None = None) -> None:
        self.models = models
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.confidence = confidence
        self.metrics = metrics
        self._queue: deque[_Job] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closing = False
        self._running = 0  # requests in the batch being computed
        self._taken: list[_Job] = []  # the collected batch: taken off the queue, not all answered yet
        self._batch_seconds = 0.05  # moving average, for Retry-After
        # one inference thread (see the class doc) beside the event loop: the server's rule, whatever the process
        self.thread_plan = thread_plan(workers=1, threads=threads, role="server")
        self._threads_before: int | None = None

    # ------------------------------------------------------------------ state
    @property
    def queue_depth(self) -> int:
        """Requests waiting for the inference thread."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Requests in the batch being computed now."""
        return self._running

    def retry_after(self) -> float:
        """Seconds until the queue has likely drained by one batch's worth (at least 1)."""
        batches = math.ceil((len(self._queue) + self._running) / self.max_batch)
        return max(1.0, math.ceil(batches * self._batch_seconds))

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the collector (call from the running event loop)."""
        if self._task is not None:
            return
        if self.metrics is not None:
            self.metrics.watch_state_caches(self.models)
        self._wakeup = asyncio.Event()
        self._threads_before = apply_torch_threads(self.thread_plan)
        log.info("inference: %s", self.thread_plan.describe())
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-inference")
        self._task = asyncio.get_running_loop().create_task(self._collect(), name="clef-batch-collector")

    async def stop(self, timeout: float = 30.0) -> None:
        """Refuse new work, finish every queued and running request (up to ``timeout`` s), then stop."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while (self._queue or self._taken) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for job in [*self._taken, *self._queue]:  # only left when the timeout passed
            if not job.future.done():
                job.future.set_exception(ShuttingDownError("the server stopped before this request ran"))
        self._queue.clear()
        self._taken = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._task = self._executor = None
        if self._threads_before is not None and (torch := sys.modules.get("torch")) is not None:
            torch.set_num_threads(self._threads_before)  # the process may go on (tests, an embedding app)
            self._threads_before = None

    # ------------------------------------------------------------------ requests
    async def submit(self, model: str, record: EncodedRecord) -> dict[str, Any]:
        """Queue one encoded request for ``model`` and wait for its response (full-precision floats)."""
        if self._closing or self._task is None or self._wakeup is None:
            raise ShuttingDownError("the server is shutting down; retry on another instance")
        if len(self._queue) >= self.max_queue:
            raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later",
                                 self.retry_after())
        job = _Job(model, record, asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self._wakeup.set()
        return await job.future

    async def _next_job(self) -> _Job:
        assert self._wakeup is not None
        while not self._queue:
            self._wakeup.clear()
            await self._wakeup.wait()
        return self._queue.popleft()

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._next_job()]
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch:
                if self._queue:
                    batch.append(self._queue.popleft())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                assert self._wakeup is not None
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
            self._taken = batch
            groups: dict[str, list[_Job]] = {}
            for job in batch:
                groups.setdefault(job.model, []).append(job)
            for model, jobs in groups.items():
                await self._run_group(loop, model, jobs)
            self._taken = []

    async def _run_group(self, loop: asyncio.AbstractEventLoop, model: str, jobs: list[_Job]) -> None:
        self._running = len(jobs)
        started = time.perf_counter()
        try:  # a cancellation here (stop() gave up waiting) leaves the jobs to stop(), which fails them
            results, sizes = await loop.run_in_executor(self._executor, self._compute, model,
                                                        [j.record for j in jobs])
        finally:
            self._running = 0
        elapsed = time.perf_counter() - started
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * elapsed
        if self.metrics is not None:
            for size in sizes:
                self.metrics.batch_size.observe(size)
            self.metrics.inference.observe(elapsed)
        self._finish(jobs, results)

    @staticmethod
    def _finish(jobs: Sequence[_Job], results: Sequence[Any]) -> None:
        for job, result in zip(jobs, results, strict=True):
            if job.future.done():  # the client went away
                continue
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)

    def _compute(self, model_name: str, records: list[EncodedRecord]) -> tuple[list[Any], list[int]]:
        """On the inference thread: the group through ``run`` (its batches' sizes too); when that fails, each
        record alone, so that errors stay per request."""
        model = self.models[model_name]
        try:
            return self._answers(model, records, len(records))
        except Exception as exc:
            if len(records) == 1:
                if not isinstance(exc, ClefError):
                    log.exception("inference failed on model %s", model_name)
                return [exc], [1]
            log.debug("a batch of %d failed (%s); answering its requests one by one", len(records), exc)
        results: list[Any] = []
        for record in records:
            try:
                results += self._answers(model, [record], 1)[0]
            except Exception as exc:
                if not isinstance(exc, ClefError):
                    log.exception("inference failed on model %s", model_name)
                results.append(exc)
        return results, [1] * len(records)

    def _answers(self, model: Any, records: list[EncodedRecord], batch_size: int) -> tuple[list[Any], list[int]]:
        answers: list[Any] = [None] * len(records)
        sizes = []
        for chunk, predictions in model.run(records, batch_size=batch_size):
            sizes.append(len(chunk))
            for i, prediction in zip(chunk, predictions, strict=True):
                answers[i] = prediction.response(self.confidence)
        return answers, sizes
