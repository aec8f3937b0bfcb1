"""Adversarial runs of mixed precision with gradient accumulation through the pipelined host step.

In bf16-mixed and 16-mixed with accumulation a record's gradient is its compute-dtype slot (this micro-batch) plus
the fp32 sum of the earlier micro-batches in its GRAD chunk; the pipelined host job builds it itself ([Note:
gradient parts] in ``optim/host_step.py``) and, with nothing between the backward and the step, starts inside the
last micro-batch's backward ([Note: stepping inside the backward] in ``optim/overlap.py``). The claim under test:
every ``optimizer_overlap`` mode is bitwise ``"off"`` (losses, final weights, optimizer states), and ``"off"``
matches plain Lightning. Each scenario is one a user brings and the team did not write (windows cut by epoch ends,
experts that get no token in a whole window, LoRA-like frozen weights beside trainable ones, several param groups
with schedules, two optimizers, overflow skips, tight budgets, the disk tier, a resume, Fabric loops); each asserts
that the pipeline really ran, so none passes by quietly stepping serially.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.config import LossScaleConfig
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.report import MemoryReport
from tests.helpers import assert_runs_bitwise, assert_states_close, assert_states_equal, optimizer_state
from tests.helpers.data import make_loader
from tests.helpers.models import N_EMBD, VOCAB, MultiUse, TinyGPT
from tests.helpers.runs import LM, FitResult, fit
from tests.integration.test_activation_checkpointing import CheckpointedGPT

HOST = {"optimizer_placement": "host", "chunk_size": 4096}
RTOL = 3e-7  # 32-true losses of "off" against plain Lightning


class Peek(L.Callback):
    """The memory report, the trainable families and the 16-mixed skips at the end of training."""

    report: MemoryReport | None = None
    families = 0
    skipped = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, PatrickStarStrategy):
            self.report = strategy.memory_report()
            manager = strategy._manager
            assert manager is not None
            self.families = sum(1 for f in manager.families if f.trainable)
        self.skipped = getattr(trainer.precision_plugin, "skipped_steps", 0)


def _run(
    make: Callable[[], L.LightningModule],
    overlap: str | None,
    *,
    precision: str = "bf16-mixed",
    n_seq: int = 28,
    max_steps: int = -1,
    max_epochs: int = 1,
    options: dict[str, Any] | None = None,
    loss_scale: LossScaleConfig | None = None,
    loader: DataLoader | None = None,
    **kwargs: Any,
) -> tuple[FitResult, Peek]:
    """One fit of ``make()`` over ``n_seq`` sequences in batches of 4 (7 batches by default): PatrickStar with
    ``optimizer_overlap=overlap``, or plain Lightning (``None``)."""
    peek = Peek()
    strategy: Any = "auto"
    if overlap is not None:
        strategy = PatrickStarStrategy(optimizer_overlap=overlap, **{**HOST, **(options or {})})
    if precision == "16-mixed":  # on a CPU Lightning rewrites precision="16-mixed": pass the plugin
        kwargs["plugins"] = [PatrickStarPrecision("16-mixed", loss_scale=loss_scale)]
    callbacks = [peek, *kwargs.pop("callbacks", [])]
    result = fit(
        make(),
        strategy=strategy,
        loader=loader if loader is not None else make_loader(n_seq=n_seq),
        precision=precision,
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=callbacks,
        **kwargs,
    )
    return result, peek


def _bitwise(got: FitResult, want: FitResult, what: str) -> None:
    """:func:`assert_runs_bitwise`, with a nan loss equal to a nan loss (a skipped micro-batch's)."""
    assert [repr(x) for x in got.losses] == [repr(x) for x in want.losses], f"{what}: losses differ"
    assert_states_equal(got.final, want.final, what=f"{what}: weights")
    assert_states_equal(optimizer_state(got), optimizer_state(want), what=f"{what}: optimizer states")


def _pair(
    make: Callable[[], L.LightningModule], mode: str = "pipeline", **kwargs: Any
) -> tuple[FitResult, FitResult, Peek, Peek]:
    """The serial step's run and ``mode``'s on the same seed and data: bitwise the same losses, weights and
    optimizer states. Returns both runs and both peeks."""
    serial, serial_peek = _run(make, "off", **kwargs)
    piped, piped_peek = _run(make, mode, **kwargs)
    _bitwise(piped, serial, f"optimizer_overlap={mode!r} against 'off'")
    assert serial_peek.report is not None and piped_peek.report is not None
    assert serial_peek.report.host_step_jobs == 0
    assert serial_peek.skipped == piped_peek.skipped
    return serial, piped, serial_peek, piped_peek


def _gpt(**kwargs: Any) -> Callable[[], LM]:
    return lambda: LM(lambda: TinyGPT(**kwargs))


def _steps_of(result: FitResult) -> dict[str, float]:
    """The Adam step count of every parameter in the user's optimizer state, by index."""
    state = result.trainer.optimizers[0].state_dict()["state"]
    return {str(i): float(entry["step"]) for i, entry in state.items()}


# ---- windows cut by epoch ends --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accumulate", "mode", "precision"),
    [
        (2, "pipeline", "bf16-mixed"),
        (3, "pipeline", "bf16-mixed"),
        (4, "next_forward", "bf16-mixed"),
        (5, "pipeline", "bf16-mixed"),
        (9, "next_forward", "bf16-mixed"),  # longer than the epoch: each epoch is one short window
        (3, "pipeline", "16-mixed"),
    ],
)
def test_windows_cut_by_epoch_ends(accumulate: int, mode: str, precision: str) -> None:
    """7 batches an epoch, 2 epochs: every epoch ends with a short window (Lightning steps at the epoch's last batch);
    the model has a tied embedding, a block used twice in one forward, a frozen and an unused Linear."""
    serial, piped, _, peek = _pair(
        _gpt(reuse_block=True, unused=True), mode, precision=precision, max_epochs=2, accumulate_grad_batches=accumulate
    )
    steps = 2 * -(-7 // accumulate)
    assert serial.trainer.global_step == steps == piped.trainer.global_step
    assert peek.report is not None
    assert peek.report.host_step_jobs >= steps * peek.families - peek.families  # every step pipelined (bar a family)
    if precision == "bf16-mixed":  # after the warm-up every step (short windows too) started the same families
        in_backward = peek.report.host_steps_in_backward  # inside its last micro-batch's backward
        assert in_backward % (steps - 1) == 0 and in_backward // (steps - 1) >= peek.families - 2 > 0, in_backward


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_windows_cut_by_epoch_ends_with_clipping(clip: str) -> None:
    """Clipping (by norm: the global norm of slot + sum parts) on windows of 3, 3, 1 micro-batches."""
    _, _, _, peek = _pair(
        _gpt(),
        max_epochs=2,
        accumulate_grad_batches=3,
        gradient_clip_val=0.05,
        gradient_clip_algorithm=clip,
    )
    assert peek.report is not None and peek.report.host_step_jobs >= 6 * (peek.families - 1) > 0


def test_epoch_cut_windows_off_is_plain_lightning() -> None:
    """32-true, windows 3, 3, 1 over two epochs: "off" gives plain Lightning's losses and weights."""
    ref, _ = _run(_gpt(), None, precision="32-true", max_epochs=2, accumulate_grad_batches=3)
    got, peek = _run(_gpt(), "pipeline", precision="32-true", max_epochs=2, accumulate_grad_batches=3)
    assert peek.report is not None and peek.report.host_step_jobs > 0
    assert len(got.losses) == len(ref.losses) == 14
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (got.losses, ref.losses)
    assert_states_close(got.final, ref.final, what="pipeline, 32-true, epoch-cut windows", atol=1e-5)


# ---- experts that get no token in a whole window --------------------------------------------------------------


class Routed(nn.Module):
    """A tiny mixture of experts routed by token id, whose last expert gets tokens only in some accumulation
    windows (window ``w`` when ``w % 3 == 0``, on micro-batch ``w % accumulate`` of it): in the other windows its
    record has no gradient at all and must not step (its Adam step count stays)."""

    def __init__(self, accumulate: int, experts: int = 3) -> None:
        super().__init__()
        self.accumulate = accumulate
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.experts = nn.ModuleList([nn.Linear(N_EMBD, N_EMBD) for _ in range(experts)])
        self.rare = nn.Linear(N_EMBD, N_EMBD)
        self.ln = nn.LayerNorm(N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB)
        self.calls = 0
        self.rare_windows: set[int] = set()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        window, micro = divmod(self.calls, self.accumulate)
        if torch.is_grad_enabled():
            self.calls += 1
        x = self.wte(idx)
        route = idx % len(self.experts)
        out = x
        for e, expert in enumerate(self.experts):
            mask = (route == e).unsqueeze(-1)
            if bool(mask.any()):
                out = out + torch.where(mask, F.gelu(expert(x)), torch.zeros_like(x))
        if torch.is_grad_enabled() and window % 3 == 0 and micro == window % self.accumulate:
            self.rare_windows.add(window)
            out = out + self.rare(x)
        return self.head(self.ln(out))


class RoutedLM(LM):
    def __init__(self, accumulate: int) -> None:
        super().__init__(lambda: Routed(accumulate))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=3e-3, fused=True)


