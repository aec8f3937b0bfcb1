"""The host-side optimizer step as a pipeline: copies out, host Adam, copies back, on worker threads.

[Note: the step pipeline]
Where a family's optimizer states live on the host, its step has three stages: its gradients travel from the
device to the host (D2H: in mixed precision the compute-dtype gradients in the param chunk, in 32-true the param
chunk itself, which is the fp32 master there), Adam runs on the host, and the updated compute-dtype parameters
travel back (H2D). A serial step runs them family after family on the calling thread, so it costs the sum of
the three for every family. Here each stage has a worker thread of its own (a single-thread executor, so each
stage keeps the submission order), and family k+1's gradients travel while Adam runs on family k and family
k-1's parameters travel back: a step costs its slowest stage plus one family's latency.

What stays the same as the serial step, so that the bits are the same:

- the arithmetic: the Adam stage runs the very kernels of the serial step (:func:`~lightning_pstar.optim.kernels.
  adam_on_plan`) on the same values (the gradients converted to fp32 exactly as ``Tensor.float()`` does, into a
  persistent scratch buffer of the stage, scaled and clipped by the same factors), and writes the compute-dtype
  copy into the chunk's host buffer as the serial step does;
- the hyper-parameters: a job takes a copy of its param groups when it is submitted (a tensor learning rate is
  cloned), so an LR scheduler stepping after ``optimizer.step()`` cannot reach a job still in flight;
- the order within a family, and families are independent (each has its own slots and step counts).

What the main thread keeps: every piece of bookkeeping (chunk and slot states, where parameters point, budget
accounting, version counters) runs on the calling thread, when a job is submitted and when it is finished
(:meth:`StepPipeline.finish`), never on a worker. A worker touches only the tensors its job was given. While a
job is in flight its family is in the residency's ``stepping`` set: its param chunk is not evicted and its host
buffer (the staging copy) is not dropped for room. The param chunk stays on the device: after the job, its host
buffer is a current host copy (a later eviction copies nothing: [Note: clean evictions] in ``chunk.py``).

The parameter copies back (H2D) are held until the backward is over (:meth:`StepPipeline.open_copies_back`):
a family may step while the backward goes on (``optimizer_overlap="pipeline"``, [Note: stepping inside the
backward] in ``optim/overlap.py``), and the device bytes of its param chunk must not change while autograd could
still read them. Gradient copies and host Adam do not write the device. A job submitted with ``back_now`` copies
back as soon as its Adam stage is done, inside the backward, where the caller proved that nothing can read those
bytes any more ([Note: copies back inside the backward] in ``optim/overlap.py``); its family is in
:attr:`StepPipeline.early` until the job is finished.

On CUDA the copies run on side streams: the D2H stage waits for an event the compute stream recorded when the job
was submitted (after the kernels that wrote the gradients), copies into the pinned host buffer and waits for its
own event on the worker; the H2D stage copies on its stream and records an event that the compute stream waits on
when the job finishes ([Note: streams] in ``chunk.py``). On a CPU (the simulated device) a copy is a plain
``copy_`` on its worker thread: torch releases the GIL inside it, as inside the fused Adam kernel, so the stages
and the calling thread's compute run on different cores.

Each stage hands its job to the next stage's worker when it is done, so submitting a job is one hand-off on the
calling thread (which, inside the backward, is the compute's critical path). A job whose copy back is held waits
outside every queue (never in the H2D worker), so that one family can be settled off the device
(:meth:`StepPipeline.settle_off_device`) or finished for a reader (:meth:`StepPipeline.wait`) while the copies back
of the families submitted before it are still held. A stage that raises ends its job
there (its later stages do not run) and the error is the job's; :meth:`StepPipeline.drain` waits for every job,
finishes those that completed, and raises the first error.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, TypeVar

import torch

from lightning_pstar.runtime.lanes import ADAM, D2H, H2D, STAGE_NAMES, Lanes, host_lanes

__all__ = ["HostJob", "StageTimes", "StepPipeline"]

_T = TypeVar("_T")


@dataclass
class StageTimes:
    """Seconds the pipeline's workers spent in each stage (summed over jobs), and jobs run: for benchmarks."""

    d2h: float = 0.0
    adam: float = 0.0
    h2d: float = 0.0
    wait: float = 0.0  # the calling thread, waiting for jobs to finish
    jobs: int = 0
    in_backward: int = 0  # jobs started by a backward ([Note: stepping inside the backward] in optim/overlap.py)
    back_in_backward: int = 0  # ... whose copy back could run inside it ([Note: copies back inside the backward])
    norms_in_backward: int = 0  # families whose gradient norms a step took from the backward (optim/overlap.py)
    sums_in_backward: int = 0  # families' accumulated gradients summed on a host lane ([Note: sums beside ...])

    def seconds(self) -> dict[str, float]:
        return {"d2h": self.d2h, "adam": self.adam, "h2d": self.h2d, "wait": self.wait}

    def reset(self) -> None:
        self.d2h = self.adam = self.h2d = self.wait = 0.0
        self.jobs = self.in_backward = self.back_in_backward = self.norms_in_backward = self.sums_in_backward = 0


