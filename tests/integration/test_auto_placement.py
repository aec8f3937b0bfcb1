"""Placement policies under device budgets, against an unconstrained run on the same seed and data.

Budgets are derived from an unconstrained ``auto`` run's report: ``P`` = the warm-up peak of non-model
memory (activations), ``M`` = all model data. ``P + M`` holds everything; the floor is the smallest
budget the engine accepts at the end of warm-up, found by starting at ``P + 1`` byte and raising the
budget to the "needed" figure of each rejection. ``static`` runs get ``static_chunk_fraction = 1 - P /
budget``, i.e. the same room for chunks that ``auto`` has at the peak, and none of its knowledge of when
the peak is.

Placement must never change the arithmetic: losses and final weights are compared bit for bit.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pstar import MemoryBudgetError, MemoryReport, PatrickStarStrategy
from tests.helpers import OptimSpec, TinyLM, fit

STEPS = 8
CHUNK = 2048
"""Elements per chunk: 14 families for TinyGPT (the 4096-element weights get chunks of their own)."""
SPEC = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1)
PRECISIONS = ["32-true", "bf16-mixed"]
FRACTIONS = (1.0, 0.5, 0.3)
"""Budgets ``P + f * M`` above the floor. Lower ones are not listed: the floor the engine accepts varies
from run to run (see ``test_warmup_trace_does_not_depend_on_the_budget``), up to ``P + 0.28 M`` in
32-true when every chunk view autograd saves is counted as activations."""
FLOOR_TRIES = 12
SHIFT_AT = 3
"""Optimizer step from which ``ShiftingLM`` stops following the warm-up's execution order."""
TRACER_LOGGER = "lightning_pstar.runtime.tracer"
_NEEDED_RE = re.compile(r"together ([\d,]+) bytes .*but the device budget is ([\d,]+) bytes")


# --------------------------------------------------------------------------------------------------
# Runs (cached: several tests compare against the same unconstrained and budgeted runs)
# --------------------------------------------------------------------------------------------------


class ShiftingLM(TinyLM):
    """TinyLM whose execution order changes after warm-up.

    From optimizer step ``SHIFT_AT`` on, forward runs the blocks in the opposite order ("reverse") or
    skips the last block ("skip"). Before that it is TinyGPT's own forward.
    """

    def __init__(self, mode: str) -> None:
        super().__init__(optim=SPEC)
        self.mode = mode

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        model = self.model
        assert model is not None
        if self.global_step < SHIFT_AT:
            return model(idx)
        blocks = list(model.blocks)
        blocks = blocks[::-1] if self.mode == "reverse" else blocks[:-1]
        x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in blocks:
            x = block(x)
        x = model.ln_f(x)
        if model.frozen is not None:
            x = x + model.frozen(x)
        return model.lm_head(x)


class TrafficProbe(L.Callback):
    """Records the bytes moved between tiers after every batch and the param-chunk bytes of the model."""

    def __init__(self) -> None:
        self.moved: list[int] = []  # cumulative h2d + d2h after each batch
        self.param_chunk_bytes = 0
        self.num_families = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        families = trainer.strategy.chunk_manager.families
        self.param_chunk_bytes = sum(f.param_chunk.nbytes for f in families)
        self.num_families = len(families)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        report = trainer.strategy.memory_report()
        self.moved.append(report.h2d_bytes + report.d2h_bytes)

    def per_iteration(self) -> float:
        """Bytes moved per iteration after the warm-up iteration (which also moves the optimizer plan)."""
        return (self.moved[-1] - self.moved[0]) / (len(self.moved) - 1)


@dataclass
class Run:
    losses: list[float]
    states: list[dict[str, torch.Tensor]]  # after each optimizer step
    final_state: dict[str, torch.Tensor]
    report: MemoryReport
    probe: TrafficProbe
    global_step: int


_RUNS: dict[tuple[Any, ...], Run] = {}