@pytest.mark.parametrize(("accumulate", "chunk_size"), [(2, 4096), (3, 4096), (3, 1056)])
def test_an_expert_idle_for_whole_windows_does_not_step(accumulate: int, chunk_size: int) -> None:
    """The rare expert's step count is the number of windows it got tokens in, under "off", "pipeline" and
    "next_forward" alike, and plain Lightning's (32-true, where "off" also gives its weights)."""
    options = {"chunk_size": chunk_size}
    n_seq = 4 * 4 * accumulate  # 4 windows: the rare expert runs in windows 0 and 3
    serial, piped, _, peek = _pair(
        lambda: RoutedLM(accumulate), n_seq=n_seq, options=options, accumulate_grad_batches=accumulate
    )
    _, nxt, _, _ = _pair(
        lambda: RoutedLM(accumulate), "next_forward", n_seq=n_seq, options=options, accumulate_grad_batches=accumulate
    )
    assert peek.report is not None and peek.report.host_step_jobs > 0
    assert serial.module.net.rare_windows == {0, 3}
    rare = {id(p) for p in serial.module.net.rare.parameters()}
    index = {id(p): str(i) for i, p in enumerate(serial.module.parameters())}
    for result in (serial, piped, nxt):
        steps = _steps_of(result)
        assert {steps[index[r]] for r in rare} == {2.0}, steps
        assert max(steps.values()) == 4.0
    # plain Lightning counts the same steps, and "off" its weights (32-true)
    ref, _ = _run(
        lambda: RoutedLM(accumulate), None, precision="32-true", n_seq=n_seq, accumulate_grad_batches=accumulate
    )
    got, _ = _run(
        lambda: RoutedLM(accumulate),
        "pipeline",
        precision="32-true",
        n_seq=n_seq,
        options=options,
        accumulate_grad_batches=accumulate,
    )
    assert _steps_of(got) == _steps_of(ref)
    assert_states_close(got.final, ref.final, what="routed experts, 32-true, against plain Lightning", atol=1e-5)


# ---- LoRA-like: frozen weights sharing chunks with trainable ones ----------------------------------------------


class LoraLinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update (``b`` starts at zero, as LoRA's does)."""

    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(N_EMBD, N_EMBD)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, N_EMBD) * 0.1)
        self.b = nn.Parameter(torch.zeros(N_EMBD, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class Lora(nn.Module):
    """Embedding and head frozen too; only the low-rank factors and the norms train."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wte.requires_grad_(False)
        self.layers = nn.ModuleList([LoraLinear() for _ in range(3)])
        self.ln = nn.LayerNorm(N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB)
        self.head.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return self.head(self.ln(x))


@pytest.mark.parametrize("all_params", [False, True], ids=["trainable", "all-params"])
@pytest.mark.parametrize("chunk_size", [1200, 4096])
def test_lora_frozen_weights_beside_trainable_ones(all_params: bool, chunk_size: int) -> None:
    """LoRA-like, accumulation 3 in bf16-mixed (the frozen weights are read again by every micro-batch's forward
    while the trainable ones accumulate; with ``all_params`` the optimizer holds the frozen ones too): the serial
    step's bits, and the frozen weights come out untouched. (The layout puts frozen and trainable parameters in
    chunks of their own, whatever the chunk size: the trainable family steps through the pipeline.)"""
    serial, _, _, peek = _pair(
        lambda: LM(Lora, all_params=all_params),
        options={"chunk_size": chunk_size},
        n_seq=36,
        accumulate_grad_batches=3,
    )
    assert peek.report is not None and peek.report.host_step_jobs > 0
    start = serial.recorder.initial_state
    for name, value in serial.final.items():
        if ".base." in name or name.startswith("net.wte") or name.startswith("net.head"):
            assert torch.equal(value, start[name]), name
        elif name.endswith(".b"):
            assert not torch.equal(value, start[name]), name


# ---- param groups, schedules, Adam with L2, maximize ------------------------------------------------------------


class GroupsLM(LM):
    """Three param groups with their own lr, weight decay, betas and eps; Adam (L2, coupled) or AdamW; one group
    maximizing (its parameters climb the loss); a LambdaLR stepping every step."""

    def __init__(self, kind: str, maximize: bool) -> None:
        super().__init__(lambda: TinyGPT())
        self.kind, self.maximize = kind, maximize

    def configure_optimizers(self) -> Any:
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        matrices = [p for n, p in named if p.ndim >= 2 and "blocks.1" not in n]
        second = [p for n, p in named if p.ndim >= 2 and "blocks.1" in n]
        vectors = [p for n, p in named if p.ndim < 2]
        groups = [
            {"params": matrices, "weight_decay": 0.1},
            {"params": second, "lr": 1e-3, "betas": (0.8, 0.95), "eps": 1e-6, "maximize": self.maximize},
            {"params": vectors, "weight_decay": 0.0, "lr": 5e-3, "betas": (0.5, 0.9)},
        ]
        cls = torch.optim.Adam if self.kind == "adam" else torch.optim.AdamW
        optimizer = cls(groups, lr=3e-3, weight_decay=0.01, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize(("kind", "maximize"), [("adam", False), ("adamw", True)])
def test_param_groups_schedule_and_maximize(kind: str, maximize: bool) -> None:
    """bf16-mixed, accumulation 3 over windows cut by the epoch end (3, 3, 1): "pipeline" and "next_forward" give the
    serial step's bits with a scheduler changing every group's lr at every step; "off" gives plain Lightning's
    losses and weights in 32-true."""
    make = lambda: GroupsLM(kind, maximize)  # noqa: E731
    serial, _, _, peek = _pair(make, max_epochs=2, accumulate_grad_batches=3)
    _pair(make, "next_forward", max_epochs=2, accumulate_grad_batches=3)
    assert peek.report is not None and peek.report.host_steps_in_backward > 0
    assert len(set(serial.recorder.lrs)) >= 5
    ref, _ = _run(make, None, precision="32-true", max_epochs=2, accumulate_grad_batches=3)
    got, _ = _run(make, "pipeline", precision="32-true", max_epochs=2, accumulate_grad_batches=3)
    assert got.recorder.lrs == ref.recorder.lrs
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (got.losses, ref.losses)
    assert_states_close(got.final, ref.final, what=f"{kind}, maximize={maximize}, against plain Lightning", atol=1e-5)


# ---- a changing accumulation, validation and checkpoints inside a window ----------------------------------------


@pytest.mark.parametrize("schedule", [{0: 1, 1: 3}, {0: 3, 1: 2}], ids=["1-then-3", "3-then-2"])
def test_accumulation_scheduler_changes_the_window(schedule: dict[int, int]) -> None:
    """``GradientAccumulationScheduler`` changes ``accumulate_grad_batches`` per epoch (the strategy sees only the
    first epoch's value at setup): the serial step's bits, and "off" is plain Lightning in 32-true."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def run(overlap: str | None, precision: str) -> tuple[FitResult, Peek]:
        sched = GradientAccumulationScheduler(scheduling=dict(schedule))
        return _run(_gpt(), overlap, precision=precision, max_epochs=2, callbacks=[sched])

    (serial, _), (piped, peek) = run("off", "bf16-mixed"), run("pipeline", "bf16-mixed")
    assert_runs_bitwise(piped, serial, "pipeline against off, accumulation scheduler")
    assert peek.report is not None and peek.report.host_step_jobs > 0
    (ref, _), (got, _) = run(None, "32-true"), run("pipeline", "32-true")
    assert got.trainer.global_step == ref.trainer.global_step
    assert_states_close(got.final, ref.final, what="accumulation scheduler against plain Lightning", atol=1e-5)


class SavesEveryBatch(L.Callback):
    """Saves a full checkpoint at the end of every batch (mid-window too: the sums of the window wait in the GRAD
    chunks) and reads the optimizer's state dict, as a logging callback would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.saves = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.path / f"b{self.saves}.ckpt")
        trainer.optimizers[0].state_dict()
        self.saves += 1


class ValLM(LM):
    """:class:`LM` around :class:`TinyGPT` with a one-batch validation set; the validation losses are kept."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.val_losses: list[float] = []

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = LM.training_step(self, batch, batch_idx)
        self.val_losses.append(float(loss))
        return loss

    def val_dataloader(self) -> DataLoader:
        return make_loader(n_seq=4, seed=7)


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_checkpoints_and_validation_inside_windows_change_nothing(tmp_path: Path, mode: str) -> None:
    """Accumulation 3, validation every 2 batches (inside windows, the warm-up's first window included) and a
    checkpoint plus an optimizer ``state_dict()`` after every batch: bitwise the serial run that does none of it."""
    serial, _ = _run(_gpt(), "off", max_epochs=2, accumulate_grad_batches=3)
    validated, _ = _run(ValLM, "off", max_epochs=2, accumulate_grad_batches=3, val_check_interval=2)
    saver = SavesEveryBatch(tmp_path)
    piped, peek = _run(ValLM, mode, max_epochs=2, accumulate_grad_batches=3, callbacks=[saver], val_check_interval=2)
    assert saver.saves == 14 and len(piped.module.val_losses) >= 6
    assert piped.module.val_losses == validated.module.val_losses
    assert_runs_bitwise(validated, serial, "off with validation inside windows against off without")
    assert_runs_bitwise(piped, serial, f"{mode} with saves and validation inside windows against plain off")
    assert peek.report is not None and peek.report.host_step_jobs > 0


# ---- non-finite micro-batches inside a window -------------------------------------------------------------------


class Blows(nn.Module):
    """:class:`TinyGPT` whose logits are multiplied by ``factor`` on the training calls in ``at`` (counting from 0):
    in 16-mixed that overflows to inf; with ``factor`` inf every precision gets a non-finite loss there."""

    def __init__(self, at: set[int], factor: float) -> None:
        super().__init__()
        self.gpt = TinyGPT()
        self.at, self.factor, self.calls = at, factor, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls - 1 in self.at:
                logits = logits * self.factor
        return logits


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_16_mixed_overflow_in_a_middle_micro_batch(mode: str) -> None:
    """16-mixed, accumulation 3: micro-batches 4 and 10 (the middle of windows 1 and 3) overflow; their windows'
    steps are skipped and the scale backs off, the other windows step through the pipeline: the serial step's bits."""
    scale = LossScaleConfig(initial_scale=2.0**12, growth_interval=1000)
    _, piped, speek, peek = _pair(
        lambda: LM(lambda: Blows({4, 10}, 1e5)),
        mode,
        precision="16-mixed",
        n_seq=4 * 15,
        accumulate_grad_batches=3,
        loss_scale=scale,
    )
    assert peek.skipped == 2 == speek.skipped
    assert piped.trainer.precision_plugin.scale == 2.0**10  # type: ignore[attr-defined]
    assert peek.report is not None and peek.report.host_step_jobs >= 3 * (peek.families - 1) > 0


@pytest.mark.parametrize("where", [0, 1], ids=["first-micro-batch", "last-micro-batch"])
def test_bf16_nonfinite_skip_inside_a_window(where: int) -> None:
    """bf16-mixed with ``nonfinite="skip"``, accumulation 2: an inf loss in one micro-batch of window 2 skips that
    window's step (the armed step inside the backward must not start for the finite last micro-batch either); the
    next windows step through the pipeline; the serial step's bits."""
    at = {4 + where}
    _, _, speek, peek = _pair(
        lambda: LM(lambda: Blows(at, float("inf"))),
        n_seq=4 * 12,
        accumulate_grad_batches=2,
        options={"nonfinite": "skip"},
    )
    for p in (speek, peek):
        assert p.report is not None and p.report.nonfinite_skipped_steps == 1, p.report
    assert peek.report is not None and peek.report.host_steps_in_backward > 0


# ---- tight device budgets and the disk tier ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
@pytest.mark.parametrize("limit", ["300KiB", "400KiB"])
def test_tight_budget_evicts_inside_windows(limit: str, mode: str) -> None:
    """A device budget that evicts param chunks during every micro-batch of a window of 3 (windows cut by the epoch
    end): the serial step's bits; some families still pipelined."""
    _, _, speek, peek = _pair(
        _gpt(unused=True), mode, max_epochs=2, accumulate_grad_batches=3, options={"device_memory_limit": limit}
    )
    assert speek.report is not None and speek.report.evictions > 0
    assert peek.report is not None and peek.report.evictions > 0 and peek.report.host_step_jobs > 0


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_disk_tier_with_accumulation(tmp_path: Path, mode: str) -> None:
    """Some families' masters and Adam states on disk, the rest on the host, accumulation 2 in bf16-mixed with
    windows cut by the epoch end: the serial step's bits, and the run directories are gone after."""
    runs = []
    for overlap in ("off", mode):
        disk = tmp_path / overlap
        disk.mkdir()
        options = {"device_memory_limit": "64MiB", "host_memory_limit": "640KiB", "disk_path": str(disk)}
        runs.append(_run(_gpt(), overlap, max_epochs=2, accumulate_grad_batches=2, options=options))
        assert list(disk.iterdir()) == []
    (serial, _), (piped, peek) = runs
    assert_runs_bitwise(piped, serial, f"{mode} against off, disk tier")
    assert peek.report is not None and 0 < peek.report.disk_families < peek.families
    assert peek.report.host_step_jobs > 0


# ---- resume -------------------------------------------------------------------------------------------------------


def test_resume_at_an_epoch_end_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """bf16-mixed, accumulation 2 over windows 2, 2, 2, 1: "pipeline" trains one epoch, saves (ModelCheckpoint at the
    epoch end), and a fresh "pipeline" run resumes to epoch 3: bitwise the uninterrupted "off" run's last two
    epochs (losses, weights, optimizer states)."""
    full, _ = _run(_gpt(), "off", max_epochs=3, accumulate_grad_batches=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    _run(_gpt(), "pipeline", max_epochs=1, accumulate_grad_batches=2, callbacks=[ckpt], enable_checkpointing=True)
    path = tmp_path / "epoch=0.ckpt"
    assert path.is_file()
    resumed, peek = _run(_gpt(), "pipeline", max_epochs=3, accumulate_grad_batches=2, ckpt_path=str(path))
    assert peek.report is not None and peek.report.host_steps_in_backward > 0
    assert resumed.trainer.global_step == full.trainer.global_step == 12
    assert resumed.losses == full.losses[7:]
    assert_states_equal(resumed.final, full.final, what="resumed pipeline against uninterrupted off: weights")
    assert_states_equal(optimizer_state(resumed), optimizer_state(full), what="resumed: optimizer states")


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_resume_from_a_mid_epoch_step_checkpoint(tmp_path: Path, mode: str) -> None:
    """Checkpoints every 3 optimizer steps (mid-epoch, before the epoch's short window) written by ``mode`` and by
    "off" are bitwise the same, and resuming each (under its own mode) gives bitwise the same run."""
    paths = {}
    for overlap in ("off", mode):
        ckpt = ModelCheckpoint(dirpath=tmp_path / overlap, every_n_train_steps=3, save_top_k=-1, filename="{step}")
        _run(_gpt(), overlap, max_epochs=2, accumulate_grad_batches=2, callbacks=[ckpt], enable_checkpointing=True)
        paths[overlap] = tmp_path / overlap / "step=3.ckpt"
    a, b = (torch.load(paths[k], weights_only=True) for k in ("off", mode))
    assert_states_equal(b["state_dict"], a["state_dict"], what="step=3 weights")
    for index, state in a["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.equal(b["optimizer_states"][0]["state"][index][key], value), (index, key)
    serial, _ = _run(_gpt(), "off", max_epochs=2, accumulate_grad_batches=2, ckpt_path=str(paths["off"]))
    piped, peek = _run(_gpt(), mode, max_epochs=2, accumulate_grad_batches=2, ckpt_path=str(paths[mode]))
    assert serial.trainer.global_step == 8 and len(serial.losses) > 0
    _bitwise(piped, serial, f"resumed {mode} against resumed off")
    assert peek.report is not None and peek.report.host_step_jobs > 0


# ---- two optimizers, manual accumulation ---------------------------------------------------------------------


class Gan(nn.Module):
    """A generator (an embedding and an MLP producing logits) and a critic scoring logits."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = TinyGPT()
        self.critic = nn.Sequential(nn.Linear(VOCAB, N_EMBD), nn.GELU(), nn.Linear(N_EMBD, 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gen(idx)


class GanLM(LM):
    """Manual optimization with two optimizers, each accumulating over ``accumulate`` batches by hand
    (``manual_backward`` on every batch, ``step``/``zero_grad`` every ``accumulate``-th): the generator trains on
    the LM loss plus the critic's score of its logits, the critic on that score of detached logits against the
    one-hot targets."""

    def __init__(self, accumulate: int) -> None:
        super().__init__(Gan)
        self.automatic_optimization = False
        self.accumulate = accumulate

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt_g, opt_c = self.optimizers()  # type: ignore[misc]
        x, y = batch
        net: Gan = self.net  # type: ignore[assignment]
        last = (batch_idx + 1) % self.accumulate == 0
        logits = net(x)
        g_loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        g_loss = g_loss - 0.1 * net.critic(logits.float().softmax(-1)).float().mean()
        self.toggle_optimizer(opt_g)
        self.manual_backward(g_loss / self.accumulate)
        if last:
            opt_g.step()
            opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_c)
        real = F.one_hot(y, VOCAB).float()
        fake = logits.detach().float().softmax(-1)
        c_loss = net.critic(fake).float().mean() - net.critic(real).float().mean()
        self.manual_backward(c_loss / self.accumulate)
        if last:
            opt_c.step()
            opt_c.zero_grad()
        self.untoggle_optimizer(opt_c)
        return g_loss.detach()

    def configure_optimizers(self) -> Any:
        net: Gan = self.net  # type: ignore[assignment]
        gen = [p for p in net.gen.parameters() if p.requires_grad]
        return (
            torch.optim.AdamW(gen, lr=3e-3, weight_decay=0.1, fused=True),
            torch.optim.Adam(net.critic.parameters(), lr=1e-3, betas=(0.5, 0.9), fused=True),
        )


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_two_optimizers_manual_accumulation(mode: str) -> None:
    """GAN-like manual optimization, each optimizer accumulating 3 batches by hand: the serial step's bits (both
    optimizers' states), some families pipelined; and "off" is plain Lightning in 32-true."""
    make = lambda: GanLM(3)  # noqa: E731
    serial, piped, _, peek = _pair(make, mode, n_seq=4 * 9, max_steps=-1)
    assert peek.report is not None and peek.report.host_step_jobs > 0
    critic = {k: v for k, v in serial.trainer.optimizers[1].state_dict()["state"].items()}
    got = piped.trainer.optimizers[1].state_dict()["state"]
    for index, state in critic.items():
        for key, value in state.items():
            assert torch.equal(got[index][key], value), (index, key)
    assert {float(s["step"]) for s in critic.values()} == {3.0}
    ref, _ = _run(make, None, precision="32-true", n_seq=4 * 9)
    off, _ = _run(make, "off", precision="32-true", n_seq=4 * 9)
    for a, b in zip(off.losses, ref.losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (off.losses, ref.losses)
    assert_states_close(off.final, ref.final, what="two optimizers against plain Lightning", atol=1e-5)


# ---- Fabric loops ---------------------------------------------------------------------------------------------


def _fabric_loop(
    overlap: str | None,
    *,
    declared: bool | str,
    clip: str | None,
    accumulate: int = 3,
    steps: int = 4,
    eval_mid: bool = False,
    precision: str = "bf16-mixed",
) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """A hand-written Fabric loop in bf16-mixed: ``accumulate`` micro-batches a step, inside
    ``fabric.no_backward_sync(model, enabled=...)`` when ``declared`` (else plain backwards, as a user who never
    heard of it writes), clipping by ``clip`` between the last backward and the step, an LR step schedule and an
    evaluation forward after every step. Returns losses, evaluation losses, final weights, the optimizer state
    (flat) and the strategy."""
    from lightning.fabric import Fabric

    strategy: Any = "auto"
    if overlap is not None:
        strategy = PatrickStarFabricStrategy(optimizer_overlap=overlap, **HOST)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)  # type: ignore[arg-type]
    return fabric.launch(_fabric_body, declared, clip, accumulate, steps, eval_mid)


def _fabric_body(
    fabric: Any, declared: bool | str, clip: str | None, accumulate: int, steps: int, eval_mid: bool
) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    from lightning_pstar.checkpoint import full_state_dict

    torch.manual_seed(1234)
    net = TinyGPT()
    decay = [p for p in net.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in net.parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2)
    model, opt = fabric.setup(net, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    batches = iter(list(make_loader(n_seq=4 * accumulate * steps)))
    held_out = next(iter(make_loader(n_seq=4, seed=7)))
    losses, evals = [], []
    for _ in range(steps):
        for micro in range(accumulate):
            x, y = next(batches)
            enabled = declared == "all" or (bool(declared) and micro < accumulate - 1)
            with fabric.no_backward_sync(model, enabled=enabled):
                loss = F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))
                fabric.backward(loss / accumulate)
            losses.append(float(loss.detach()))
            if eval_mid and micro < accumulate - 1:  # an evaluation between two micro-batches of a window
                with torch.no_grad():
                    x, y = held_out
                    evals.append(float(F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))))
        if clip == "norm":
            fabric.clip_gradients(model, opt, max_norm=0.05)
        elif clip == "value":
            fabric.clip_gradients(model, opt, clip_val=0.01)
        opt.step()
        opt.zero_grad()
        sched.step()
        with torch.no_grad():
            x, y = held_out
            evals.append(float(F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))))
    if isinstance(fabric.strategy, PatrickStarFabricStrategy):
        state = full_state_dict(fabric.strategy.chunk_manager)
    else:
        state = fabric.strategy.get_module_state_dict(model._forward_module)
    weights = {k: v.detach().float().cpu().clone() for k, v in state.items()}
    opt_state = {f"{i}/{k}": v for i, e in opt.state_dict()["state"].items() for k, v in e.items()}
    return losses, evals, weights, opt_state, fabric.strategy


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
@pytest.mark.parametrize(
    ("declared", "clip"),
    [(True, "norm"), (True, "value"), (False, None), (False, "norm"), ("all", None), ("all", "norm")],
)
def test_fabric_accumulation(declared: bool | str, clip: str | None, mode: str) -> None:
    """Fabric, bf16-mixed, accumulation 3 with or without ``no_backward_sync`` (without it every backward's gradient
    lands in the param slot and the next micro-batch carries it into the fp32 sum; "all": the last micro-batch inside
    it too, so the step reads the fp32 sums alone), clipping between backward and
    step, evaluation between steps: the serial step's bits."""
    losses, evals, weights, states, _ = _fabric_loop("off", declared=declared, clip=clip)
    got_losses, got_evals, got_weights, got_states, strategy = _fabric_loop(mode, declared=declared, clip=clip)
    report = strategy.memory_report()
    assert report.host_step_jobs > 0, report
    assert got_losses == losses and got_evals == evals
    assert_states_equal(got_weights, weights, what=f"Fabric {mode}: weights")
    assert_states_equal(got_states, states, what=f"Fabric {mode}: optimizer states")


