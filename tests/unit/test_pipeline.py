"""The step pipeline's mechanics ([Note: the step pipeline] in ``runtime/pipeline.py``) with plain stage functions:
stage order within a job, bookkeeping on the calling thread only, held copies back, errors."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
import torch

from lightning_pstar.runtime.pipeline import HostJob, StepPipeline


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[int, str, str]] = []  # (family, stage, thread name)
        self.lock = threading.Lock()

    def stage(self, fid: int, name: str, fail: bool = False) -> Any:
        def run(*args: Any) -> None:
            with self.lock:
                self.events.append((fid, name, threading.current_thread().name))
            if fail:
                raise OSError(f"stage {name} of family {fid} failed")

        return run

    def job(self, fid: int, *, fail: str = "") -> HostJob:
        return HostJob(
            family_id=fid,
            d2h=self.stage(fid, "d2h", fail == "d2h"),
            adam=self.stage(fid, "adam", fail == "adam"),
            h2d=self.stage(fid, "h2d", fail == "h2d"),
            finish=lambda copied_back, fid=fid: self.events.append(  # type: ignore[misc]
                (fid, f"finish({copied_back})", threading.current_thread().name)
            ),
            scratch_numel=8,
        )

    def stages_of(self, fid: int) -> list[str]:
        return [name for f, name, _ in self.events if f == fid]


def test_each_job_runs_its_stages_in_order_on_the_workers_and_finishes_here() -> None:
    log, pipeline = Log(), StepPipeline()
    for fid in range(4):
        pipeline.submit(log.job(fid))
    assert pipeline.busy and pipeline.family_ids == [0, 1, 2, 3]
    pipeline.drain()
    me = threading.current_thread().name
    for fid in range(4):
        assert log.stages_of(fid) == ["d2h", "adam", "h2d", "finish(True)"]
    for _, name, thread in log.events:
        assert (thread == me) == name.startswith("finish"), (name, thread)
    assert not pipeline.busy and pipeline.times.jobs == 4
    pipeline.close()


def test_copies_back_wait_until_the_backward_is_over() -> None:
    log, pipeline = Log(), StepPipeline()
    pipeline.hold_copies_back()
    pipeline.submit(log.job(0))
    done = threading.Event()
    threading.Thread(target=lambda: (pipeline._jobs[0]._done.result(), done.set())).start()  # type: ignore[union-attr]
    assert not done.wait(0.3)  # d2h and adam ran, the copy back waits for the gate
    assert log.stages_of(0) == ["d2h", "adam"]
    pipeline.open_copies_back()
    assert done.wait(10)
    pipeline.drain()
    assert log.stages_of(0) == ["d2h", "adam", "h2d", "finish(True)"]
    pipeline.close()


def test_a_copy_back_is_opened_once_on_the_calling_thread_before_it_runs() -> None:
    """``HostJob.opened`` (CUDA: the event the copy back waits for, recorded on the compute stream) is called on the
    calling thread, once, before the H2D stage: at submission where copies back are open or ``back_now``, else when
    the backward ends (``open_copies_back``) or a reader needs the family (``wait``)."""
    log, pipeline = Log(), StepPipeline()
    me = threading.current_thread().name

    def job(fid: int) -> HostJob:
        made = log.job(fid)
        made.opened = lambda: log.events.append((fid, "opened", threading.current_thread().name))
        return made

    pipeline.submit(job(0))  # copies back open: opened at submission
    pipeline.hold_copies_back()
    pipeline.submit(job(1), back_now=True)  # proved safe inside the backward: opened at submission
    pipeline.submit(job(2))  # held: opened by the reader's wait
    pipeline.submit(job(3))  # held: opened at the backward's end
    pipeline.wait(0)
    pipeline.wait(1)
    assert "h2d" not in log.stages_of(2) and "opened" not in log.stages_of(2)
    pipeline.wait(2)
    assert "opened" not in log.stages_of(3)
    pipeline.open_copies_back()
    pipeline.drain()
    for fid in range(4):
        stages = log.stages_of(fid)
        assert stages.count("opened") == 1 and stages.index("opened") < stages.index("h2d"), (fid, stages)
    assert all(thread == me for _, name, thread in log.events if name == "opened")
    assert [f for f, name, _ in log.events if name == "opened"][:2] == [0, 1]
    pipeline.close()


def test_settling_off_the_device_skips_the_copy_back() -> None:
    log, pipeline = Log(), StepPipeline()
    pipeline.hold_copies_back()
    pipeline.submit(log.job(0))
    pipeline.settle_off_device([0])
    assert log.stages_of(0) == ["d2h", "adam", "finish(False)"]
    pipeline.close()


@pytest.mark.parametrize("stage", ["d2h", "adam", "h2d"])
def test_a_failing_stage_ends_its_job_and_the_others_finish(stage: str) -> None:
    log, pipeline = Log(), StepPipeline()
    pipeline.submit(log.job(0))
    pipeline.submit(log.job(1, fail=stage))
    pipeline.submit(log.job(2))
    with pytest.raises(OSError, match=f"stage {stage} of family 1 failed"):
        pipeline.drain()
    order = ["d2h", "adam", "h2d"]
    assert log.stages_of(1) == order[: order.index(stage) + 1]  # no later stage, no finish
    for fid in (0, 2):
        assert log.stages_of(fid) == [*order, "finish(True)"]
    assert not pipeline.busy
    pipeline.close()


def test_scratch_is_fp32_and_grows() -> None:
    pipeline = StepPipeline()
    small = pipeline._scratch_for(4)
    big = pipeline._scratch_for(16)
    assert small.dtype == big.dtype == torch.float32 and big.numel() == 16
    assert pipeline._scratch_for(8).data_ptr() == big.data_ptr()  # never shrunk, reused
    pipeline.close()


def test_one_family_settles_or_finishes_while_earlier_copies_back_are_held() -> None:
    """A budgeted backward needs the room of one stepping family (settled off the device), or a reader needs one
    family's weights, while the copies back of families submitted before it are still held: neither waits for
    them (a held job waits in no worker's queue)."""
    log, pipeline = Log(), StepPipeline()
    pipeline.hold_copies_back()
    for fid in range(4):
        pipeline.submit(log.job(fid))
    finished = threading.Event()

    def settle_and_wait() -> None:
        pipeline.settle_off_device([2])
        pipeline.wait(3)
        finished.set()

    threading.Thread(target=settle_and_wait, daemon=True).start()
    assert finished.wait(10), "settling family 2 or finishing family 3 waited for the held families 0 and 1"
    assert log.stages_of(2) == ["d2h", "adam", "finish(False)"]
    assert log.stages_of(3) == ["d2h", "adam", "h2d", "finish(True)"]
    assert pipeline.family_ids == [0, 1] and log.stages_of(0) == ["d2h", "adam"]
    pipeline.drain()
    for fid in (0, 1):
        assert log.stages_of(fid) == ["d2h", "adam", "h2d", "finish(True)"]
    pipeline.close()


def test_host_lanes_leave_the_compute_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: host lanes]: the cores torch's intra-op threads do not use, at least one."""
    from lightning_pstar.runtime import lanes as module

    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(module.torch, "get_num_threads", lambda: 6)
    assert module.host_lanes() == 2
    monkeypatch.setattr(module.torch, "get_num_threads", lambda: 8)
    assert module.host_lanes() == 1