def run(
    precision: str,
    *,
    placement: str = "auto",
    budget: int | None = None,
    module: L.LightningModule | None = None,
    cache: bool = True,
) -> Run:
    """Fit TinyLM (or ``module``) for STEPS steps; ``static`` gets ``static_chunk_fraction = 1 - P / budget``."""
    key = (precision, placement, budget)
    if cache and module is None and key in _RUNS:
        return _RUNS[key]
    options: dict[str, Any] = {"chunk_size": CHUNK, "placement": placement, "device_memory_limit": budget}
    if placement == "static" and budget is not None:
        options["static_chunk_fraction"] = (budget - peak_non_model(precision)) / budget
    strategy = PatrickStarStrategy(**options)
    probe = TrafficProbe()
    result = fit(
        module if module is not None else TinyLM(optim=SPEC),
        strategy=strategy,
        precision=precision,
        max_steps=STEPS,
        snapshot_state=budget is None,
        callbacks=[probe],
    )
    out = Run(
        losses=result.recorder.losses,
        states=result.recorder.states,
        final_state=result.recorder.final_state,
        report=strategy.memory_report(),
        probe=probe,
        global_step=result.trainer.global_step,
    )
    if cache and module is None:
        _RUNS[key] = out
    return out


def unconstrained(precision: str) -> Run:
    return run(precision)


def peak_non_model(precision: str) -> int:
    return unconstrained(precision).report.peak_non_model_bytes


def budget_figures(err: MemoryBudgetError) -> tuple[int, int]:
    """(needed, available) bytes from an end-of-warm-up MemoryBudgetError."""
    match = _NEEDED_RE.search(str(err))
    assert match is not None, f"no byte figures in the message: {err}"
    return int(match.group(1).replace(",", "")), int(match.group(2).replace(",", ""))


@dataclass
class Floor:
    budget: int  # the smallest accepted budget found
    rejected: list[tuple[int, int]]  # (budget, needed) of each rejection on the way
    run: Run


_FLOORS: dict[str, Floor] = {}


def auto_floor(precision: str) -> Floor:
    """Start at ``P + 1`` byte; after each rejection retry with the needed figure of its message."""
    if precision in _FLOORS:
        return _FLOORS[precision]
    budget = peak_non_model(precision) + 1
    rejected: list[tuple[int, int]] = []
    for _ in range(FLOOR_TRIES):
        try:
            floor_run = run(precision, budget=budget)
        except MemoryBudgetError as err:
            needed, available = budget_figures(err)
            assert available == budget and needed > budget, (needed, available, budget)
            rejected.append((budget, needed))
            budget = needed
            continue
        _FLOORS[precision] = Floor(budget=budget, rejected=rejected, run=floor_run)
        return _FLOORS[precision]
    raise AssertionError(f"no accepted budget after {FLOOR_TRIES} rejections: {rejected}")


def budgets(precision: str) -> list[int]:
    """``P + f * M`` for FRACTIONS (those above the floor), then the floor."""
    report = unconstrained(precision).report
    floor = auto_floor(precision).budget
    above = [report.peak_non_model_bytes + int(f * report.model_data_bytes) for f in FRACTIONS]
    return [b for b in above if b > floor] + [floor]


def assert_same_training(got: Run, ref: Run, what: str) -> None:
    assert got.global_step == ref.global_step == STEPS, what
    assert got.losses == ref.losses, f"{what}: losses differ\n{got.losses}\n{ref.losses}"
    assert sorted(got.final_state) == sorted(ref.final_state), what
    for name, value in ref.final_state.items():
        assert torch.equal(got.final_state[name], value), f"{what}: final '{name}' differs"


def hybrid_split(report: MemoryReport) -> tuple[int, int]:
    match = re.fullmatch(r"device for (\d+) of (\d+) families, host for the rest", report.optimizer_tier)
    assert match is not None, f"not a hybrid optimizer placement: {report.optimizer_tier!r}"
    return int(match.group(1)), int(match.group(2))