# ---- found broken by this file, fixed since (each was a strict xfail naming what went wrong) ---------------------


class InnerMicroBatches(LM):
    """Manual optimization that accumulates inside one ``training_step``: the batch split in two, a forward and a
    ``manual_backward(loss / 2)`` on each half, then one ``step()`` (what the engine's own HINT in
    ``_refuse_sum_across_steps`` recommends: "several ``manual_backward`` calls"; Fabric runs this loop fine)."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        total = torch.zeros(())
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = F.cross_entropy(self(xs).reshape(-1, VOCAB).float(), ys.reshape(-1))
            self.manual_backward(loss / 2)
            total = total + loss.detach() / 2
        opt.step()  # type: ignore[union-attr]
        opt.zero_grad()  # type: ignore[union-attr]
        return total


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_manual_accumulation_inside_one_training_step(precision: str) -> None:
    ref, _ = _run(InnerMicroBatches, None, precision=precision, n_seq=16)
    got, _ = _run(InnerMicroBatches, "off", precision=precision, n_seq=16)
    if precision == "32-true":
        for a, b in zip(got.losses, ref.losses, strict=True):
            assert abs(a - b) <= RTOL * abs(b), (got.losses, ref.losses)
        assert_states_close(got.final, ref.final, what="accumulation inside a training_step", atol=1e-5)
    _pair(InnerMicroBatches, precision=precision, n_seq=16)


class GanWithoutToggles(GanLM):
    """:class:`GanLM` without ``toggle_optimizer``: the generator's backward also gives the critic gradients (as
    plain PyTorch sums them into its ``p.grad``), then the critic runs its own forward before its step."""

    def toggle_optimizer(self, optimizer: Any) -> None:
        pass

    def untoggle_optimizer(self, optimizer: Any) -> None:
        pass


@pytest.mark.parametrize("accumulate", [1, 3])
def test_gan_without_toggles(accumulate: int) -> None:
    """The same missing carry-over as test_manual_accumulation_inside_one_training_step, without any accumulation."""
    ref, _ = _run(lambda: GanWithoutToggles(accumulate), None, precision="32-true", n_seq=4 * 6)
    got, _ = _run(lambda: GanWithoutToggles(accumulate), "off", precision="32-true", n_seq=4 * 6)
    assert_states_close(got.final, ref.final, what="GAN without toggles against plain Lightning", atol=1e-5)


class Unfreezes(L.Callback):
    """Unfreezes ``net.frozen`` (in the optimizer from the start: ``LM(all_params=True)``) at batch 2, as a
    progressive-unfreezing fine-tune does without adding a param group."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == 2:
            pl_module.net.frozen.requires_grad_(True)  # type: ignore[union-attr]


