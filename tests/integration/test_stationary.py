"""Stationary micro-batches ([Note: stationary chunks] in runtime/residency.py): once the warm-up is over and no chunk
can move, the per-module verbs skip the moves and no backward hooks are registered. The arithmetic must not change:
the same run with the short path turned off (``Residency.nothing_moves`` answering False) must give the same losses
and the same weights, bit for bit, and plain Lightning the same as it gives the engine otherwise."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.residency import Residency
from tests.helpers import TinyLM, build_model, fit_steps
from tests.helpers.asserts import assert_evicted, assert_same_run

STEPS = 5


class _Watch(L.Callback):
    """Whether each training micro-batch was stationary, and how many backward verbs it ran."""

    def __init__(self) -> None:
        self.stationary: list[bool] = []
        self.backward_verbs: list[int] = []
        self._calls = 0
        self._installed = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        manager = trainer.strategy._manager  # type: ignore[attr-defined]
        if not self._installed:
            self._installed = True
            for name in ("pre_backward", "post_backward"):
                verb = getattr(manager, name)

                def counted(*args: Any, _verb: Any = verb) -> Any:
                    self._calls += 1
                    return _verb(*args)

                setattr(manager, name, counted)
        self._calls = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        manager = trainer.strategy._manager  # type: ignore[attr-defined]
        self.stationary.append(manager.stationary)
        self.backward_verbs.append(self._calls)


def _run(precision: str, *, moving: bool, monkeypatch: pytest.MonkeyPatch, **strategy: Any) -> tuple[Any, _Watch]:
    watch = _Watch()
    with monkeypatch.context() as patch:
        if moving:
            patch.setattr(Residency, "nothing_moves", lambda self, peak: False)
        result = fit_steps(
            TinyLM(),
            PatrickStarStrategy(**strategy),
            precision=precision,
            steps=STEPS,
            callbacks=[watch],
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
        )
    return result, watch


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_stationary_batches_train_bitwise_as_the_moving_path(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    still, watch = _run(precision, moving=False, monkeypatch=monkeypatch)
    moving, watch_moving = _run(precision, moving=True, monkeypatch=monkeypatch)
    # the warm-up's micro-batches run every verb; after it, nothing moves without a budget
    assert watch.stationary[0] is False and all(watch.stationary[1:]), watch.stationary
    assert watch.backward_verbs[0] > 0 and not any(watch.backward_verbs[1:]), watch.backward_verbs
    assert not any(watch_moving.stationary) and all(watch_moving.backward_verbs), watch_moving.backward_verbs
    assert still.losses == moving.losses
    assert sorted(still.final) == sorted(moving.final)
    for name, value in moving.final.items():
        assert torch.equal(still.final[name], value), name
    report = still.trainer.strategy.memory_report()  # type: ignore[attr-defined]
    assert report.moment_device_chunk_bytes and all(b > 0 for b in report.moment_device_chunk_bytes)


def _tight_limit(chunk: int) -> int:
    """A third of the model's fp32 param bytes, and room for any one module's chunks three times over."""
    model = build_model()
    largest = max(sum(max(p.numel(), chunk) for p in m.parameters(recurse=False)) * 4 for m in model.modules())
    return max(sum(p.numel() for p in model.parameters()) * 4 // 3, 3 * largest)


def test_a_budget_the_chunks_fit_is_stationary_and_one_that_evicts_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    roomy, watch = _run("32-true", moving=False, monkeypatch=monkeypatch, device_memory_limit=256 << 20)
    assert all(watch.stationary[1:]), watch.stationary
    assert roomy.trainer.strategy.memory_report().evictions == 0  # type: ignore[attr-defined]
    tight = {"chunk_size": 512, "placement": "static", "device_memory_limit": _tight_limit(512)}
    evicting, watch_tight = _run("32-true", moving=False, monkeypatch=monkeypatch, **tight)
    assert_evicted(evicting.trainer.strategy)  # type: ignore[arg-type]
    assert not any(watch_tight.stationary), watch_tight.stationary
    assert all(watch_tight.backward_verbs), watch_tight.backward_verbs
    unbounded, _ = _run("32-true", moving=False, monkeypatch=monkeypatch)
    assert roomy.losses == unbounded.losses
    assert evicting.losses == pytest.approx(unbounded.losses, rel=1e-5)


class _ForwardBeforeStep(TinyLM):
    """Runs the model between backward and the optimizer step (its slots hold this step's gradients)."""

    def __init__(self, plain: bool = False) -> None:
        super().__init__()
        self.plain = plain

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.global_step >= 2:
            assert self.plain or self.trainer.strategy._manager.stationary  # type: ignore[attr-defined]
            self.model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_forward_between_backward_and_step_matches_plain(precision: str) -> None:
    """The stationary engine (no backward hooks) too runs a forward between the backward and the step with the
    weights, and steps the gradients of the backward ([Note: a forward after the gradient] in late_gradients.py)."""
    got = fit_steps(_ForwardBeforeStep(), PatrickStarStrategy(), precision=precision, steps=STEPS)
    ref = fit_steps(_ForwardBeforeStep(plain=True), "auto", precision=precision, steps=STEPS)
    if precision == "32-true":
        assert_same_run(got, ref, what="a forward between backward and step")
    else:
        assert got.losses == pytest.approx(ref.losses, rel=2e-2)
