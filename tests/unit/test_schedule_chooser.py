"""``optimizer_overlap``'s schedule chooser ([Note: choosing the schedule] in ``optim/overlap.py``) on a fake clock."""

from __future__ import annotations

import pytest

from lightning_pstar.config import OptimizerOverlap
from lightning_pstar.optim.overlap import PIPELINE, SERIAL, SETTLE_STEPS, TAIL, TRIALS, ScheduleChooser


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(chooser: ScheduleChooser, clock: Clock, cost: dict[str, float], steps: int) -> list[str]:
    """``steps`` optimizer steps, each taking ``cost`` seconds of the schedule it ran; returns the schedules."""
    ran = []
    for _ in range(steps):
        schedule = chooser.current
        ran.append(schedule)
        clock.now += cost[schedule]
        chooser.step_done(measurable=True)
    return ran


@pytest.mark.parametrize(("pipe", "serial", "kept"), [(0.05, 0.08, PIPELINE), (0.09, 0.06, SERIAL)])
def test_auto_times_both_alternating_then_keeps_the_faster(pipe: float, serial: float, kept: str) -> None:
    clock = Clock()
    chooser = ScheduleChooser(OptimizerOverlap.AUTO, clock=clock, trials=3, settle=1)
    ran = _run(chooser, clock, {PIPELINE: pipe, SERIAL: serial}, 2 + 12 + 3)
    # the first step only starts the clock, the second settles; then pairs P P S S ..., then the kept one
    assert ran == [PIPELINE] * 2 + [PIPELINE, PIPELINE, SERIAL, SERIAL] * 3 + [kept] * 3
    assert chooser.chosen == kept and chooser.pipelined is (kept == PIPELINE)
    assert chooser.trial_ms == pytest.approx({PIPELINE: 1e3 * pipe, SERIAL: 1e3 * serial})


def test_a_step_that_is_not_measurable_restarts_the_clock() -> None:
    """Warm-up steps, and steps without host-side families, are not trials, nor is the cycle that follows them."""
    clock = Clock()
    chooser = ScheduleChooser(OptimizerOverlap.AUTO, clock=clock, trials=1, settle=1)
    clock.now += 10.0
    chooser.step_done(measurable=False)  # the warm-up: a long step, never timed
    for _ in range(2):
        clock.now += 1.0
        chooser.step_done(measurable=True)  # starts the clock, then settles
    assert chooser.trial_ms == {}
    for cost in (0.9, 0.5):  # the pipeline's pair: the second is timed
        clock.now += cost
        chooser.step_done(measurable=True)
    clock.now += 7.0
    chooser.step_done(measurable=False)  # not a trial, and the next cycle starts the clock again
    assert chooser.chosen is None and chooser.current == SERIAL
    clock.now += 0.25
    chooser.step_done(measurable=True)  # starts the clock
    for cost in (0.75, 0.25):  # the serial pair
        clock.now += cost
        chooser.step_done(measurable=True)
    assert chooser.trial_ms == {PIPELINE: 500.0, SERIAL: 250.0} and chooser.chosen == SERIAL


def test_ranks_agree_on_the_slowest_rank_s_medians() -> None:
    """The medians are reduced (max over ranks) before the choice: this rank found the pipeline faster, another
    rank found it slower by more, and every rank keeps the serial step."""
    seen = []

    def agree(values: list[float]) -> list[float]:
        seen.append(list(values))
        return [values[0] + 1.0, values[1]]  # another rank's pipeline took a second longer

    clock = Clock()
    chooser = ScheduleChooser(OptimizerOverlap.AUTO, clock=clock, agree=agree, trials=2, settle=1)
    _run(chooser, clock, {PIPELINE: 0.1, SERIAL: 0.2}, 2 + 8)
    assert seen == [[pytest.approx(0.1), pytest.approx(0.2)]]
    assert chooser.chosen == SERIAL


@pytest.mark.parametrize(
    ("mode", "tail", "schedule"),
    [
        (OptimizerOverlap.OFF, True, SERIAL),
        (OptimizerOverlap.PIPELINE, True, PIPELINE),
        (OptimizerOverlap.NEXT_FORWARD, True, TAIL),
        (OptimizerOverlap.NEXT_FORWARD, False, PIPELINE),  # several ranks, a compiled module: it runs as "pipeline"
    ],
)
def test_fixed_modes_never_time(mode: OptimizerOverlap, tail: bool, schedule: str) -> None:
    clock = Clock()
    chooser = ScheduleChooser(mode, tail=tail, clock=clock)
    assert _run(chooser, clock, {PIPELINE: 1.0, SERIAL: 2.0, TAIL: 0.5}, 12) == [schedule] * 12
    assert chooser.trial_ms == {} and chooser.chosen == schedule
    assert chooser.tail is (schedule == TAIL) and chooser.pipelined is (schedule != SERIAL)


@pytest.mark.parametrize(
    ("cost", "kept"),
    [
        ({PIPELINE: 0.05, SERIAL: 0.08, TAIL: 0.04}, TAIL),
        ({PIPELINE: 0.05, SERIAL: 0.08, TAIL: 0.06}, PIPELINE),
        ({PIPELINE: 0.09, SERIAL: 0.06, TAIL: 0.07}, SERIAL),
        ({PIPELINE: 0.05, SERIAL: 0.05, TAIL: 0.05}, PIPELINE),  # a tie keeps the pipeline
    ],
)
def test_auto_with_the_tail_times_three_in_turn(cost: dict[str, float], kept: str) -> None:
    """Where the tail may be left in flight (one rank, no compiled module) "auto" times it as a third candidate."""
    clock = Clock()
    chooser = ScheduleChooser(OptimizerOverlap.AUTO, tail=True, clock=clock, trials=2, settle=1)
    assert chooser.candidates == [PIPELINE, SERIAL, TAIL]
    ran = _run(chooser, clock, cost, 2 + 12 + 2)
    assert ran == [PIPELINE] * 2 + [PIPELINE, PIPELINE, SERIAL, SERIAL, TAIL, TAIL] * 2 + [kept] * 2
    assert chooser.chosen == kept and chooser.tail is (kept == TAIL)
    assert chooser.trial_ms == pytest.approx({name: 1e3 * seconds for name, seconds in cost.items()})


def test_ranks_agree_on_three_medians() -> None:
    """Every rank reduces the same list, in the candidates' order, so they keep the same schedule."""
    seen = []

    def agree(values: list[float]) -> list[float]:
        seen.append(list(values))
        return [values[0], values[1], values[2] + 1.0]  # another rank's tail took a second longer

    clock = Clock()
    chooser = ScheduleChooser(OptimizerOverlap.AUTO, tail=True, clock=clock, agree=agree, trials=1, settle=1)
    _run(chooser, clock, {PIPELINE: 0.2, SERIAL: 0.3, TAIL: 0.1}, 2 + 6)
    assert seen == [[pytest.approx(0.2), pytest.approx(0.3), pytest.approx(0.1)]]
    assert chooser.chosen == PIPELINE


def test_the_default_settles_before_timing() -> None:
    """``SETTLE_STEPS`` pipelined steps after the one that starts the clock, then the pairs."""
    clock = Clock()
    chooser = ScheduleChooser(OptimizerOverlap.AUTO, clock=clock)
    ran = _run(chooser, clock, {PIPELINE: 0.2, SERIAL: 0.1}, 1 + SETTLE_STEPS + 4 * TRIALS + 1)
    assert ran == [PIPELINE] * (1 + SETTLE_STEPS) + [PIPELINE, PIPELINE, SERIAL, SERIAL] * TRIALS + [SERIAL]