def test_unfreezing_a_parameter_already_in_the_optimizer() -> None:
    """32-true, no accumulation, "off": the smallest case. Plain Lightning moves the unfrozen weight by ~1.5e-2;
    PatrickStar must train it the same way or refuse, not leave it at its initial value."""
    make = lambda: LM(lambda: TinyGPT(), all_params=True)  # noqa: E731
    ref, _ = _run(make, None, precision="32-true", callbacks=[Unfreezes()])
    name = "net.frozen.weight"
    assert not torch.equal(ref.final[name], ref.recorder.initial_state[name])
    # the engine lays out chunks for the parameters trainable at setup: refused at the step, naming the parameter
    with pytest.raises(RuntimeError, match=r"'net\.frozen\.weight'.*requires_grad=False when the strategy set up"):
        _run(make, "off", precision="32-true", callbacks=[Unfreezes()])


# ---- more placements and model shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "make", "options", "n_seq"),
    [
        ("split-optimizer", _gpt(), {"optimizer_placement": "auto", "device_memory_limit": "600KiB"}, 28),
        ("cpu-embedding", lambda: LM(lambda: Routed(3)), {"cpu_embedding": True}, 28),
        ("reentrant-checkpointing", lambda: LM(lambda: CheckpointedGPT(True)), {}, 28),
        ("non-reentrant-checkpointing", lambda: LM(lambda: CheckpointedGPT(False)), {}, 28),
        ("ragged-last-batch", _gpt(reuse_block=True), {}, 26),
    ],
)
def test_more_shapes_with_accumulation(name: str, make: Callable[[], LM], options: dict[str, Any], n_seq: int) -> None:
    """bf16-mixed, accumulation 3 over two epochs: optimizer states split between the device and the host by a
    budget; an embedding kept on the host (stepped beside the chunks); activation checkpointing recomputing blocks
    inside the backward that steps; a last batch of 2 sequences instead of 4 ending each epoch's short window."""
    modes = ("pipeline",) if name == "split-optimizer" else ("pipeline", "next_forward")  # next_forward: a BUG below
    for mode in modes:
        _, _, _, peek = _pair(make, mode, n_seq=n_seq, max_epochs=2, accumulate_grad_batches=3, options=options)
        assert peek.report is not None and peek.report.host_step_jobs > 0, name
        if name == "split-optimizer":
            assert peek.report.optimizer_tier.startswith("device for"), peek.report.optimizer_tier


def test_auto_times_schedules_inside_accumulation_windows() -> None:
    """ "auto" takes turns of the pipelined, serial and tail schedules (timing them) through windows of 2 in
    bf16-mixed: the serial step's bits, and every schedule ran."""
    from lightning_pstar.optim.overlap import SETTLE_STEPS, TRIALS

    steps = 1 + 1 + SETTLE_STEPS + 6 * TRIALS + 2
    _, _, _, peek = _pair(_gpt(), "auto", n_seq=4 * 2 * steps, accumulate_grad_batches=2)
    assert peek.report is not None
    assert set(peek.report.schedule_trial_ms) == {"pipeline", "serial", "next_forward"}
    assert peek.report.host_steps_in_backward > 0


@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_16_mixed_overflow_and_clipping_on_epoch_cut_windows(clip: str | None) -> None:
    """16-mixed, windows 3, 3, 1 over two epochs, an overflow in the last micro-batch of the short window of epoch 0
    (micro-batch 6) and in the first of epoch 1's second window (10), with clipping: the serial step's bits."""
    kwargs: dict[str, Any] = {}
    if clip is not None:
        kwargs = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": clip}
    _, _, _, peek = _pair(
        lambda: LM(lambda: Blows({6, 10}, 1e5)),
        precision="16-mixed",
        max_epochs=2,
        accumulate_grad_batches=3,
        loss_scale=LossScaleConfig(initial_scale=2.0**12),
        **kwargs,
    )
    assert peek.skipped == 2
    assert peek.report is not None and peek.report.host_step_jobs > 0


@pytest.mark.parametrize(("precision", "limit"), [("bf16-mixed", "600KiB"), ("32-true", "1MiB")])
def test_next_forward_with_the_optimizer_split_by_a_budget(precision: str, limit: str) -> None:
    """No accumulation needed: the smallest case. "pipeline" passes the same run (test_more_shapes_with_accumulation,
    and test_step_pipeline_adversarial.py::test_device_budget_splits_the_optimizer)."""
    options = {"optimizer_placement": "auto", "device_memory_limit": limit}
    _pair(_gpt(), "next_forward", precision=precision, n_seq=24, options=options)