@pytest.mark.parametrize("intra_op", [1, 2])
def test_cpu_stages_never_run_beyond_the_lanes(monkeypatch: pytest.MonkeyPatch, intra_op: int) -> None:
    """With one lane, the D2H, Adam and H2D stages of different jobs never run CPU work at the same time, but one
    more lane while the calling thread waits for them with one intra-op thread ([Note: host lanes]: its core is
    idle then); the Adam stage's two threads use it, so two Adams run at once."""
    from lightning_pstar.runtime import pipeline as module

    monkeypatch.setattr(module, "host_lanes", lambda: 1)
    monkeypatch.setattr(module.torch, "get_num_threads", lambda: intra_op)
    pipeline = StepPipeline()
    running: list[str] = []
    most, adams_at_once = [0], [0]
    lock = threading.Lock()

    def stage(name: str) -> Any:
        def work(*args: Any) -> None:
            with lock:
                running.append(name)
                most[0] = max(most[0], len(running))
                adams_at_once[0] = max(adams_at_once[0], running.count("adam"))
            threading.Event().wait(0.02 if name == "adam" else 0.005)
            with lock:
                running.remove(name)

        return work

    for fid in range(6):
        pipeline.submit(
            HostJob(
                family_id=fid, d2h=stage("d2h"), adam=stage("adam"), h2d=stage("h2d"), finish=lambda _: None,
                scratch_numel=1,
            )
        )  # fmt: skip
    pipeline.drain()
    pipeline.close()
    assert most[0] == (2 if intra_op == 1 else 1)
    assert adams_at_once[0] == (2 if intra_op == 1 else 1)


