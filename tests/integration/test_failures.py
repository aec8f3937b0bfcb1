"""Bad runs against plain Lightning: an fp16 overflow storm, a NaN loss, and an exception in ``training_step`` with the
resume after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_pstar import LossScaleConfig, PatrickStarPrecision, PatrickStarStrategy
from lightning_pstar.precision import LossScaleUnderflowError
from tests.helpers.asserts import LOSS_RTOL, assert_same_run
from tests.helpers.data import make_loader
from tests.helpers.models import MultiUse
from tests.helpers.runs import LM, STEPS, FitResult, fit_steps


class InfLossLM(LM):
    """A loss that is always +inf: every fp16 step overflows."""

    def __init__(self) -> None:
        super().__init__(lambda: MultiUse("loop"))
        self.calls = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.calls += 1
        return super().training_step(batch, batch_idx) * float("inf")


def test_fp16_overflow_storm_stops_with_a_clear_error() -> None:
    """Scale 8 -> 4 -> 2 -> 1 (skipping each step), then the 4th overflow at min_scale=1 raises instead of
    skipping forever; no step ever touched the weights."""
    module = InfLossLM()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    plugin = PatrickStarPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=8.0, min_scale=1.0))
    with pytest.raises(LossScaleUnderflowError, match=r"minimum loss scale 1\.0 \(4 steps skipped.*HINT"):
        fit_steps(module, PatrickStarStrategy(), plugins=[plugin], steps=50)
    assert module.calls == 4
    assert plugin.scale == 1.0 and plugin.skipped_steps == 4
    for name, value in module.state_dict().items():
        assert torch.equal(value.float(), initial[name].float()), f"{name} changed although every step was skipped"


class NaNLossLM(LM):
    """The loss of batch 2 is NaN."""

    def __init__(self) -> None:
        super().__init__(lambda: MultiUse("loop"))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 2 else loss


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_nan_loss_behaves_as_plain_lightning(precision: str) -> None:
    """Plain Lightning does not stop on a NaN loss: the NaN gradient reaches AdamW, every weight becomes NaN and so
    does every later loss. PatrickStar does the same with ``nonfinite="ignore"`` (no silent skip, no crash); its
    default refuses the step instead (tests/integration/test_nonfinite.py)."""
    ref = fit_steps(NaNLossLM(), "auto", precision=precision)
    got = fit_steps(NaNLossLM(), PatrickStarStrategy(nonfinite="ignore"), precision=precision)
    assert ref.trainer.global_step == got.trainer.global_step == STEPS
    assert [math.isnan(v) for v in got.losses] == [math.isnan(v) for v in ref.losses] == [i >= 2 for i in range(STEPS)]
    rtol = LOSS_RTOL if precision == "32-true" else 2e-2
    for a, b in zip(got.losses[:2], ref.losses[:2], strict=True):
        assert a == pytest.approx(b, rel=rtol)
    for name, value in ref.final.items():
        assert torch.equal(got.final[name].isnan(), value.isnan()), f"{name}: NaN pattern differs"


class CrashingLM(LM):
    """Raises in ``training_step`` when ``global_step == crash_at``."""

    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__(lambda: MultiUse("twice"))
        self.crash_at = crash_at

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at:
            raise RuntimeError(f"injected failure at step {self.crash_at}")
        return super().training_step(batch, batch_idx)


def _crash_and_resume(
    strategy: Callable[[], Any], tmp_path: Path, loader: DataLoader
) -> tuple[dict[str, Any], FitResult]:
    """Train until the injected failure at step 7 with a checkpoint at every epoch end, then resume from
    ``last.ckpt`` in a new Trainer to step 9. Returns the checkpoint's contents and the resumed run."""
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1)
    with pytest.raises(RuntimeError, match="injected failure at step 7"):
        fit_steps(
            CrashingLM(crash_at=7), strategy(), steps=9, loader=loader, callbacks=[saver], enable_checkpointing=True
        )
    last = tmp_path / "last.ckpt"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"], f"left behind: {names}"
    contents = torch.load(last, map_location="cpu", weights_only=False)
    resumed = fit_steps(CrashingLM(), strategy(), steps=9, loader=loader, ckpt_path=str(last))
    assert resumed.trainer.global_step == 9
    return contents, resumed


def test_exception_in_training_step_keeps_last_checkpoint_and_resume_works(tmp_path: Path) -> None:
    """3 batches per epoch, a checkpoint at every epoch end; a crash at step 7 (inside epoch 2) leaves the
    step-6 checkpoint intact (the weights and optimizer state plain Lightning has there), and a new Trainer
    resumes from it as plain Lightning resumes from its own. (Lightning replays one batch when it resumes from a
    checkpoint written in ``on_train_epoch_end``, so the reference is plain Lightning's own crash and resume.)"""
    loader = make_loader(12, noise=0.0)  # 3 batches per epoch
    ref_ckpt, ref = _crash_and_resume(lambda: "auto", tmp_path / "plain", loader)
    got_ckpt, got = _crash_and_resume(PatrickStarStrategy, tmp_path / "pstar", loader)
    assert got_ckpt["global_step"] == ref_ckpt["global_step"] == 6 and got_ckpt["epoch"] == 1
    for name, value in ref_ckpt["state_dict"].items():
        torch.testing.assert_close(got_ckpt["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    want_opt, got_opt = ref_ckpt["optimizer_states"][0]["state"], got_ckpt["optimizer_states"][0]["state"]
    assert sorted(got_opt) == sorted(want_opt)
    for index, state in want_opt.items():
        for key, value in state.items():
            torch.testing.assert_close(got_opt[index][key].float(), value.float(), rtol=1e-5, atol=1e-7)
    assert_same_run(got, ref, what="resumed")