class ManualValLM(ValLM):
    """Manual accumulation across batches (``manual_backward(loss / 3)`` every batch, a step every third), the
    pattern the engine carries gradients over for ([Note: gradients land per family], ``GradStore.carry_over``),
    with validation after every batch (``val_check_interval=1``): inside windows."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = LM.training_step(self, batch, batch_idx)
        self.manual_backward(loss / 3)
        if batch_idx % 3 == 2:
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad()  # type: ignore[union-attr]
        return loss.detach()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_validation_inside_a_manual_accumulation_window(precision: str) -> None:
    ref, _ = _run(ManualValLM, None, precision=precision, n_seq=24, val_check_interval=1)
    got, _ = _run(ManualValLM, "off", precision=precision, n_seq=24, val_check_interval=1)
    assert len(got.module.val_losses) == len(ref.module.val_losses) == 6
    if precision == "32-true":
        for a, b in zip(got.module.val_losses, ref.module.val_losses, strict=True):
            assert abs(a - b) <= RTOL * abs(b)
        assert_states_close(got.final, ref.final, what="manual accumulation with validation", atol=1e-5)
    _pair(ManualValLM, precision=precision, n_seq=24, val_check_interval=1)


def test_fabric_evaluation_between_undeclared_micro_batches() -> None:
    """With ``no_backward_sync`` (gradients summed in fp32, the slots keep the weights) the same loop passes: see
    test_fabric_evaluation_between_declared_micro_batches."""
    want = _fabric_loop("off", declared=False, clip=None, eval_mid=True)
    got = _fabric_loop("pipeline", declared=False, clip=None, eval_mid=True)
    assert got[0] == want[0] and got[1] == want[1]


def test_fabric_evaluation_between_declared_micro_batches() -> None:
    """Fabric, bf16-mixed, ``no_backward_sync`` micro-batches with a no-grad evaluation between them: "pipeline" is
    the serial step's bits, and the evaluation losses are those of the weights of the window (as plain Fabric's
    within bf16's rounding)."""
    losses, evals, weights, states, _ = _fabric_loop("off", declared=True, clip=None, eval_mid=True)
    got = _fabric_loop("pipeline", declared=True, clip=None, eval_mid=True)
    assert got[0] == losses and got[1] == evals
    assert_states_equal(got[2], weights, what="Fabric eval between micro-batches: weights")
    assert_states_equal(got[3], states, what="Fabric eval between micro-batches: optimizer states")
    assert got[4].memory_report().host_step_jobs > 0
    ref = _fabric_loop(None, declared=True, clip=None, eval_mid=True)
    assert len(ref[1]) == len(evals) == 12
    for a, b in zip(evals, ref[1], strict=True):
        assert abs(a - b) <= 2e-2 * abs(b), (evals, ref[1])


# ---- a refused step, micro-batches without any gradient ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["off", "pipeline", "next_forward"])
def test_nonfinite_raise_inside_a_window_leaves_the_last_steps_weights(mode: str) -> None:
    """bf16-mixed, accumulation 2, the default ``nonfinite="raise"``: an inf loss in the last micro-batch of window 2
    (after the pipeline stepped windows 0 and 1 inside their backwards) raises ``NonFiniteStepError``, and the
    module's weights are those after 2 steps, as the error says, whatever the schedule."""
    from lightning_pstar.optim.optimizer import NonFiniteStepError

    made: list[LM] = []

    def make() -> LM:
        made.append(LM(lambda: Blows({5}, float("inf"))))
        return made[-1]

    with pytest.raises(NonFiniteStepError, match="optimizer step 2"):
        _run(make, mode, n_seq=4 * 12, accumulate_grad_batches=2)
    after = {k: v.float() for k, v in made[0].state_dict().items()}
    two, _ = _run(
        lambda: LM(lambda: Blows({5}, float("inf"))), "off", n_seq=4 * 12, accumulate_grad_batches=2, max_steps=2
    )
    assert two.trainer.global_step == 2
    assert_states_equal(after, two.final, what=mode)


class Detaches(nn.Module):
    """:class:`TinyGPT` whose logits are detached (no parameter gets a gradient; the loss still has a graph through
    a scalar ``knob``, kept out of the optimizer) on the training calls in ``at``."""

    def __init__(self, at: set[int]) -> None:
        super().__init__()
        self.gpt = TinyGPT()
        self.at, self.calls = at, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls - 1 in self.at:
                logits = logits.detach().requires_grad_()
        return logits


@pytest.mark.parametrize(
    ("at", "name"), [({2, 5, 8}, "last-of-each-window"), ({0, 3, 6}, "first-of-each-window"), ({3, 4, 5}, "a-window")]
)
def test_micro_batches_without_any_parameter_gradient(at: set[int], name: str) -> None:
    """Accumulation 3 where some micro-batches give no parameter a gradient: a window whose last micro-batch gives
    none steps on the fp32 sums alone (nothing lands in the param slots), one whose first gives none on the slot
    plus the second's sum; a window with none at all does not step. The serial step's bits, both schedules."""
    for mode in ("pipeline", "next_forward"):
        serial, _, _, peek = _pair(lambda: LM(lambda: Detaches(at)), mode, n_seq=4 * 12, accumulate_grad_batches=3)
        assert peek.report is not None and peek.report.host_step_jobs > 0
    steps = {s for s in _steps_of(serial).values()}
    assert steps == ({3.0} if name == "a-window" else {4.0}), steps


@pytest.mark.parametrize("kind", ["loop", "rnn", "twice", "functional"])
@pytest.mark.parametrize("chunk_size", [1100, 4096])
def test_parameters_used_several_times_with_accumulation(kind: str, chunk_size: int) -> None:
    """A Linear applied four times, an RNN cell stepped over the sequence, a Linear called twice around another, an
    embedding weight read by ``F.linear`` outside its module: accumulation 3 in bf16-mixed over windows cut by the
    epoch end, a family per layer or one for several: the serial step's bits, both schedules. (With one family for
    several layers a layer the kind does not use leaves a record without a gradient: that family steps serially.)"""
    for mode in ("pipeline", "next_forward"):
        _, _, _, peek = _pair(
            lambda: LM(lambda: MultiUse(kind)),
            mode,
            max_epochs=2,
            accumulate_grad_batches=3,
            options={"chunk_size": chunk_size},
        )
        assert peek.report is not None
        if chunk_size == 1100 or kind == "functional":  # with 4096 the unused layers (RNN cell, ...) share every
            assert peek.report.host_step_jobs > 0  # family of "loop", "rnn", "twice": a record without a gradient


class FreezesABlock(L.Callback):
    """Freezes ``net.blocks.1`` at batch 4 (inside the second window of 3), as a fine-tune that stops training a
    layer does: from there on its parameters get no gradient and must not step."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == 4:
            pl_module.net.blocks[1].requires_grad_(False)  # type: ignore[index,union-attr]


def test_freezing_a_block_mid_run_with_accumulation() -> None:
    """bf16-mixed, accumulation 3: the block's families keep the sums of micro-batch 3 and get nothing after, so its
    parameters step once more (window 1) and then stay: the serial step's bits; "off" is plain Lightning's run in
    32-true (the same step counts too)."""
    for mode in ("pipeline", "next_forward"):
        _, _, _, peek = _pair(_gpt(), mode, n_seq=4 * 12, accumulate_grad_batches=3, callbacks=[FreezesABlock()])
        assert peek.report is not None and peek.report.host_step_jobs > 0
    ref, _ = _run(
        _gpt(), None, precision="32-true", n_seq=4 * 12, accumulate_grad_batches=3, callbacks=[FreezesABlock()]
    )
    got, _ = _run(
        _gpt(), "off", precision="32-true", n_seq=4 * 12, accumulate_grad_batches=3, callbacks=[FreezesABlock()]
    )
    assert _steps_of(got) == _steps_of(ref) and set(_steps_of(ref).values()) == {2.0, 4.0}
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (got.losses, ref.losses)
    assert_states_close(got.final, ref.final, what="a block frozen mid-run against plain Lightning", atol=1e-5)


class TensorLrLM(LM):
    """AdamW with a tensor learning rate that an ExponentialLR scheduler changes in place every step."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=torch.tensor(3e-3), fused=True)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_tensor_learning_rate_changed_in_place_by_the_schedule() -> None:
    """A tensor ``lr`` (the scheduler writes it in place after each step, while "next_forward"'s tail still runs):
    the jobs read their step's value, the serial step's bits; "off" is plain Lightning in 32-true."""
    for mode in ("pipeline", "next_forward"):
        _, _, _, peek = _pair(TensorLrLM, mode, n_seq=24, accumulate_grad_batches=2)
        assert peek.report is not None and peek.report.host_steps_in_backward > 0
    ref, _ = _run(TensorLrLM, None, precision="32-true", n_seq=24, accumulate_grad_batches=2)
    got, _ = _run(TensorLrLM, "off", precision="32-true", n_seq=24, accumulate_grad_batches=2)
    assert got.recorder.lrs == ref.recorder.lrs and len(set(ref.recorder.lrs)) == 4  # 3 steps of 2, recorded per batch
    assert_states_close(got.final, ref.final, what="tensor lr against plain Lightning", atol=1e-5)


