"""Which schedule a host-side optimizer step runs, and the two that run past the backward's end or start inside it.

[Note: stepping inside the backward]
With the pipelined schedule a host-side family may step while the backward is still running: as soon as every
trainable parameter of the family has its final gradient of this backward (one rank: the family's gradients landed
together, [Note: gradients land per family]; several ranks: its reduced share was stored), the strategy's armed
optimizer submits the family's job to the step pipeline ([Note: the step pipeline] in runtime/pipeline.py). That is
exact only where nothing can read or change a gradient between the backward and ``optimizer.step()``, and nothing
needs all gradients first. The strategy proves the first part (Trainer, automatic optimization with one optimizer,
no gradient clipping configured, and none of ``on_after_backward``, ``on_before_optimizer_step``,
``configure_gradient_clipping``, ``optimizer_step`` or ``backward`` overridden in the LightningModule, nor the first
two in any callback); :meth:`StepOverlap.arm_in_backward` checks the engine's part (the warm-up is over, so its
checks before the first step have run; the micro-batch is the last of an accumulation; no clipping, no fp16 loss
scaling). Under a device budget the backward may need the room a stepping family's param chunk holds: that family's
job then ends without its copy back (its updated parameters stay in the host buffer, where a serial step leaves
them: ``StepPipeline.settle_off_device``). Fabric never arms it: user code runs between ``fabric.backward`` and
``optimizer.step``. A gradient that reaches a family whose step started (a parameter used in two reentrant
checkpointed segments) raises, naming the parameter, instead of being lost. A backward that raises after some
families started leaves those families stepped (their states cannot be rolled back); the run is failing then, and
nothing is saved from it by the engine. The jobs hold back their parameter copies to the device until the backward
is over, so autograd never reads a weight that changes under it; ``optimizer.step()`` starts the families that did
not step yet and returns once every job is finished. Every reader of weights, gradients or states outside the step
(zero_grad, state dicts, evaluation, a load, the report, teardown) finishes the jobs in flight first
(``ChunkManager.finish_steps``).

[Note: copies back inside the backward]
Holding every copy back until the backward ends leaves them all for its end: the step's tail is then every
family's H2D copy in a row (on this CPU, 8 copies of 2 ms after the last Adam), although most families are done
with long before. A family's copy back may run inside the backward (``StepPipeline.submit(back_now=True)``) once
nothing in this backward can read its param chunk any more, which the engine proves at the job's submission:

- every tensor autograd saved from a trainable parameter of the family (the parameter, a view of it, a weight used
  outside its module) has been dropped again: ``ChunkFamily.saved_params == dropped_params``, counted by the
  pack hook and by the saved objects' ``__del__`` (``runtime/hooks.py``). Autograd drops a node's saved tensors as
  soon as the node has run (no ``retain_graph``), and the node that reads a weight for its input's gradient is the
  node that computes the weight's gradient, so when the family's last gradient arrives the count is usually back
  to zero; a node that saved the weight but has not run (a use whose gradient flows elsewhere, a retained graph)
  keeps it above zero, and the copy back waits for the backward's end as before;
- no module computes again inside a backward (activation checkpointing recomputes its forward there): the first
  forward inside a backward turns this off for the run (``ChunkManager.recomputes``), and the warm-up's backward
  runs before any step inside one;
- one rank (several ranks exchange chunks during the backward).

A frozen parameter of the family may still be read (LoRA: a frozen weight of an earlier layer shares the chunk):
the copy back writes it with the bytes it already has. A module that needs a trainable parameter of such a family
later in the same backward (a pattern the proof above does not foresee) raises, naming the parameter, instead of
reading a weight that changed under it (``ChunkManager.pre_backward``, ``pre_forward``). What the engine cannot
see: a function checkpointed without reentrancy that calls no module (its saved tensors go to the checkpoint's
own hooks, its recomputation runs no module hook) and reads a trainable weight detached, so that the weight's
family can be done before that function's backward. Such a model needs ``optimizer_overlap="off"``.

[Note: gradient norms inside the backward]
Clipping by norm needs the global norm of every gradient before any family may step, so the step waits for the
backward's end ([Note: stepping inside the backward] does not hold). Where the gradients land on the host as the
backward goes (32-true with the optimizer states on the host: each family's GRAD chunk there), their norm is
host work that would otherwise run on the calling thread after the backward, on the step's critical path (on this
machine a pass over 4 bytes/param: 10 ms of a 140 ms step at 25 M parameters). So when the backward is the step's
last (no accumulation) and nothing but the engine's own clipping can touch the gradients before the step (the
caller, the strategy, proved it as for the step inside the backward, the clipping excepted), each family's
gradient norms are computed on a host lane of the step pipeline as soon as its final gradients have landed
(``StepPipeline.run_aside``), and the step's global norm takes them in the family order it always uses
(``ChunkedOptimizer._global_norm``). The same kernel runs on the same bytes (:func:`~lightning_pstar.optim.kernels.
grad_norms`, moved to the device afterwards as before), so the norm, the clipping factor and the step are bitwise
those of the serial step. Norms computed for a step that does not come are forgotten at the next backward, by
``zero_grad`` and when the step ends; gradients on the device (mixed precision) keep their norm at the step, on
the device, where it is not host work.

[Note: choosing the schedule]
Every schedule of the host-side step gives the same bits, so which one runs is a question of speed alone, and the
answer depends on the machine. On a GPU the pipeline hides host Adam and the transfers behind the device's compute.
Where the "device" shares the host's cores and memory bandwidth (the simulated device of a CPU machine, or a host
whose cores are busy with data loading), the pipeline's workers slow the very compute they overlap, and the serial
step can be the faster (docs/performance.md has this machine's figures); and leaving the tail in flight
(``"next_forward"``) pays only where the next forward's first modules do not need the families that step last. So
``optimizer_overlap="auto"`` measures instead of guessing: once the warm-up is over and ``SETTLE_STEPS`` more steps
have run pipelined (a short run never leaves them, so its figures are one schedule's), it runs its candidates in
pairs of steps, in turn: the pipeline, the serial step and, where the tail can be left in flight (one rank, no
compiled module), the pipeline with its tail in flight. It times the second step of each pair from the end of one
``optimizer.step()`` to the end of the next (forward, backward and step: a step inside the backward changes the
backward's time, a tail left in flight the next forward's), and after ``TRIALS`` timed steps of each keeps the
candidate with the lowest median for the rest of the run. Only the second step of a pair is timed because a step
pays for the one before it: after a serial step the param chunks are on the host (the update ran there) and the
next forward fetches them, while after a pipelined step they are on the device already, and a tail left in flight
is waited for by the next forward. A read of a parked weight outside the engine's hooks waits for its family
([Note: a read that waits] in runtime/parked.py), so the tail is as exact as the others wherever user code reads
weights on the training loop's thread. At several ranks the medians are max-reduced first, so every rank keeps the
same schedule. A step without host-side families (the hybrid plan put every family on the device) is not a trial:
nothing differs between the schedules there. The choice and the medians are in the memory report
(``optimizer_schedule``, ``schedule_trial_ms``).
"""

