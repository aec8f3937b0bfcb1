"""LightningModule that trains the demo :class:`~lightning_pstar.demos.gpt.GPT` as a language model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override

from lightning_pstar.demos.gpt import GPT, GPTConfig

__all__ = ["GPTLightningModule", "WarmupCosineSchedule", "param_groups"]


@dataclass(kw_only=True)
class WarmupCosineSchedule:
    """Learning-rate multiplier: linear warm-up from ~0 to 1, then cosine decay to ``min_lr_ratio``.

    A callable object rather than a lambda because ``LambdaLR.state_dict()`` only saves callable objects,
    and a resumed run must continue on the same curve.
    """

    warmup_steps: int
    """Steps of linear warm-up."""
    total_steps: int
    """Step at which the cosine reaches ``min_lr_ratio`` (it stays there afterwards)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into a weight-decay group (matrices of Linear layers) and a
    no-decay group (biases, LayerNorm weights, embeddings).

    ``named_parameters()`` yields a shared Parameter once, so the tied embedding / head weight lands in
    exactly one group (no-decay, as an embedding).
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class GPTLightningModule(L.LightningModule):
    """Next-character prediction with the demo GPT, AdamW and a warm-up + cosine learning-rate schedule.

    Logs ``train_loss`` every step, and ``val_loss`` and ``val_ppl`` (perplexity, ``exp(val_loss)``) per
    validation run.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias: fields of :class:`GPTConfig`.
        lr: peak learning rate.
        weight_decay: AdamW decoupled weight decay of the matrix weights (see :func:`param_groups`).
        betas: AdamW betas.
        warmup_steps: steps of linear learning-rate warm-up.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        fused: use torch's fused AdamW kernel (several times faster than the for-loop default on CPU).
        meta_init: build the model in :meth:`configure_model`, which Lightning calls under the strategy's
            init context (the meta device for PatrickStar, so no full-size copy is ever allocated), instead
            of in ``__init__``.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 128,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        fused: bool = True,
        meta_init: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt_config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=dropout,
            bias=bias,
        )
        if lr <= 0:
            raise ValueError(f"`lr` must be > 0, got {lr!r}.")
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps!r}.")
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = (float(betas[0]), float(betas[1]))
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.fused = fused
        self.model: GPT | None = None if meta_init else GPT(self.gpt_config)
        self.val_loss_mean = MeanMetric()

    @property
    def gpt(self) -> GPT:
        """The GPT; raises if ``meta_init=True`` and :meth:`configure_model` has not run yet."""
        if self.model is None:
            raise RuntimeError(
                "The GPT has not been built yet: meta_init=True defers it to configure_model()."
                " HINT: let a Trainer call it, or call module.configure_model() yourself."
            )
        return self.model

    @override
    def configure_model(self) -> None:
        # Lightning calls this on every fit/validate/test, and load_from_checkpoint calls it too: build once.
        if self.model is None:
            self.model = GPT(self.gpt_config)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids (B, T)."""
        logits, _ = self.gpt(idx)
        return logits

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        _, loss = self.gpt(x, y)
        assert loss is not None
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch  # (B, T), (B, T)
        _, loss = self.gpt(x, y)
        assert loss is not None
        # Weighted by batch size so that a short last batch does not count as much as a full one.
        self.val_loss_mean.update(loss.detach(), weight=x.shape[0])

    @override
    def on_validation_epoch_end(self) -> None:
        # MeanMetric.compute() already reduces across ranks; sync_dist only silences Lightning's warning
        # and averages identical values.
        mean = self.val_loss_mean.compute()
        self.val_loss_mean.reset()
        self.log("val_loss", mean, prog_bar=True, sync_dist=True)
        self.log("val_ppl", torch.exp(mean), sync_dist=True)

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = torch.optim.AdamW(
            param_groups(self.gpt, self.weight_decay), lr=self.lr, betas=self.betas, fused=self.fused
        )
        schedule = WarmupCosineSchedule(
            warmup_steps=self.warmup_steps,
            total_steps=max(1, int(self.trainer.estimated_stepping_batches)),
            min_lr_ratio=self.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