class SelfDistillLM(LM):
    """Each training step first runs the model without autograd on a shifted batch (a teacher pass, as
    self-distillation does), then trains on cross entropy plus the KL divergence to those logits."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            teacher = self(x.roll(1, dims=1)).float().log_softmax(-1)
        logits = self(x).float()
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        kl = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="batchmean")
        return ce + 0.1 * kl


def test_no_grad_teacher_pass_inside_each_micro_batch() -> None:
    """A forward without autograd inside every training step (after "next_forward"'s tail, before the backward that
    steps inside itself): the serial step's bits; "off" is plain Lightning in 32-true."""
    for mode in ("pipeline", "next_forward"):
        _, _, _, peek = _pair(SelfDistillLM, mode, max_epochs=2, accumulate_grad_batches=3)
        assert peek.report is not None and peek.report.host_steps_in_backward > 0
    ref, _ = _run(SelfDistillLM, None, precision="32-true", accumulate_grad_batches=3)
    got, _ = _run(SelfDistillLM, "off", precision="32-true", accumulate_grad_batches=3)
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (got.losses, ref.losses)
    assert_states_close(got.final, ref.final, what="self-distillation against plain Lightning", atol=1e-5)


class ReturnsNoneSometimes(LM):
    """``training_step`` returns None (no backward for that micro-batch) when ``batch_idx % k == r``."""

    def __init__(self, k: int, r: int) -> None:
        super().__init__(lambda: TinyGPT())
        self.k, self.r = k, r

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % self.k == self.r else loss