from __future__ import annotations

import functools
import logging
import statistics
from collections.abc import Sequence
from concurrent.futures import Future
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

import torch

import lightning_pstar.optim.kernels as kernels
from lightning_pstar.config import OptimizerOverlap
from lightning_pstar.optim.grads import family_grads
from lightning_pstar.optim.host_step import snapshot_groups
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.hooks import holds_compiled_code
from lightning_pstar.runtime.new_storage import moved
from lightning_pstar.runtime.parked import park, unpark
from lightning_pstar.runtime.state import Tier
from lightning_pstar.runtime.steps_in_flight import wait_for_families

if TYPE_CHECKING:
    from lightning_pstar.runtime.manager import ChunkManager
    from lightning_pstar.runtime.pipeline import HostJob


class _Stepper(Protocol):
    """What :class:`StepOverlap` reads of the optimizer it serves (``ChunkedOptimizer``; a protocol, so that this
    module does not import the optimizer that imports it)."""

    param_groups: list[dict[str, Any]]
    gradient_policy: Any
    _families: list[ChunkFamily]
    _own_ids: set[int]
    _book: Any

    def _host_job(self, family: ChunkFamily, coef: float) -> HostJob | None: ...


__all__ = ["PIPELINE", "SERIAL", "SETTLE_STEPS", "TAIL", "TRIALS", "ScheduleChooser", "StepOverlap"]

log = logging.getLogger(__name__)

PIPELINE = "pipeline"
SERIAL = "serial"
TAIL = "next_forward"  # the pipeline, its tail left in flight for the next forward
TRIALS = 5
SETTLE_STEPS = 8
"""Optimizer steps after the warm-up that ``optimizer_overlap="auto"`` runs pipelined before it times anything:
placement and allocators settle, and a short run (a smoke test, a unit test) keeps one schedule throughout, so its
per-iteration figures stay those of one schedule."""
"""Timed optimizer steps of each schedule that ``optimizer_overlap="auto"`` runs before it keeps one (each after an
untimed step of the same schedule)."""