# --------------------------------------------------------------------------------------------------
# a. bitwise parity under every budget, both policies, both precisions
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["auto", "static"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_budget_gives_bitwise_equal_training(precision: str, placement: str) -> None:
    free = unconstrained(precision)
    P, M = free.report.peak_non_model_bytes, free.report.model_data_bytes
    assert free.report.num_chunks >= 8
    assert free.report.evictions == 0 and free.report.h2d_bytes == 0
    floor = auto_floor(precision)
    print(f"{precision}: P={P} M={M} floor={floor.budget} (P + {floor.budget - P}) rejected={floor.rejected}")
    refused = 0
    for budget in budgets(precision):
        try:
            got = run(precision, placement=placement, budget=budget)
        except MemoryBudgetError as err:
            # static reserves the peak activations for the whole iteration: when the share left cannot hold
            # one module's chunks it refuses at setup, with the figures; auto (the tide) trains at this budget
            if placement != "static" or "placement='static'" not in str(err) or "HINT" not in str(err):
                raise
            assert budget < P + M / 4, f"static refused a generous budget {budget}: {err}"
            refused += 1
            continue
        report = got.report
        what = f"{placement} {precision} budget {budget} (P + {(budget - P) / M:.3f} M)"
        print(
            f"{what}: moved {got.probe.moved[-1]} B ({got.probe.per_iteration():.0f} B/iteration),"
            f" evictions {report.evictions}, prefetches {report.prefetches}, optimizer {report.optimizer_tier}"
        )
        assert report.placement == placement
        assert report.device_memory_limit == budget
        assert_same_training(got, free, what)
        if budget < P + M:
            assert got.probe.moved[-1] > 0, what
        if budget - P < got.probe.param_chunk_bytes:
            assert report.evictions > 0, f"{what}: the param chunks do not fit next to the peak, yet no eviction"
        if placement == "static":
            assert report.peak_device_chunk_bytes <= budget - P, what
            if budget >= P + M:
                assert got.probe.moved[-1] == 0, f"{what}: all model data fits, yet bytes moved"
        else:
            assert report.peak_device_chunk_bytes <= budget, what
            assert report.moment_labels == free.report.moment_labels, what
            if budget >= P + M:
                assert report.optimizer_tier == "device", what
                moved = got.probe.moved
                assert moved[-1] == moved[1], f"{what}: all model data fits, yet bytes moved after warm-up: {moved}"
    assert refused <= 1, f"static refused {refused} budgets"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_auto_keeps_chunks_within_the_room_of_each_moment(precision: str) -> None:
    """The tide: at moment t chunks may use ``budget - non_model[t]``. Checked against the non-model memory
    the run planned with (its own warm-up trace) and against the activations the model really has (the
    unconstrained run's trace: the same moments, the same arithmetic)."""
    free = unconstrained(precision).report
    violations: list[str] = []
    for budget in budgets(precision):
        report = run(precision, budget=budget).report
        assert report.moment_labels == free.moment_labels
        assert report.peak_device_chunk_bytes <= budget
        for label, chunks, planned, actual in zip(
            report.moment_labels,
            report.moment_device_chunk_bytes,
            report.moment_non_model_bytes,
            free.moment_non_model_bytes,
            strict=True,
        ):
            for what, non_model in (("planned non-model", planned), ("activations", actual)):
                if chunks + non_model > budget:
                    violations.append(
                        f"budget {budget}, {label}: chunks {chunks} + {what} {non_model} exceed it by"
                        f" {chunks + non_model - budget}"
                    )
    assert not violations, "\n".join(violations)


# --------------------------------------------------------------------------------------------------
# b. auto beats static when activations peak in the middle of the iteration
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_auto_moves_fewer_bytes_than_static(precision: str) -> None:
    free = unconstrained(precision).report
    values = free.moment_non_model_bytes
    peak_at = values.index(max(values))
    assert 0 < peak_at < len(values) - 1, f"non-model memory does not peak mid-iteration: {values}"
    assert values[0] < max(values) // 4 and values[-1] < max(values) // 4, values

    budget = free.peak_non_model_bytes + free.model_data_bytes // 2
    auto = run(precision, placement="auto", budget=budget).probe
    static = run(precision, placement="static", budget=budget).probe
    print(
        f"{precision} budget {budget}: auto {auto.per_iteration():.0f} B/iteration (total {auto.moved[-1]}),"
        f" static {static.per_iteration():.0f} B/iteration (total {static.moved[-1]})"
    )
    assert static.per_iteration() > 0
    assert auto.per_iteration() < static.per_iteration()


# --------------------------------------------------------------------------------------------------
# c. a budget below the activations' peak plus one chunk group fails cleanly when the warm-up's step begins
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_budget_below_peak_fails_at_end_of_warmup(precision: str) -> None:
    free = unconstrained(precision)
    budget = 3 * free.report.peak_non_model_bytes // 4  # the activations alone do not fit
    module = TinyLM(optim=SPEC)
    assert module.model is not None
    initial = {k: v.detach().float().clone() for k, v in module.model.state_dict().items()}
    strategy = PatrickStarStrategy(chunk_size=CHUNK, device_memory_limit=budget)
    probe = TrafficProbe()
    with pytest.raises(
        MemoryBudgetError, match=r"(?s)warm-up measured .* bytes.*HINT: raise device_memory_limit"
    ) as err:
        fit(module, strategy=strategy, precision=precision, max_steps=STEPS, callbacks=[probe])
    needed, available = budget_figures(err.value)
    print(f"{precision}: budget {budget}: {err.value}")
    assert available == budget
    assert needed > budget
    assert probe.moved == [], "the error must come at the end of the first iteration, before any batch ended"

    # refused before the warm-up's optimizer step: the model holds its initial weights
    assert module.model is not None
    state = {k: v.detach().float().cpu() for k, v in module.model.state_dict().items()}
    assert sorted(state) == sorted(initial)
    for name, value in state.items():
        assert torch.equal(value, initial[name]), f"'{name}' changed: the error came after an optimizer step"


# --------------------------------------------------------------------------------------------------
# d. execution order changes after warm-up: placement falls back, nothing breaks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["reverse", "skip"])
def test_trace_mismatch_falls_back_once(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    precision = "32-true"
    free_report = unconstrained(precision).report
    budget = free_report.peak_non_model_bytes + int(0.3 * free_report.model_data_bytes)
    caplog.set_level(logging.WARNING, logger=TRACER_LOGGER)
    free = run(precision, module=ShiftingLM(mode), cache=False)
    caplog.clear()
    tight = run(precision, budget=budget, module=ShiftingLM(mode), cache=False)
    fallbacks = [r for r in caplog.records if r.name == TRACER_LOGGER and "falls back" in r.getMessage()]
    print(f"{mode}: budget {budget}: {tight.report}\n{[r.getMessage() for r in fallbacks]}")

    assert len(fallbacks) == 1, [r.getMessage() for r in caplog.records]
    assert tight.report.evictions > 0
    assert_same_training(tight, free, f"shifting ({mode}) under budget {budget}")
    # the shift really changed the training (else this test would prove nothing)
    unshifted = unconstrained(precision)
    assert tight.losses[:SHIFT_AT] == unshifted.losses[:SHIFT_AT]
    assert tight.losses[SHIFT_AT] != unshifted.losses[SHIFT_AT]
    for value in tight.final_state.values():
        assert torch.isfinite(value).all()


# --------------------------------------------------------------------------------------------------
# e. hybrid optimizer placement
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_hybrid_optimizer_keeps_some_families_on_device(precision: str) -> None:
    free = unconstrained(precision)
    assert free.report.optimizer_tier == "device"
    P, M = free.report.peak_non_model_bytes, free.report.model_data_bytes
    params = free.probe.param_chunk_bytes
    assert 0 < params < M
    budget = P + params + (M - params) // 2  # all param chunks and about half the optimizer side
    got = run(precision, budget=budget)
    k, n = hybrid_split(got.report)
    print(f"{precision}: P={P} params={params} M={M} budget={budget}: {got.report.optimizer_tier}")
    assert 0 < k < n
    assert_same_training(got, free, f"hybrid optimizer, budget {budget}")


# --------------------------------------------------------------------------------------------------
# f. prefetch
# --------------------------------------------------------------------------------------------------


def test_prefetch_only_under_auto() -> None:
    precision = "32-true"
    free = unconstrained(precision).report
    budget = free.peak_non_model_bytes + free.model_data_bytes // 3  # tight, yet static can hold a module
    auto = run(precision, placement="auto", budget=budget).report
    static = run(precision, placement="static", budget=budget).report
    print(f"budget {budget}: prefetches auto {auto.prefetches}, static {static.prefetches}")
    assert auto.h2d_bytes > 0 and static.h2d_bytes > 0  # both offload at this budget
    assert auto.prefetches > 0
    assert static.prefetches == 0


# --------------------------------------------------------------------------------------------------
# g. the per-moment report
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_per_moment_report(precision: str) -> None:
    report = unconstrained(precision).report
    labels, values = report.moment_labels, report.moment_non_model_bytes
    assert len(values) == len(labels) == len(report.moment_device_chunk_bytes) > 0
    kinds = {label.split(":")[0] for label in labels}
    assert {"fwd", "bwd", "step"} <= kinds, labels
    assert labels[0].startswith("fwd") and labels[-1] == "step"
    first_fwd = next(i for i, label in enumerate(labels) if label.startswith("fwd"))
    peak_at = values.index(max(values))
    assert peak_at != first_fwd and 0 < peak_at < len(values) - 1, list(zip(labels, values, strict=True))
    assert report.peak_non_model_bytes == max(values) > 0
    assert all(v >= 0 for v in values)


# --------------------------------------------------------------------------------------------------
# the warm-up measurement itself must not depend on where chunks were during warm-up
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_warmup_trace_does_not_depend_on_the_budget(precision: str) -> None:
    """Non-model memory is activations; chunk views that autograd saves are model data whatever tier their
    chunk was on during warm-up. So a budgeted warm-up measures the unconstrained run's trace, and the
    smallest accepted budget is P plus the chunks of one moment (the first needed figure)."""
    free = unconstrained(precision).report
    floor = auto_floor(precision)
    first_needed = floor.rejected[0][1] if floor.rejected else floor.budget
    budget = free.peak_non_model_bytes + int(0.3 * free.model_data_bytes)
    got = run(precision, budget=budget).report
    diffs = [
        (label, a - b)
        for label, a, b in zip(got.moment_labels, got.moment_non_model_bytes, free.moment_non_model_bytes, strict=True)
        if a != b
    ]
    print(f"{precision}: budget {budget}: moments measured differently (label, extra bytes): {diffs}")
    print(f"{precision}: floor {floor.budget}, first needed figure {first_needed}, rejections {floor.rejected}")
    assert got.moment_non_model_bytes == free.moment_non_model_bytes, diffs
    assert floor.budget == first_needed, floor.rejected


# --------------------------------------------------------------------------------------------------
# d. auto never moves more than static, and the yardstick never exceeds what either moved
# --------------------------------------------------------------------------------------------------


def _policy_runs(precision: str) -> list[tuple[int, Run, Run | None]]:
    """(budget, auto run, static run or None where static refuses the budget) for every budget."""
    out = []
    for budget in budgets(precision):
        auto = run(precision, placement="auto", budget=budget)
        try:
            static: Run | None = run(precision, placement="static", budget=budget)
        except MemoryBudgetError:
            static = None  # static cannot hold one module's chunks in what the peak leaves (see section a)
        out.append((budget, auto, static))
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_auto_never_moves_more_than_static_at_any_budget(precision: str) -> None:
    compared = 0
    for budget, auto, static in _policy_runs(precision):
        moved = auto.report.moved_bytes_per_iteration
        assert moved is not None, f"budget {budget}: no iteration after the warm-up was measured"
        if static is None:
            continue
        static_moved = static.report.moved_bytes_per_iteration
        assert static_moved is not None
        print(f"{precision} budget {budget}: auto {moved} B/iteration, static {static_moved} B/iteration")
        assert moved <= static_moved, f"budget {budget}: auto moved {moved} B per iteration, static {static_moved}"
        compared += 1
    assert compared >= 2, "fewer than two budgets where both policies train"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_optimum_bound_never_exceeds_what_a_policy_moved(precision: str) -> None:
    for budget, auto, static in _policy_runs(precision):
        for policy, got in (("auto", auto), ("static", static)):
            if got is None:
                continue
            report = got.report
            low, high = report.optimal_bytes_lower_bound, report.optimal_bytes_upper_bound
            moved = report.moved_bytes_per_iteration
            what = f"{policy} {precision} budget {budget}: bound {low}..{high}, moved {moved}"
            print(what)
            assert low is not None and high is not None and moved is not None, what
            assert 0 <= low <= high, what
            # a lower bound above a real schedule would be a wrong yardstick
            assert low <= moved, what
            if report.optimal_bytes_per_iteration is not None:
                assert report.optimal_bytes_per_iteration == low == high, what
    # unconstrained: nothing to move, and the report says so
    free = unconstrained(precision).report
    assert free.optimal_bytes_lower_bound is None and free.moved_bytes_per_iteration in (None, 0)