def test_one_lane_finishes_the_oldest_job_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: host lanes]: with one lane and every job submitted at once, a freed lane goes to the stage that
    finishes a job (H2D, then Adam, then D2H), so jobs complete one after the other instead of every Adam first
    (a forward waiting for the first family would wait for all of them)."""
    from lightning_pstar.runtime import pipeline as module

    monkeypatch.setattr(module, "host_lanes", lambda: 1)
    monkeypatch.setattr(module.torch, "get_num_threads", lambda: 2)  # the waiting thread lends no lane
    pipeline = StepPipeline()
    order: list[tuple[str, int]] = []

    def stage(name: str, fid: int) -> Any:
        def run(*args: Any) -> None:
            order.append((name, fid))
            threading.Event().wait(0.005)

        return run

    for fid in range(4):
        pipeline.submit(
            HostJob(
                family_id=fid, d2h=stage("d2h", fid), adam=stage("adam", fid), h2d=stage("h2d", fid),
                finish=lambda _: None, scratch_numel=1,
            )
        )  # fmt: skip
    pipeline.drain()
    pipeline.close()
    assert order == [(name, fid) for fid in range(4) for name in ("d2h", "adam", "h2d")]


def _gated_jobs(gate: threading.Event, order: list[tuple[str, int]], count: int) -> list[HostJob]:
    """Jobs whose stages log themselves; job 0's copy out waits for ``gate``, so the others queue behind it."""

    def stage(name: str, fid: int) -> Any:
        def run(*args: Any) -> None:
            if (name, fid) == ("d2h", 0):
                assert gate.wait(10)
            order.append((name, fid))

        return run

    return [
        HostJob(
            family_id=fid, d2h=stage("d2h", fid), adam=stage("adam", fid), h2d=stage("h2d", fid),
            finish=lambda _: None, scratch_numel=1,
        )
        for fid in range(count)
    ]  # fmt: skip


def test_queued_jobs_run_in_the_order_of_the_coming_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: host lanes]: jobs a backward handed over last-layer first run in the order ``prefer`` gives (the next
    forward's), not in hand-over order, at each stage that picks its job when it gets a lane (one lane: with two,
    two Adams run at once and the order they start in is the threads')."""
    from lightning_pstar.runtime import pipeline as module

    monkeypatch.setattr(module, "host_lanes", lambda: 1)
    monkeypatch.setattr(module.torch, "get_num_threads", lambda: 2)  # the waiting thread lends no lane
    pipeline, gate, order = StepPipeline(), threading.Event(), []
    for job in _gated_jobs(gate, order, 5):
        pipeline.submit(job)
    pipeline.prefer({0: 0, 4: 1, 3: 2, 2: 3, 1: 4})  # job 0 first: its copy out has begun
    gate.set()
    pipeline.drain()
    pipeline.close()
    adams = [fid for name, fid in order if name == "adam"]
    # the others waited behind job 0 in the one D2H worker, which then took them by rank
    assert adams == [0, 4, 3, 2, 1]


def test_a_job_a_caller_waits_for_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: host lanes]: ``wait`` puts its family's job before every ranked one (a module needs it now)."""
    from lightning_pstar.runtime import pipeline as module

    monkeypatch.setattr(module, "host_lanes", lambda: 1)
    monkeypatch.setattr(module.torch, "get_num_threads", lambda: 2)
    pipeline, gate, order = StepPipeline(), threading.Event(), []
    for job in _gated_jobs(gate, order, 4):
        pipeline.submit(job)
    pipeline.prefer({1: 0, 2: 1, 3: 2})
    threading.Timer(0.05, gate.set).start()
    pipeline.wait(3)  # marks family 3 urgent at once, then waits for it
    assert [fid for name, fid in order if name == "adam"][:2] == [0, 3]
    pipeline.drain()
    pipeline.close()
    assert [fid for name, fid in order if name == "adam"] == [0, 3, 1, 2]


