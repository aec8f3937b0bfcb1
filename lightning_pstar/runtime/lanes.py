"""How many of the step pipeline's stages run CPU work at once, and which goes first ([Note: host lanes]).

The step pipeline (``runtime/pipeline.py``) runs each stage of a family's host step on a worker thread; this module
is the gate those workers pass before CPU work, so that the pipeline never slows the compute it overlaps.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Generator
from contextlib import contextmanager

import torch

__all__ = ["ADAM", "D2H", "H2D", "STAGE_NAMES", "Lanes", "host_lanes"]


# [Note: host lanes]
# The three stages are three threads, but only as many of them run CPU work at once as the machine has cores the
# compute does not use: a stage that would oversubscribe the cores slows the compute thread it is meant to
# overlap (measured on a 2-core machine: the backward took 105 ms instead of 55 with steps inside it, as D2H and
# Adam ran beside it at once). Host Adam is always CPU work; a copy is CPU work on a simulated device (a memcpy)
# and a DMA engine's on CUDA, where its worker only waits. ``host_lanes`` counts the cores left after torch's
# intra-op threads (the compute's), at least one.
#
# A free lane goes to a waiting stage of the latest kind (:class:`Lanes`: H2D, then Adam, then D2H), claimed when
# the job is handed over: with one lane, the Adam stage would otherwise take it for job after job while job k's copy
# back waits behind all of them (measured: a forward that needs the first family waited for every family's Adam),
# although job k is the one the compute needs first. One exception feeds the Adams: a copy out goes before an Adam
# while fewer jobs wait for an Adam than there are lanes (the lent one counted), since a job whose gradients were not
# copied out cannot start its Adam when a lane frees. With one lane that is the order above; with a lent lane, at the
# end of a backward that handed over the first layers' jobs at once, the Adam latest in line used to take the lent
# lane while the next copies out waited behind two Adams, and the lane that freed next had no Adam to run (traced:
# one Adam at a time in the step's tail, the other lane on 1 ms copies and idle between them).
#
# While the calling thread waits for a job (``optimizer.step()`` finishing the jobs it submitted, a module waiting
# for its family), its core is idle: it lends one more lane for the wait (:meth:`Lanes.lent`), and the Adam stage
# has two worker threads, so that two families' Adams, or an Adam and a copy, run at once there. A stage started
# in the lent lane runs to its end after the wait; no other stage starts until a lane is free again. Lent only with
# one intra-op thread: each stage is then one core, as the waiting thread's compute was; with more, every stage's
# kernels already use the whole intra-op pool and a second stage at once would oversubscribe it.
#
# Which job an Adam worker runs is chosen when it gets its lane, not when a job was handed over
# (``StepPipeline._run_adam``): first a job a caller waits for now, then the job whose family the coming iteration
# uses first (``StepPipeline.prefer``: the trace's next use, which a step that returns with jobs in flight sets),
# then the oldest. Jobs a backward starts are handed over in the order their gradients become final, the last
# layers first, while the next forward needs the first layers first: in hand-over order that forward would wait for
# every job left, its first module for the last job. The order of family steps changes no bit: each family has its
# own slots, states and step counts ([Note: the step pipeline]).
def host_lanes() -> int:
    """How many of the pipeline's CPU stages may run at once ([Note: host lanes])."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - torch.get_num_threads())


D2H, ADAM, H2D = 0, 1, 2  # the stages, in the order a job runs them (a later one takes a free lane first)
STAGE_NAMES = ("d2h", "adam", "h2d")


class Lanes:
    """At most ``count`` CPU stages at once; a freed lane goes to a waiting stage of the latest kind (H2D, then
    Adam, then D2H: the stage that finishes a job first), but to a D2H while fewer jobs wait for an Adam than there
    are lanes ([Note: host lanes]). Each stage is one worker thread."""

    def __init__(self, count: int, *, adam_threads: int = 2) -> None:
        self._count = count
        self._adam_threads = adam_threads  # the Adam stage's worker threads (``StepPipeline``'s)
        self._running = [0, 0, 0]  # per stage: holding a lane now
        self._free = count
        self._lent = 0  # lanes lent by waiting callers now
        self.lent_runs = 0  # stages that started beyond ``count`` (in a lent lane)
        self._claims = [0, 0, 0]  # per stage: handed to its worker (or waiting there) and not running yet
        self._changed = threading.Condition()

    def claim(self, stage: int) -> None:
        """A job was handed to ``stage``'s worker: earlier stages leave it the next free lane (:meth:`held` with
        ``claimed=True`` takes it)."""
        with self._changed:
            self._claims[stage] += 1
            self._changed.notify_all()  # one more job waiting for an Adam may let an Adam go (``_behind``)

    def unclaim(self, stage: int) -> None:
        """A claim whose hand-off failed (the worker refused the job: the interpreter is shutting down): the
        earlier stages must not wait for a stage that never comes."""
        with self._changed:
            self._claims[stage] -= 1
            self._changed.notify_all()

    @contextmanager
    def lent(self) -> Generator[None, None, None]:
        """One more lane while the calling thread waits for the pipeline (its core is idle meanwhile)."""
        with self._changed:
            self._free += 1
            self._lent += 1
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._free -= 1  # a stage running in the lent lane ends first; no new one starts until then
                self._lent -= 1
                self._changed.notify_all()  # one lane fewer may let an Adam go before a copy out (``_behind``)

    @contextmanager
    def held(self, stage: int, *, claimed: bool) -> Generator[None, None, None]:
        with self._changed:
            if not claimed:
                self._claims[stage] += 1
            while self._free <= 0 or self._behind(stage):
                self._changed.wait()
            self._claims[stage] -= 1
            self._free -= 1
            self._running[stage] += 1
            if self._count + self._lent - self._free > self._count:
                self.lent_runs += 1
            # a claim fewer may let another stage go in a lane still free (``_behind`` reads the claims): every
            # change a waiting stage's condition reads wakes the waiters, or one could sleep beside a free lane
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._free += 1
                self._running[stage] -= 1
                self._changed.notify_all()

    def _behind(self, stage: int) -> bool:
        """Whether a claimed stage goes before ``stage`` for the next free lane (under the lock): H2D first; then
        D2H while fewer jobs wait for an Adam than there are lanes (each lane may run an Adam as soon as it is free:
        a job whose gradients were not copied out yet cannot), else Adam ([Note: host lanes])."""
        claims = self._claims
        if stage == H2D:
            return False
        if claims[H2D]:
            return True
        adams_fed = claims[ADAM] >= self._count + self._lent
        if stage == ADAM:
            return claims[D2H] > 0 and not adams_fed
        adam_waits = claims[ADAM] > 0 and self._running[ADAM] < self._adam_threads  # a thread to take the lane
        return adam_waits and adams_fed
