"""Trainer harnesses: optimizers, the LightningModules around the test models, a loss recorder, quiet trainers
and ``fit`` functions that return what a parity test compares.

Both sides of a parity test are built by the same function here (:func:`make_trainer`), so they differ only in
the strategy. Two LightningModules:

- :class:`TinyLM` around :class:`~tests.helpers.models.TinyGPT`, with its optimizer chosen by an
  :class:`OptimSpec` (the parity, precision, checkpoint and placement tests);
- :class:`LM` around any net mapping token ids to logits, built by a callable (the hard cases).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarStrategy
from tests.helpers.data import make_loader
from tests.helpers.models import SEED, TinyGPT, build_model, lm_loss

STEPS = 6
"""Optimizer steps of one :func:`fit_steps` run unless told otherwise."""

# --------------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class OptimSpec:
    """Which optimizer ``configure_optimizers`` returns (and the reference loops build)."""

    name: str = "adamw"
    """One of "adamw", "adam", "sgd", "rmsprop", "adagrad" (the last two are unsupported by the strategy)."""
    lr: float = 3e-3
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    cosine_t_max: int | None = None
    """If set, a CosineAnnealingLR with this T_max stepped every optimizer step (interval "step")."""
    trainable_only: bool = True
    """Pass only ``requires_grad`` parameters to the optimizer (else all parameters)."""


def make_optimizer(spec: OptimSpec, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """Build the optimizer of ``spec``; Adam, AdamW and SGD use torch's fused kernels."""
    if spec.name == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
    if spec.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            nesterov=spec.nesterov,
            weight_decay=spec.weight_decay,
            fused=True,
        )
    if spec.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=spec.lr)
    if spec.name == "adagrad":
        return torch.optim.Adagrad(params, lr=spec.lr)
    raise ValueError(f"unknown optimizer {spec.name!r}")