def _fit_skipping(overlap: str | None, precision: str, accumulate: int, k: int, r: int) -> tuple[Any, ...]:
    """Weights, flat optimizer state, peek and optimizer steps of one epoch of :class:`ReturnsNoneSometimes`."""
    from tests.helpers.runs import make_trainer

    peek = Peek()
    strategy: Any = "auto" if overlap is None else PatrickStarStrategy(optimizer_overlap=overlap, **HOST)
    trainer = make_trainer(
        strategy=strategy,
        precision=precision,
        max_steps=-1,
        max_epochs=1,
        callbacks=[peek],
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(ReturnsNoneSometimes(k, r), make_loader(n_seq=48))
    weights = {n: v.detach().float().clone() for n, v in trainer.strategy.lightning_module_state_dict().items()}
    states = {f"{i}/{n}": v for i, e in trainer.optimizers[0].state_dict()["state"].items() for n, v in e.items()}
    return weights, states, peek, trainer.global_step


@pytest.mark.parametrize(
    ("accumulate", "k", "r"),
    [(2, 3, 1), (3, 3, 2), (3, 3, 0)],
    ids=["some-last-micro-batches", "every-last-micro-batch", "every-first-micro-batch"],
)
def test_micro_batches_skipped_by_returning_none(accumulate: int, k: int, r: int) -> None:
    """Lightning runs no backward for a micro-batch whose ``training_step`` returns None, but still steps at the
    window's end: a window whose last micro-batch was skipped steps on the fp32 sums of the others alone (no
    gradient in any param slot). bf16-mixed: the serial step's bits; 32-true: "off" is plain Lightning."""
    weights, states, _, steps = _fit_skipping("off", "bf16-mixed", accumulate, k, r)
    for mode in ("pipeline", "next_forward"):
        got_weights, got_states, peek, got_steps = _fit_skipping(mode, "bf16-mixed", accumulate, k, r)
        assert got_steps == steps == 12 // accumulate
        assert_states_equal(got_weights, weights, what=f"{mode}: weights")
        assert_states_equal(got_states, states, what=f"{mode}: optimizer states")
        assert peek.report is not None and peek.report.host_step_jobs > 0
    ref = _fit_skipping(None, "32-true", accumulate, k, r)
    got = _fit_skipping("off", "32-true", accumulate, k, r)
    assert_states_close(got[0], ref[0], what="skipped micro-batches against plain Lightning", atol=1e-5)


class ManualAcrossEpochs(LM):
    """Manual accumulation that steps every third batch of an epoch (``batch_idx % 3 == 2``): with 7 batches an epoch
    the last batch's gradients are not stepped, nor zeroed, and join the next epoch's first window (4 backwards
    summed, as plain PyTorch sums ``p.grad``)."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = LM.training_step(self, batch, batch_idx)
        self.manual_backward(loss / 3)
        if batch_idx % 3 == 2:
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad()  # type: ignore[union-attr]
        return loss.detach()


def test_manual_accumulation_carried_across_an_epoch_end() -> None:
    """bf16-mixed: the serial step's bits, some families pipelined; 32-true: "off" is plain Lightning."""
    for mode in ("pipeline", "next_forward"):
        _, piped, _, peek = _pair(ManualAcrossEpochs, mode, max_epochs=2)
        assert peek.report is not None and peek.report.host_step_jobs > 0
        assert piped.trainer.optimizers[0].state_dict()["state"][0]["step"] == 4
    ref, _ = _run(ManualAcrossEpochs, None, precision="32-true", max_epochs=2)
    got, _ = _run(ManualAcrossEpochs, "off", precision="32-true", max_epochs=2)
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (got.losses, ref.losses)
    assert_states_close(got.final, ref.final, what="manual accumulation across an epoch end", atol=1e-5)


def _two_phase_fine_tune(
    overlap: str | None, precision: str, peek: Peek | None = None
) -> tuple[FitResult, FitResult, dict[str, torch.Tensor]]:
    """What the engine's HINT for unfreezing recommends: a ``fit`` with ``net.blocks.0`` frozen, then a second ``fit``
    of the same module (a new Trainer and strategy) with it trainable; accumulation 2 in both. Returns both runs
    and the module's own state after the second."""
    from tests.helpers.runs import fit as fit_module

    module = LM(lambda: TinyGPT())
    module.net.blocks[0].requires_grad_(False)  # type: ignore[index]
    runs = []
    for phase, seed in enumerate((4321, 9)):
        if phase == 1:
            module.net.blocks[0].requires_grad_(True)  # type: ignore[index]
        strategy: Any = "auto" if overlap is None else PatrickStarStrategy(optimizer_overlap=overlap, **HOST)
        runs.append(
            fit_module(
                module,
                strategy=strategy,
                loader=make_loader(n_seq=24, seed=seed),
                precision=precision,
                max_steps=-1,
                max_epochs=1,
                accumulate_grad_batches=2,
                callbacks=[peek] if peek is not None and phase == 1 else [],
            )
        )
    state = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    return runs[0], runs[1], state


def test_two_phase_fine_tune_with_accumulation() -> None:
    """bf16-mixed: "pipeline" gives "off"'s bits in both phases and in the module handed back; 32-true: "off" gives
    plain Lightning's; the block frozen in phase 1 moves in phase 2 only."""
    first, second, state = _two_phase_fine_tune("off", "bf16-mixed")
    peek = Peek()
    got_first, got_second, got_state = _two_phase_fine_tune("pipeline", "bf16-mixed", peek)
    assert peek.report is not None and peek.report.host_steps_in_backward > 0
    _bitwise(got_first, first, "phase 1")
    _bitwise(got_second, second, "phase 2")
    assert_states_equal(got_state, state, what="the module after both phases")
    name = "net.blocks.0.mlp.fc.weight"
    assert torch.equal(first.final[name], first.recorder.initial_state[name])
    assert not torch.equal(second.final[name], second.recorder.initial_state[name])
    ref = _two_phase_fine_tune(None, "32-true")
    got = _two_phase_fine_tune("off", "32-true")
    assert_states_close(got[2], ref[2], what="two-phase fine-tune against plain Lightning", atol=1e-5)


# ---- mixed precision against plain Lightning: the direction of the update -----------------------------------------


class ScalesAMicroBatch(LM):
    """:class:`LM` whose loss is multiplied by ``factor`` on the micro-batches with ``batch_idx % 3 == which`` (0:
    that micro-batch dropped, 2: counted twice): what a lost or doubled gradient part would look like."""

    def __init__(self, which: int = 2, factor: float = 1.0) -> None:
        super().__init__(lambda: TinyGPT())
        self.which, self.factor = which, factor

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * self.factor if batch_idx % 3 == self.which else loss


def _update(result: FitResult) -> torch.Tensor:
    """Every weight's change over the run, flat (names sorted)."""
    return torch.cat([(result.final[k] - result.recorder.initial_state[k]).flatten() for k in sorted(result.final)])


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_accumulation_moves_the_weights_as_plain_lightning(precision: str) -> None:
    """Mixed precision cannot match fp32 bitwise, but a gradient part lost or counted twice (the slot of the last
    micro-batch, or the fp32 sum of the earlier ones) turns the update: over 4 steps of accumulation 3, "off" and
    "pipeline" move the weights in plain Lightning's 32-true direction (cosine > 0.99, as plain Lightning's own
    bf16-mixed does), while a run that drops or doubles one micro-batch in each window is far off (< 0.95)."""
    kwargs: dict[str, Any] = {"n_seq": 4 * 3 * 4, "accumulate_grad_batches": 3}
    want = _update(_run(ScalesAMicroBatch, None, precision="32-true", **kwargs)[0])

    def cosine(result: FitResult) -> float:
        return float(F.cosine_similarity(_update(result), want, dim=0))

    plain_bf16 = cosine(_run(ScalesAMicroBatch, None, precision="bf16-mixed", **kwargs)[0])
    dropped = cosine(_run(lambda: ScalesAMicroBatch(2, 0.0), None, precision="32-true", **kwargs)[0])
    doubled = cosine(_run(lambda: ScalesAMicroBatch(0, 2.0), None, precision="32-true", **kwargs)[0])
    assert plain_bf16 > 0.99 and dropped < 0.95 and doubled < 0.95, (plain_bf16, dropped, doubled)
    for mode in ("off", "pipeline"):
        got, peek = _run(ScalesAMicroBatch, mode, precision=precision, **kwargs)
        assert cosine(got) > 0.99, (mode, cosine(got), plain_bf16)
        if mode == "pipeline":
            assert peek.report is not None and peek.report.host_step_jobs > 0


@pytest.mark.parametrize("declared", [True, False, "all"])
def test_fabric_mixed_accumulation_moves_the_weights_as_plain_fabric(declared: bool | str) -> None:
    """bf16-mixed Fabric loops (gradients summed in fp32 under ``no_backward_sync``, or carried from the param slots
    into the sums by the next forward, or all in the sums) move the weights in plain Fabric's 32-true direction."""
    want = _fabric_loop(None, declared=declared, clip=None, precision="32-true")
    start = _fabric_loop(None, declared=declared, clip=None, steps=0, precision="32-true")[2]

    def update(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([(weights[k] - start[k]).flatten() for k in sorted(start)])

    for mode in ("off", "pipeline"):
        got = _fabric_loop(mode, declared=declared, clip=None)
        cosine = float(F.cosine_similarity(update(got[2]), update(want[2]), dim=0))
        assert cosine > 0.99, (mode, cosine)


@pytest.mark.parametrize(
    ("name", "make", "kwargs"),
    [
        ("manual-carry-over", ManualAcrossEpochs, {"max_epochs": 2}),
        (
            "idle-expert",
            lambda: RoutedLM(3),
            {"n_seq": 48, "accumulate_grad_batches": 3, "options": {"chunk_size": 1056}},
        ),
        ("frozen-block", _gpt(), {"n_seq": 48, "accumulate_grad_batches": 3, "callbacks": [FreezesABlock()]}),
    ],
)
def test_more_mixed_accumulation_moves_the_weights_as_plain_lightning(
    name: str, make: Callable[[], LM], kwargs: dict[str, Any]
) -> None:
    """bf16-mixed "pipeline" against plain Lightning's 32-true update direction (cosine > 0.99), where the gradient
    parts come together in other ways: slot gradients carried into the fp32 sums by the next micro-batch (manual
    accumulation), records of one family with the sum only / the slot only / nothing (an idle expert), a block
    frozen inside a window."""
    options = kwargs.pop("options", {})
    ref, _ = _run(make, None, precision="32-true", **kwargs)
    got, peek = _run(make, "pipeline", options=options, **kwargs)
    assert peek.report is not None and peek.report.host_step_jobs > 0
    cosine = float(F.cosine_similarity(_update(got), _update(ref), dim=0))
    assert cosine > 0.99, (name, cosine)


class VariableLengthLM(LM):
    """Trains on the first 16, 5, 11, 2 tokens of the micro-batches in turn: every micro-batch of a window has
    activations of another size than the warm-up's."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        t = (16, 5, 11, 2)[batch_idx % 4]
        return super().training_step((x[:, :t], y[:, :t]), batch_idx)


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_variable_lengths_under_a_budget_that_evicts(mode: str) -> None:
    """Sequence lengths that change every micro-batch (the iteration leaves the warm-up's trace) under a device
    budget that evicts param chunks all the time, windows of 3 cut by the epoch end: the serial step's bits."""
    _, _, _, peek = _pair(
        VariableLengthLM, mode, max_epochs=2, accumulate_grad_batches=3, options={"device_memory_limit": "250KiB"}
    )
    assert peek.report is not None and peek.report.evictions > 50 and peek.report.host_step_jobs > 0


FABRIC_SCRIPT = """
import torch, torch.nn.functional as F
from lightning.fabric import Fabric
from lightning_pstar import PatrickStarFabricStrategy
from tests.helpers.data import make_loader
from tests.helpers.models import VOCAB, FlatGPT

def body(fabric):
    torch.manual_seed(0)
    net = FlatGPT(512)  # 6 M parameters: the last step's tail is still running when the script ends
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for micro, (x, y) in enumerate(make_loader(n_seq=24)):
        with fabric.no_backward_sync(model, enabled=micro % 2 == 0):
            fabric.backward(F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1)) / 2)
        if micro % 2 == 1:
            opt.step()
            opt.zero_grad()

strategy = PatrickStarFabricStrategy(optimizer_overlap="next_forward", optimizer_placement="host", chunk_size=4096)
Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed").launch(body)
print("end of script", flush=True)
"""


class ProcessDidNotExit(AssertionError):
    """The script printed its last line, but its process was still running at the timeout."""


@pytest.mark.slow  # a fresh interpreter (torch and Lightning imported: about 5 s here), 20 s when it hangs
def test_fabric_script_with_a_next_forward_tail_exits() -> None:
    """Fabric never tears a strategy down (docs/fabric.md): the process must still end when the script does."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", FABRIC_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired as hung:
        out = hung.stdout.decode() if isinstance(hung.stdout, bytes) else (hung.stdout or "")
        assert "end of script" in out, "the script itself did not reach its end"
        raise ProcessDidNotExit("the script ran to its end, but its process did not exit within 20 s") from None
    assert done.returncode == 0 and "end of script" in done.stdout, done.stderr[-2000:]