class ScheduleChooser:
    """The schedule of the coming optimizer step ([Note: choosing the schedule]).

    ``mode``: the ``optimizer_overlap`` asked for; ``tail``: whether the step may leave its tail in flight
    (``"next_forward"``: one rank, no compiled module), a third candidate of ``"auto"``; ``agree``: max-reduces a
    list of medians over ranks (identity at one rank); ``clock``: seconds (tests pass their own)."""

    def __init__(
        self,
        mode: OptimizerOverlap,
        *,
        tail: bool = False,
        agree: Any = None,
        clock: Any = perf_counter,
        trials: int = TRIALS,
        settle: int = SETTLE_STEPS,
    ) -> None:
        self.mode = mode
        self._agree = agree if agree is not None else (lambda values: values)
        self._clock = clock
        self._trials = trials
        self._last: float | None = None  # the end of the last timed optimizer step
        self._settle = settle  # steps after the warm-up not timed (and pipelined): SETTLE_STEPS
        # the schedules "auto" times, in the order their pairs of steps run: P P S S [N N] P P ...
        self.candidates = [PIPELINE, SERIAL, *([TAIL] if tail else [])]
        self._times: dict[str, list[float]] = {name: [] for name in self.candidates}
        self._trial_steps = 0  # steps run in pairs of one schedule; the second of a pair is timed
        self.chosen: str | None = None
        if mode is OptimizerOverlap.OFF:
            self.chosen = SERIAL
        elif mode is OptimizerOverlap.NEXT_FORWARD:
            self.chosen = TAIL if tail else PIPELINE
        elif mode is not OptimizerOverlap.AUTO:
            self.chosen = PIPELINE

    @property
    def pipelined(self) -> bool:
        """Whether the coming optimizer step runs a pipelined schedule (with or without its tail in flight)."""
        return self.current != SERIAL

    @property
    def tail(self) -> bool:
        """Whether the coming optimizer step returns with its tail in flight (``"next_forward"``)."""
        return self.current == TAIL

    @property
    def current(self) -> str:
        if self.chosen is not None:
            return self.chosen
        return self.candidates[(self._trial_steps // 2) % len(self.candidates)]

    @property
    def trial_ms(self) -> dict[str, float]:
        """Median milliseconds per optimizer step of each schedule timed so far."""
        return {k: 1e3 * statistics.median(v) for k, v in self._times.items() if v}

    def step_done(self, *, measurable: bool) -> None:
        """An optimizer step just ended; ``measurable``: the warm-up is over and host-side families stepped."""
        if self.chosen is not None:
            return
        now = self._clock()
        last, self._last = self._last, now
        if not measurable or last is None:
            self._last = now if measurable else None
            return
        if self._settle > 0:
            self._settle -= 1
            return
        if self._trial_steps % 2 == 1:
            self._times[self.current].append(now - last)
        self._trial_steps += 1
        if min(len(v) for v in self._times.values()) >= self._trials:
            self._decide()

    def _decide(self) -> None:
        medians = self._agree([statistics.median(self._times[name]) for name in self.candidates])
        best = min(range(len(medians)), key=lambda i: medians[i])  # the first of equals: pipeline before the others
        self.chosen = self.candidates[best]
        log.debug(
            "PatrickStar: optimizer_overlap='auto' keeps the %s step (median ms per step: %s).",
            self.chosen,
            ", ".join(f"{name} {1e3 * m:.1f}" for name, m in zip(self.candidates, medians, strict=True)),
        )


class StepOverlap:
    """The parts of :class:`~lightning_pstar.optim.optimizer.ChunkedOptimizer`'s step that overlap something:
    the schedule chooser, the step inside the backward and the tail left in flight (``"next_forward"``)."""

    def __init__(self, optimizer: _Stepper, manager: ChunkManager) -> None:
        self._optimizer = optimizer
        self._manager = manager
        mode = manager.config.placement.optimizer_overlap
        comm = manager.comm

        def agree(values: list[float]) -> list[float]:
            if not comm.distributed:
                return values
            return comm.all_reduce_max_(torch.tensor(values, dtype=torch.float64)).tolist()

        # "next_forward", or a candidate of "auto": the step's last families go on stepping after step() returns
        tail = mode in (OptimizerOverlap.NEXT_FORWARD, OptimizerOverlap.AUTO) and _tail_possible(manager, mode)
        self.schedule = ScheduleChooser(mode, tail=tail, agree=agree)
        self._groups: list[dict[str, Any]] | None = None  # the snapshot jobs of the coming step share
        self._norms: dict[int, Future[torch.Tensor]] = {}  # family id -> its gradient norms, computed in the backward

    # ---- the hyper-parameters the jobs of one step read ------------------------------------------------------
    def groups(self) -> list[dict[str, Any]]:
        """A snapshot of the optimizer's param groups, taken once per step (nothing changes them between the
        backward that starts a step's jobs and the step itself: [Note: stepping inside the backward])."""
        if self._groups is None:
            self._groups = snapshot_groups(self._optimizer.param_groups)
        return self._groups

    def step_ended(self) -> None:
        """``optimizer.step()`` is over (applied or skipped): time it for the chooser, forget the snapshot."""
        self._groups = None
        self.forget_norms()
        manager, schedule = self._manager, self.schedule
        if schedule.chosen is None:  # "auto" still timing: nothing per step once a schedule is kept
            measurable = manager.tracer.warmed_up and not manager.tracer.recording
            if measurable:
                residency = manager.residency
                off_device = (Tier.HOST, Tier.DISK)
                measurable = any(residency.optimizer_tier_of(f) in off_device for f in self._optimizer._families)
            schedule.step_done(measurable=measurable)
        manager.pipeline.schedule, manager.pipeline.trial_ms = schedule.chosen, schedule.trial_ms
        manager.pipeline.pipelined_next = schedule.pipelined

    # ---- the step inside the backward ------------------------------------------------------------------------
    def arm_in_backward(self) -> bool:
        """Let the coming backward start the step of each host-side family of this optimizer as soon as its
        final gradients have all landed, where the engine's part of [Note: stepping inside the backward] holds
        (the caller, the strategy, proved the rest). Returns whether it is armed; ``optimizer.step()`` (or
        anything that reads weights, gradients or states first) finishes what it started."""
        self.forget_norms()
        optimizer, manager = self._optimizer, self._manager
        policy = optimizer.gradient_policy
        if not self.schedule.pipelined or manager.tracer.recording or not manager.tracer.warmed_up:
            return False
        if manager.grads.accumulating or policy.check_finite or policy.clip_norm is not None:
            return False
        if policy.clip_value is not None or policy.inv_scale != 1.0 or not optimizer._book.is_adam:
            return False
        if not any(manager.residency.optimizer_tier_of(f) is Tier.HOST for f in optimizer._families):
            return False
        self._groups = None  # a fresh snapshot: a scheduler stepped since the last step
        manager.pipeline.hold_copies_back()
        manager.grads.on_final = self._start_in_backward
        return True

    def _start_in_backward(self, family: ChunkFamily) -> bool:
        """A family's final gradients all landed during the backward: start its host step if it is ours."""
        optimizer = self._optimizer
        if family.family_id not in optimizer._own_ids or not family.trainable or family.recomputed_after_grad:
            return False  # the last: a second gradient may follow ([Note: a forward after the gradient])
        if any(moved(r) for r in family.records):
            return False  # user code gave a weight new storage: the step adopts it first ([Note: parameters given ...])
        if self._manager.residency.optimizer_tier_of(family) is Tier.DISK:
            return False  # a disk family steps at optimizer.step(), when its buffer sets can rotate
        job = optimizer._host_job(family, 1.0)
        if job is None:
            return False
        manager = self._manager
        back_now = (  # [Note: copies back inside the backward]
            family.saved_params == family.dropped_params and not manager.recomputes and not manager.sharding.distributed
        )
        manager.pipeline.submit(job, back_now=back_now)
        manager.pipeline.times.in_backward += 1
        return True

    # ---- gradient norms inside the backward ([Note: gradient norms inside the backward]) ---------------------
    def arm_norms_in_backward(self) -> bool:
        """Let the coming backward compute the gradient norms of each host-side family of this optimizer on a host
        lane as soon as its final gradients have landed on the host (the caller proved that nothing but the
        engine's clipping touches them before the step). Returns whether it is armed."""
        self.forget_norms()
        optimizer, manager = self._optimizer, self._manager
        if not self.schedule.pipelined or manager.tracer.recording or not manager.tracer.warmed_up:
            return False
        if manager.grads.accumulating or manager.mixed or optimizer.gradient_policy.inv_scale != 1.0:
            return False
        if not any(manager.residency.optimizer_tier_of(f) is Tier.HOST for f in optimizer._families):
            return False
        manager.grads.on_final = self._norm_in_backward
        return True

    def _norm_in_backward(self, family: ChunkFamily) -> bool:
        """A family's final gradients all landed during the backward: start their norms if they are on the host."""
        manager = self._manager
        if family.family_id not in self._optimizer._own_ids or not family.trainable or family.recomputed_after_grad:
            return False
        grad_chunk = family.chunks.get(ChunkKind.GRAD)
        if grad_chunk is None or grad_chunk.tier is not Tier.HOST:
            return False
        if manager.residency.optimizer_tier_of(family) is not Tier.HOST:
            return False  # a disk family's GRAD chunk may move while the backward goes on
        grads = family_grads(family, self._optimizer._book.group_of, mixed=False, inv_scale=1.0)
        if grads:
            task = functools.partial(kernels.grad_norms, list(grads.values()))
            self._norms[family.family_id] = manager.pipeline.run_aside(task)
        return False  # it does not step here

    def norms_of(self, family: ChunkFamily) -> torch.Tensor | None:
        """The 2-norms of ``family``'s gradients computed during the backward (stacked on the host, in record
        order), or None where they were not: the step computes them then."""
        future = self._norms.pop(family.family_id, None)
        if future is None:
            return None
        norms = future.result()  # read to its end even when unused: the gradients change only after it
        if family.recomputed_after_grad:  # a second gradient landed after these norms ([Note: a forward after ...])
            return None
        self._manager.pipeline.times.norms_in_backward += 1
        return norms

    def forget_norms(self) -> None:
        """Drop the norms computed during a backward (they are read by the step that follows it, or by none)."""
        norms, self._norms = self._norms, {}
        for future in norms.values():
            future.exception()  # waits: its read of the gradients ends before anything changes them

    # ---- the tail left in flight ("next_forward") ------------------------------------------------------------
    def leave_in_flight(self) -> None:
        """The tail schedule (``"next_forward"``): return while jobs are in flight. Their parameters are parked until
        the job is done ([Note: parked parameters] in ``runtime/parked.py``: a read outside the engine's hooks on the
        training loop's thread finishes the job first, elsewhere it fails loudly; never a half-updated weight); each
        job then points them back at their slots and forgets its family's gradients, as ``zero_grad`` does for the
        families already done."""
        manager = self._manager
        manager.grads.on_final = None
        manager.grads.stepped.clear()
        own = self._optimizer._book.group_of
        for fid in manager.pipeline.family_ids:
            job = manager.pipeline.job(fid)
            assert job is not None
            family = manager.families[fid]
            params = [record.param for record in family.records]
            park(
                params,
                [record.names[0] for record in family.records],
                wait=functools.partial(wait_for_families, manager, family.records),
            )
            job.before.append(functools.partial(_unpark_all, params))
            ours = [r for r in family.records if r.index in own]
            job.after.append(functools.partial(_settle_in_flight, manager, family, ours))
        tracer = manager.tracer
        if tracer.warmed_up and tracer.matches:  # the next forward's first families step first ([Note: host lanes])
            ranks = {fid: tracer.trace.next_use(fid, tracer.cursor) for fid in manager.pipeline.family_ids}
            manager.pipeline.prefer(ranks)
        manager.tailing = manager.pipeline.busy


def _tail_possible(manager: ChunkManager, mode: OptimizerOverlap) -> bool:
    """Whether the step may leave its tail in flight: one rank (several ranks gather owned chunks as send buffers
    at any point of the next forward) and no compiled module (dynamo guards on the parameters at the call, before a
    module's hook can wait). Elsewhere ``"next_forward"`` runs as "pipeline", said once here, and ``"auto"`` does
    not time it."""
    why = ""
    if manager.sharding.distributed:
        why = "several ranks"
    elif holds_compiled_code(manager.module):
        why = "a compiled module"
    if why and mode is OptimizerOverlap.NEXT_FORWARD:
        log.warning("PatrickStar: optimizer_overlap='next_forward' runs as 'pipeline' with %s.", why)
    return not why


def _settle_in_flight(manager: ChunkManager, family: ChunkFamily, records: list[ParamRecord]) -> None:
    """A job left in flight by ``step()`` is done: its parameters point at their slots again and its gradients are
    forgotten (what ``zero_grad`` did for the other families)."""
    for record in family.records:
        manager.residency.point_at_chunk(record)
    manager.grads.discard(records)


def _unpark_all(params: Sequence[torch.Tensor]) -> None:
    for param in params:
        unpark(param)