@dataclass(kw_only=True)
class HostJob:
    """One family's host step: three stage functions (run on workers, in order) and a finish (calling thread)."""

    family_id: int
    d2h: Callable[[], None]
    adam: Callable[[torch.Tensor], None]  # given the Adam stage's fp32 scratch buffer
    h2d: Callable[[], None]
    finish: Callable[[bool], None]  # given whether the H2D stage ran (see ``StepPipeline.settle_off_device``)
    scratch_numel: int  # elements of fp32 scratch the Adam stage needs
    before: list[Callable[[], None]] = field(default_factory=list)  # bookkeeping before ``finish`` (calling thread)
    failed: list[Callable[[], None]] = field(default_factory=list)  # bookkeeping when a stage raised (calling thread)
    after: list[Callable[[], None]] = field(default_factory=list)  # ... and after it
    skip_back: bool = False  # the H2D stage does not run: the family's param chunk goes to the host instead
    copies_use_cpu: bool = True  # its copies are CPU work (a simulated device), not a DMA engine's (CUDA)
    copies_out: bool = True  # its D2H stage copies something (not when the host copy is current already)
    # called on the calling thread when its copy back may run from now on (CUDA: the copy waits for the compute
    # stream's work queued until then, the backward's last reads of the device bytes: see ``_Copies`` in
    # optim/host_step.py)
    opened: Callable[[], None] | None = None
    _done: Future[None] | None = field(default=None, repr=False)
    _seq: int = field(default=0, repr=False)  # its place in submission order
    _back_open: bool = field(default=False, repr=False)  # its H2D stage may run (under the pipeline's lock)