def test_an_empty_copy_out_takes_no_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose host copy is current (``copies_out=False``) passes its D2H stage while another job's Adam holds
    the only lane ([Note: host lanes]: an empty stage is no CPU work)."""
    from lightning_pstar.runtime import pipeline as module

    monkeypatch.setattr(module, "host_lanes", lambda: 1)
    monkeypatch.setattr(module.torch, "get_num_threads", lambda: 2)
    pipeline, gate, passed = StepPipeline(), threading.Event(), threading.Event()
    pipeline.submit(
        HostJob(
            family_id=0, d2h=lambda: None, adam=lambda _: gate.wait(10), h2d=lambda: None, finish=lambda _: None,
            scratch_numel=1,
        )
    )  # fmt: skip
    pipeline.submit(
        HostJob(
            family_id=1, d2h=passed.set, adam=lambda _: None, h2d=lambda: None, finish=lambda _: None,
            scratch_numel=1, copies_out=False,
        )
    )  # fmt: skip
    try:
        assert passed.wait(5), "the empty copy out waited for the lane job 0's Adam holds"
    finally:
        gate.set()
        pipeline.drain()
        pipeline.close()


@pytest.mark.parametrize("lent", [False, True])
def test_a_freed_lane_feeds_the_adams_before_running_one(lent: bool) -> None:
    """[Note: host lanes]: a freed lane goes to a waiting copy out before a waiting Adam while fewer jobs wait for an
    Adam than there are lanes (so that the next lane to free has an Adam to run); with one lane and no lent one, to
    the Adam (the job nearer its end), as before."""
    from lightning_pstar.runtime.lanes import ADAM, D2H, Lanes

    lanes = Lanes(1)
    entered: list[str] = []
    release = [threading.Event() for _ in range(2)]
    started = [threading.Event() for _ in range(2)]

    def holder(i: int) -> None:
        with lanes.held(ADAM, claimed=False):
            started[i].set()
            release[i].wait(10)

    done = threading.Event()

    def waiter(stage: int, name: str, claimed: bool) -> None:
        with lanes.held(stage, claimed=claimed):
            entered.append(name)
            done.wait(10)

    with lanes.lent() if lent else contextlib.nullcontext():
        holders = [threading.Thread(target=holder, args=(i,)) for i in range(2 if lent else 1)]
        for i, thread in enumerate(holders):
            thread.start()
            assert started[i].wait(5)
        lanes.claim(ADAM)  # one job waits for an Adam (handed over by its copy out)
        waiters = [
            threading.Thread(target=waiter, args=(ADAM, "adam", True)),
            threading.Thread(target=waiter, args=(D2H, "d2h", False)),
        ]
        for thread in waiters:
            thread.start()
        deadline = time.monotonic() + 5
        while lanes._claims[D2H] == 0 and time.monotonic() < deadline:  # the copy out waits for a lane now
            time.sleep(0.001)
        release[0].set()  # one lane frees: exactly one waiter may take it
        holders[0].join(5)
        deadline = time.monotonic() + 5
        while not entered and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)
        first = list(entered)
        done.set()
        release[1].set()
        for thread in [*holders, *waiters]:
            thread.join(5)
    assert first == (["d2h"] if lent else ["adam"])
    assert sorted(entered) == ["adam", "d2h"]


def test_lanes_never_leave_a_waiting_stage_beside_a_free_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: host lanes]: which stage takes a free lane reads the claims and how many lanes are lent, so every change
    of those wakes the waiting stages. Rounds of jobs and reads run aside, drained by a caller that lends a lane (one
    intra-op thread) and by one that does not (a read aside is waited for without lending), with stage times that
    vary, all end (before, a copy out aside and an Adam each waited for the other once the lent lane was taken back)."""
    import random

    from lightning_pstar.runtime import pipeline as module

    monkeypatch.setattr(module, "host_lanes", lambda: 1)
    monkeypatch.setattr(module.torch, "get_num_threads", lambda: 1)
    rng = random.Random(0)
    pipeline = StepPipeline()

    def pause(seconds: float) -> Any:
        return lambda *args: threading.Event().wait(seconds)

    def rounds() -> None:
        for _ in range(150):
            count = rng.randint(1, 5)
            for fid in range(count):
                pipeline.submit(
                    HostJob(
                        family_id=fid, d2h=pause(rng.random() * 0.002), adam=pause(rng.random() * 0.004),
                        h2d=pause(rng.random() * 0.002), finish=lambda _: None, scratch_numel=1,
                    )
                )  # fmt: skip
                if rng.random() < 0.5:
                    pipeline.run_aside(pause(rng.random() * 0.002))
            pipeline.wait(rng.randrange(count))  # lends a lane, then takes it back with jobs in flight
            if rng.random() < 0.5:
                pipeline.run_aside(pause(rng.random() * 0.002))
            pipeline.drain()  # waits for the reads aside first, lending nothing

    runner = threading.Thread(target=rounds, daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "the pipeline's stages stopped with lanes free"
    pipeline.close()