def make_scheduler(spec: OptimSpec, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The cosine schedule of ``spec``, or None."""
    if spec.cosine_t_max is None:
        return None
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=spec.cosine_t_max)


# --------------------------------------------------------------------------------------------------
# LightningModule, callback, trainers
# --------------------------------------------------------------------------------------------------


class TinyLM(L.LightningModule):
    """LightningModule around :class:`TinyGPT`.

    Args:
        optim: the optimizer (and optional cosine schedule) ``configure_optimizers`` returns.
        seed: ``torch.manual_seed`` applied right before the model is built.
        meta_init: build the model in ``configure_model`` (under the strategy's init context)
            instead of in ``__init__``.
        record_grad_norms: in ``on_before_optimizer_step``, record the global 2-norm of ``p.grad``
            (before clipping). Only meaningful with plain Lightning, where ``p.grad`` is populated.
        model_kwargs: forwarded to :class:`TinyGPT`.
    """

    def __init__(
        self,
        *,
        optim: OptimSpec | None = None,
        seed: int = SEED,
        meta_init: bool = False,
        record_grad_norms: bool = False,
        **model_kwargs: Any,
    ) -> None:
        super().__init__()
        self.optim = optim if optim is not None else OptimSpec()
        self.seed = seed
        self.model_kwargs = model_kwargs
        self.record_grad_norms = record_grad_norms
        self.grad_norms: list[float] = []
        self.grad_enabled_in: dict[str, list[bool]] = {"validation": [], "test": [], "predict": []}
        self.training_steps_run = 0
        self.configure_model_device: torch.device | None = None
        self.model: TinyGPT | None = None if meta_init else build_model(seed, **model_kwargs)

    def configure_model(self) -> None:
        """Build the model here when ``meta_init`` (idempotent: Lightning may call this twice).

        Records the device the parameters were created on (``meta`` under a deferred-init context).
        """
        if self.model is None:
            self.model = build_model(self.seed, **self.model_kwargs)
            self.configure_model_device = next(self.model.parameters()).device

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.training_steps_run += 1
        x, y = batch
        return lm_loss(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.grad_enabled_in["validation"].append(torch.is_grad_enabled())
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.grad_enabled_in["test"].append(torch.is_grad_enabled())
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.grad_enabled_in["predict"].append(torch.is_grad_enabled())
        return self(batch[0])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.record_grad_norms:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad or not self.optim.trainable_only]
        optimizer = make_optimizer(self.optim, params)
        scheduler = make_scheduler(self.optim, optimizer)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LossRecorder(L.Callback):
    """Records the (accumulation-normalised) training loss of every micro-batch, the learning rate,
    the consolidated model state at the start and end of training and, optionally, after every
    optimizer step.

    States come from ``trainer.strategy.lightning_module_state_dict()`` (what a checkpoint stores),
    cloned to fp32 on CPU.

    Args:
        snapshot_state: after each batch that completed an optimizer step, append the state to ``states``.
    """

    def __init__(self, snapshot_state: bool = False) -> None:
        self.losses: list[float] = []
        self.global_steps: list[int] = []
        self.lrs: list[float] = []
        self.snapshot_state = snapshot_state
        self.states: list[dict[str, torch.Tensor]] = []
        self.initial_state: dict[str, torch.Tensor] = {}
        self.final_state: dict[str, torch.Tensor] = {}
        self._last_step = 0

    @staticmethod
    def _state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
        state = trainer.strategy.lightning_module_state_dict()  # sharded: buffers and the weights' stand-ins
        return {k: v.detach().float().cpu().clone() for k, v in state.items() if not v.is_meta}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step
        self.initial_state = self._state(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        step = trainer.global_step
        if self.snapshot_state and step != self._last_step:
            self.states.append(self._state(trainer))
        self._last_step = step
        self.global_steps.append(step)
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.final_state = self._state(trainer)


def quiet_trainer_options() -> dict[str, Any]:
    """Trainer keywords for a test run: no progress bar, logger, checkpoints, model summary or sanity check."""
    return {
        "enable_progress_bar": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }


def make_trainer(
    *,
    strategy: Any,
    precision: str | None = "32-true",
    max_steps: int = 20,
    max_epochs: int = -1,
    callbacks: Sequence[L.Callback] = (),
    plugins: Sequence[Any] | None = None,
    **kwargs: Any,
) -> L.Trainer:
    """A quiet single-process CPU Trainer; both parity sides must be built by this function.

    ``use_distributed_sampler=False`` because the strategy subclasses DDPStrategy and Lightning
    would otherwise inject a DistributedSampler that changes the data order against "auto".
    When ``plugins`` are given, ``precision`` is not passed (Lightning refuses both).
    """
    defaults = quiet_trainer_options()
    defaults["use_distributed_sampler"] = False
    defaults.update(kwargs)
    if plugins:
        defaults["plugins"] = list(plugins)
    else:
        defaults["precision"] = precision
    defaults.setdefault("accelerator", "cpu")
    return L.Trainer(
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        **defaults,
    )


M = TypeVar("M", bound=L.LightningModule)


@dataclass
class FitResult(Generic[M]):
    """What one ``fit`` produced."""

    module: M
    trainer: L.Trainer
    recorder: LossRecorder

    @property
    def losses(self) -> list[float]:
        """The (accumulation-normalised) loss of every micro-batch."""
        return self.recorder.losses

    @property
    def final(self) -> dict[str, torch.Tensor]:
        """The consolidated state at the end of training (fp32, CPU)."""
        return self.recorder.final_state


def fit(
    module: M,
    *,
    strategy: Any,
    loader: DataLoader | None = None,
    snapshot_state: bool = False,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> FitResult[M]:
    """Fit ``module`` with :func:`make_trainer` and a :class:`LossRecorder` (resuming from ``ckpt_path``)."""
    recorder = LossRecorder(snapshot_state=snapshot_state)
    extra = list(trainer_kwargs.pop("callbacks", ()))
    trainer = make_trainer(strategy=strategy, callbacks=[recorder, *extra], **trainer_kwargs)
    trainer.fit(module, train_dataloaders=loader if loader is not None else make_loader(), ckpt_path=ckpt_path)
    return FitResult(module=module, trainer=trainer, recorder=recorder)


def fit_steps(
    module: M,
    strategy: Any,
    *,
    precision: str = "32-true",
    steps: int = STEPS,
    loader: DataLoader | None = None,
    callbacks: Sequence[L.Callback] = (),
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> FitResult[M]:
    """:func:`fit` for ``steps`` optimizer steps, by default over ``4 * steps`` sequences in batches of 4."""
    return fit(
        module,
        strategy=strategy,
        loader=loader if loader is not None else make_loader(n_seq=4 * steps),
        ckpt_path=ckpt_path,
        precision=precision,
        max_steps=steps,
        callbacks=callbacks,
        **trainer_kwargs,
    )


# --------------------------------------------------------------------------------------------------
# The hard cases' LightningModule and budget
# --------------------------------------------------------------------------------------------------


class LM(L.LightningModule):
    """Next-token cross entropy around ``build()``, a net mapping token ids (B, T) to logits (B, T, V).

    Args:
        build: returns the net; called right after ``torch.manual_seed(SEED)``.
        optim: "adamw" (fused, weight decay) or "sgd" (fused, momentum: a gradient off by a factor shows).
        all_params: give the optimizer every parameter, frozen ones too (torch skips those without a gradient).
    """

    def __init__(self, build: Callable[[], nn.Module], *, optim: str = "adamw", all_params: bool = False) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.net = build()
        self.optim = optim
        self.all_params = all_params

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad or self.all_params]
        if self.optim == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)


def tight(chunk_size: int, chunks: int, itemsize: int = 4) -> PatrickStarStrategy:
    """Static placement whose device budget holds ``chunks`` param chunks of ``chunk_size`` elements of
    ``itemsize`` bytes (4 in 32-true, 2 in bf16-mixed)."""
    limit = chunks * chunk_size * itemsize
    return PatrickStarStrategy(chunk_size=chunk_size, placement="static", device_memory_limit=limit)