class StepPipeline:
    """Three single-thread stages (D2H, Adam, H2D) that host-side family steps flow through."""

    def __init__(self) -> None:
        self._stages: list[ThreadPoolExecutor] | None = None
        self._jobs: dict[int, HostJob] = {}  # family id -> job in flight, in submission order
        self._scratch = threading.local()  # per Adam worker thread: its fp32 scratch (``buffer``)
        self._copies_back_open = True
        self._lock = threading.Lock()  # guards the hand-over from the Adam stage to the H2D stage
        self._held: list[HostJob] = []  # jobs past their Adam stage whose H2D stage waits for the backward's end
        # jobs past their D2H stage that no Adam worker took yet, and what decides which goes first ([Note: host
        # lanes] in lanes.py): families a caller waits for, the coming iteration's order of use, submission order
        self._ready: tuple[list[HostJob], list[HostJob]] = ([], [])  # of the D2H and the Adam stage
        self._urgent: set[int] = set()
        self._rank: dict[int, int] = {}
        self._seqs = itertools.count()
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self.times = StageTimes()
        self._lanes = Lanes(host_lanes(), adam_threads=_ADAM_THREADS)  # [Note: host lanes]
        self.early: set[int] = set()  # families whose copy back may run inside the backward (``submit(back_now)``)
        self._aside: list[Future[Any]] = []  # reads run beside the backward (:meth:`run_aside`)
        # optimizer_overlap's schedule as the last optimizer that stepped chose it ([Note: choosing the schedule]
        # in optim/overlap.py): "pipeline", "serial", or None while "auto" still times both
        self.schedule: str | None = None
        self.trial_ms: dict[str, float] = {}
        # whether the coming optimizer step runs pipelined (as the last optimizer that stepped says; "off" never):
        # the accumulating micro-batches before it sum their gradients aside only then ([Note: sums beside the
        # backward] in grads.py), so that "auto"'s trials time each schedule whole
        self.pipelined_next = True

    def streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
        """The copy streams of the D2H and H2D stages on CUDA (two, so both directions may copy at once); None
        on any other device."""
        if device.type != "cuda":
            return None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams

    @property
    def lent_runs(self) -> int:
        """Stages that ran in a lane a waiting caller lent ([Note: host lanes]), over the pipeline's life."""
        return self._lanes.lent_runs

    # ---- submission ----------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a job is in flight (submitted and not finished)."""
        return bool(self._jobs)

    def in_flight(self, family_id: int) -> bool:
        return family_id in self._jobs

    def job(self, family_id: int) -> HostJob | None:
        """The job of ``family_id`` in flight, if any."""
        return self._jobs.get(family_id)

    @property
    def family_ids(self) -> list[int]:
        """Families whose job is in flight, in submission order."""
        return list(self._jobs)

    @property
    def copies_back_open(self) -> bool:
        """Whether jobs' H2D stages may run now (no backward holds them: :meth:`hold_copies_back`)."""
        return self._copies_back_open

    def hold_copies_back(self) -> None:
        """Jobs submitted from now on keep their H2D stage waiting until :meth:`open_copies_back` (a backward runs)."""
        self._copies_back_open = False

    def open_copies_back(self) -> None:
        """Let every held H2D stage run (the backward is over: the device bytes are no longer read by autograd)."""
        with self._lock:
            self._copies_back_open = True
            for job in self._jobs.values():
                if not job._back_open:
                    _open(job)
            held, self._held = self._held, []
            for job in held:
                self._to_h2d(job)

    def submit(self, job: HostJob, *, back_now: bool = False) -> None:
        """Start ``job``'s stages on the workers; it is finished by :meth:`wait` or :meth:`drain`. ``back_now``: its
        copy back runs when its Adam stage is done even while copies back are held (the caller proved it safe)."""
        if job.family_id in self._jobs:
            raise RuntimeError(f"PatrickStar internal error: family {job.family_id} is already stepping")
        if back_now and not self._copies_back_open:
            self.early.add(job.family_id)
            self.times.back_in_backward += 1
        if self._copies_back_open or back_now:
            _open(job)
        job._done = Future()
        job._seq = next(self._seqs)
        # each stage hands the job to the next: one hand-off on this thread
        self._enqueue(job, D2H, claim=False)
        self._jobs[job.family_id] = job

    def prefer(self, ranks: dict[int, int]) -> None:
        """Which jobs in flight an Adam worker takes first: lower ``ranks[family_id]`` first (the coming iteration's
        order of use; [Note: host lanes] in lanes.py); a family not ranked after every ranked one."""
        with self._lock:
            self._rank = dict(ranks)

    def run_aside(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run ``fn`` on the D2H stage's worker in a host lane, after what was run aside before it: a read of host
        bytes that nothing writes until the step (a family's gradient norms during the backward: [Note: gradient
        norms inside the backward] in ``optim/overlap.py``), or a family's gradients summed into its host GRAD chunk
        ([Note: sums beside the backward] in ``grad_sums.py``). :meth:`drain` waits for it. Its result, or its error, is
        the returned future's."""
        future: Future[_T] = Future()

        def run() -> None:
            try:
                with self._lanes.held(D2H, claimed=False):
                    future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 - the caller reads it from the future
                future.set_exception(error)

        self._aside = [f for f in self._aside if not f.done()]
        self._aside.append(future)
        self._workers()[0].submit(run)
        return future

    # ---- completion ----------------------------------------------------------------------------------------
    def wait(self, family_id: int) -> None:
        """Finish the job of ``family_id`` if one is in flight (its stages done, then its bookkeeping)."""
        job = self._jobs.get(family_id)
        if job is None:
            return
        with self._lock:  # a reader needs it now: its Adam goes first, its copy back may run
            self._urgent.add(family_id)
            if not job._back_open:
                _open(job)
            if job in self._held:
                self._held.remove(job)
                self._to_h2d(job)
        self._finish(job)

    def settle_off_device(self, family_ids: list[int]) -> None:
        """Finish the jobs of ``family_ids`` without their H2D stage (a backward still holds it back, and the device
        needs their room): their families' updated parameters stay in the host buffers, where the job's finish
        leaves the param chunks, as a serial step on the host would."""
        for fid in family_ids:
            job = self._jobs.get(fid)
            if job is None:
                continue
            with self._lock:
                if job in self._held:  # past its Adam stage: done, without the copy back
                    self._held.remove(job)
                    job.skip_back = True
                    assert job._done is not None
                    job._done.set_result(None)
                elif not job._back_open:  # still in its D2H or Adam stage: it ends after Adam
                    job.skip_back = True
                # else its copy back is queued or running (a reader opened it): it finishes as usual
            self._finish(job)

    def drain(self, *, only: set[int] | None = None) -> None:
        """Finish every job in flight (``only``: of these families), in submission order; raise the first error once
        all have stopped. Reads run aside (:meth:`run_aside`) end first (their errors are their readers')."""
        aside, self._aside = self._aside, []
        for future in aside:
            future.exception()  # waits; the reader of its result sees the error
        if not self._jobs:
            return
        self.open_copies_back()
        failed: BaseException | None = None
        for job in [j for fid, j in self._jobs.items() if only is None or fid in only]:
            try:
                self._finish(job)
            except BaseException as error:  # noqa: BLE001 - re-raised below, after the other jobs stopped
                failed = failed or error
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Finish what is in flight and stop the workers (the run ends)."""
        try:
            self.drain()
        finally:
            if self._stages is not None:
                for stage in self._stages:
                    stage.shutdown(wait=True)
                self._stages = None
            self._scratch = threading.local()

    def _finish(self, job: HostJob) -> None:
        assert job._done is not None
        start = perf_counter()
        try:
            if job._done.done() or torch.get_num_threads() != 1:
                job._done.result()
            else:  # [Note: host lanes]: the waiting thread's core runs a stage meanwhile
                with self._lanes.lent():
                    job._done.result()
        except BaseException:
            for undo in job.failed:
                undo()
            raise
        finally:
            self.times.wait += perf_counter() - start
            del self._jobs[job.family_id]
            self._urgent.discard(job.family_id)
            self._rank.pop(job.family_id, None)
            self.early.discard(job.family_id)
        for first in job.before:
            first()
        job.finish(not job.skip_back)
        for more in job.after:
            more()
        self.times.jobs += 1

    # ---- workers -------------------------------------------------------------------------------------------
    def _workers(self) -> list[ThreadPoolExecutor]:
        if self._stages is None:
            threads = {"d2h": 1, "adam": _ADAM_THREADS, "h2d": 1}
            self._stages = [ThreadPoolExecutor(n, thread_name_prefix=f"pstar-{name}") for name, n in threads.items()]
        return self._stages

    def _scratch_for(self, numel: int) -> torch.Tensor:
        """The Adam stage's fp32 scratch (only that stage's thread calls this): grown, never shrunk."""
        buffer: torch.Tensor | None = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch.buffer = torch.empty(numel, dtype=torch.float32)
        return buffer[:numel]

    def _timed(self, stage: str, fn: Callable[[], None]) -> None:
        start = perf_counter()
        try:
            fn()
        finally:
            setattr(self.times, stage, getattr(self.times, stage) + perf_counter() - start)

    def _hand_on(self, stage: int, task: Callable[[], None], *, claim: bool) -> None:
        """Hand a job to ``stage``'s worker (``task`` runs it), its place in the lanes claimed first (see
        :meth:`_stage`). A worker that refuses it (``submit`` after the interpreter began to shut down: a Fabric
        script ending with a tail in flight) gives the claim back, so that no other stage waits for it, and the job
        ends with that error."""
        if claim:
            self._lanes.claim(stage)
        try:
            self._workers()[stage].submit(task)
        except BaseException:
            if claim:
                self._lanes.unclaim(stage)
            raise

    def _to_h2d(self, job: HostJob) -> None:
        """Hand ``job`` to the H2D stage (see :meth:`_hand_on`): its copies back run in the order they are opened."""
        stage = functools.partial(self._stage, lambda take, only=None: job, H2D, _copy_back, then=_done)
        self._hand_on(H2D, stage, claim=job.copies_use_cpu)

    def _enqueue(self, job: HostJob, stage: int, *, claim: bool) -> None:
        """Put ``job`` among ``stage``'s ready jobs and hand that stage one more task: the worker that runs it takes
        the ready job that goes first once it holds its lane (:meth:`_take_ready`, [Note: host lanes] in lanes.py).
        A refused task leaves one ready job without a task: ``job`` where still ready (it ends with the error,
        raised here), else the job last in order."""
        ready = self._ready[stage]
        with self._lock:
            ready.append(job)
        then = self._after_d2h if stage == D2H else self._after_adam
        task = functools.partial(self._stage, functools.partial(self._take_ready, stage), stage, _STAGE_RUNS[stage])
        try:
            self._hand_on(stage, functools.partial(task, then=then, claimed=claim), claim=claim)
        except BaseException as error:
            with self._lock:
                orphan = job if job in ready else max(ready, key=self._order, default=None)
                if orphan is not None:
                    ready.remove(orphan)
            if orphan is job:
                raise
            if orphan is not None:
                assert orphan._done is not None
                orphan._done.set_exception(error)

    def _order(self, job: HostJob) -> tuple[bool, int, int]:
        fid = job.family_id
        return fid not in self._urgent, self._rank.get(fid, 1 << 62), job._seq

    def _take_ready(self, stage: int, take: bool, only: HostJob | None = None) -> HostJob:
        """The ready job of ``stage`` that goes first now (or ``only``), taken (``take``) or only looked at."""
        ready = self._ready[stage]
        with self._lock:
            job = min(ready, key=self._order) if only is None else only
            if take:
                ready.remove(job)
        return job

    def _after_d2h(self, job: HostJob) -> None:
        self._enqueue(job, ADAM, claim=True)

    def _after_adam(self, job: HostJob) -> None:
        assert job._done is not None
        with self._lock:  # the H2D stage's worker never waits for a gate: a held job waits here, in no queue
            if job.skip_back:
                job._done.set_result(None)
            elif job._back_open:
                self._to_h2d(job)
            else:
                self._held.append(job)

    def _stage(
        self, pick: Callable[..., HostJob], stage: int, run: Callable[[StepPipeline, HostJob], None], *,
        then: Callable[[HostJob], None], claimed: bool = True,
    ) -> None:  # fmt: skip
        """Run one stage of the job ``pick(True)`` takes once the stage holds its lane (timed; in a host lane where the
        job that goes first, ``pick(False)``, needs one: CPU work; else that job), then ``then``; an error ends the
        job with it (its later stages do not run). ``then`` hands the job on while the stage still holds its lane,
        and the next stage's place in the lanes is claimed before that (``claimed``: it was), so no younger job's
        stage takes the lane in between ([Note: host lanes])."""
        job: HostJob | None = None
        try:
            name = STAGE_NAMES[stage]
            first = pick(False)
            lane = _on_cpu(stage, first)
            with self._lanes.held(stage, claimed=claimed) if lane else _NO_LANE:
                job = pick(True) if lane else pick(True, first)
                self._timed(name, functools.partial(run, self, job))
                then(job)
        except BaseException as error:  # noqa: BLE001 - handed to the job's future, raised by _finish
            assert job is not None and job._done is not None
            job._done.set_exception(error)


def _copy_out(pipeline: StepPipeline, job: HostJob) -> None:
    job.d2h()


def _adam(pipeline: StepPipeline, job: HostJob) -> None:
    job.adam(pipeline._scratch_for(job.scratch_numel))


def _copy_back(pipeline: StepPipeline, job: HostJob) -> None:
    job.h2d()


def _done(job: HostJob) -> None:
    assert job._done is not None
    job._done.set_result(None)


_STAGE_RUNS = (_copy_out, _adam, _copy_back)
_ADAM_THREADS = 2  # two Adams at once in a lent lane ([Note: host lanes])
_NO_LANE = contextlib.nullcontext()


def _on_cpu(stage: int, job: HostJob) -> bool:
    """Whether ``stage`` of ``job`` is CPU work (a copy on a simulated device, not an empty one; every Adam)."""
    if stage == ADAM:
        return True
    return job.copies_use_cpu and (stage == H2D or job.copies_out)


def _open(job: HostJob) -> None:
    """``job``'s copy back may run from now on (the calling thread, under the pipeline's lock where jobs are in
    flight)."""
    if job.opened is not None:
        job.opened()
    job._back_open = True
