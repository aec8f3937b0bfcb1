"""Train a Hugging Face ``transformers`` model, built from a config (nothing is downloaded), with PatrickStar.

    python examples/train_hf.py                        # a tiny GPT-2, precision auto (see train_gpt.py)
    python examples/train_hf.py model=hf_llama         # a tiny Llama instead
    python examples/train_hf.py model.config.n_layer=4 trainer.max_steps=300
    python examples/train_hf.py model.gradient_checkpointing=true strategy.placement.policy=static \
        strategy.memory.device_limit=100KiB   # chunks evicted to HOST and fetched back every step
    python examples/train_hf.py strategy=auto          # plain Lightning, for comparison

The model is ``AutoModelFor<task>.from_config(AutoConfig.for_model(model.model_type, **model.config))``, so any
architecture ``transformers`` knows trains the same way: ``model.task`` is ``causal-lm`` (next-token prediction),
``masked-lm`` (restore masked characters) or ``seq2seq-lm`` (an encoder-decoder maps each window to the next one).
The data is the character corpus of the Python standard library (``lightning_pstar.demos``).

The script composes ``configs/train_gpt.yaml`` (strategy, trainer, data, seed) with the experiment
``configs/experiment/hf_gpt2.yaml``, which selects the model config and the tiny run; pass another
``+experiment=...`` to replace it. Outputs go to Hydra's run directory, ``outputs/<date>/<time>/`` unless
``hydra.run.dir`` is set.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn
from typing_extensions import override

from lightning_pstar.demos import StdlibCharDataModule
from lightning_pstar.demos.module import WarmupCosineSchedule, param_groups
from lightning_pstar.demos.output import first_process, rank_reports
from lightning_pstar.demos.strategies import build_strategy as build_any_strategy
from lightning_pstar.hardware import choose_precision

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "hf_gpt2"
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
}
MASK_ID = 0  # the corpus' "unknown character" id stands for a masked character (masked-lm)


def build_hf_model(task: str, model_type: str, config: dict[str, Any], *, gradient_checkpointing: bool) -> nn.Module:
    """``AutoModelFor<task>`` built from ``AutoConfig.for_model(model_type, **config)``, randomly initialised,
    with Hugging Face's activation checkpointing if asked."""
    import transformers

    if task not in TASKS:
        raise ValueError(f"`model.task` must be one of {sorted(TASKS)}, got {task!r}.")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    model = getattr(transformers, TASKS[task]).from_config(hf_config)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


class HFLightningModule(L.LightningModule):
    """Trains a Hugging Face model on ``(x, y)`` character windows (``y`` is ``x`` shifted by one).

    Args:
        task: "causal-lm", "masked-lm" or "seq2seq-lm" (see the module docstring).
        model_type: a ``transformers`` model type ("gpt2", "llama", "bert", "t5", ...).
        config: keyword arguments of the model's config class (sizes, dropout, vocabulary).
        block_size: window length (the data module cuts windows of this length).
        lr, weight_decay, betas: fused AdamW; matrices decay, biases, norms and embeddings do not.
        warmup_steps, min_lr_ratio: linear warm-up, then cosine decay to ``min_lr_ratio * lr``.
        mask_fraction: share of characters masked (masked-lm).
        gradient_checkpointing: Hugging Face's activation checkpointing (``gradient_checkpointing_enable``).
    """

    def __init__(
        self,
        *,
        task: str,
        model_type: str,
        config: dict[str, Any],
        block_size: int,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        mask_fraction: float = 0.15,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.task = task
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = (float(betas[0]), float(betas[1]))
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.mask_fraction = mask_fraction
        # built here, not in configure_model: Hugging Face initialises weights in `post_init` (some layers, like
        # GPT-2's Conv1D, have no `reset_parameters` for a meta-device model to be materialised with)
        self.model = build_hf_model(task, model_type, config, gradient_checkpointing=gradient_checkpointing)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.task == "causal-lm":
            logits = self.model(input_ids=x).logits  # (B, T, V)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        if self.task == "masked-lm":
            mask = torch.rand(x.shape, device=x.device) < self.mask_fraction
            labels = torch.where(mask, x, torch.full_like(x, -100))
            return self.model(input_ids=x.masked_fill(mask, MASK_ID), labels=labels).loss
        # seq2seq-lm: the next window, as a translation of this one
        return self.model(input_ids=x, labels=y).loss

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(*batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(*batch), prog_bar=True, sync_dist=True)

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = torch.optim.AdamW(
            param_groups(self.model, self.weight_decay), lr=self.lr, betas=self.betas, fused=True
        )
        schedule = WarmupCosineSchedule(
            warmup_steps=self.warmup_steps,
            total_steps=max(1, int(self.trainer.estimated_stepping_batches)),
            min_lr_ratio=self.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LossSummary(Callback):
    """Remembers the first and last training loss so the run can end with a one-line summary."""

    def __init__(self) -> None:
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.last = (trainer.global_step, float(loss))
            if self.first is None:
                self.first = self.last


def build_strategy(node: DictConfig) -> Strategy | str:
    """``cfg.strategy`` -> what ``L.Trainer(strategy=...)`` accepts (as in examples/train_gpt.py)."""
    return build_any_strategy(node, base=Strategy, key="strategy")


@hydra.main(config_path="../configs", config_name="train_gpt", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Train, then print the memory report and where the checkpoints are."""
    start = time.perf_counter()
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    if first_process():  # every rank runs this script: one of them prints
        log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    if "model_type" not in cfg.model:
        raise ValueError(
            "`model` is not a Hugging Face model config (no `model_type`). HINT: use model=hf_gpt2 or model=hf_llama,"
            " or +experiment=hf_gpt2."
        )
    strategy = build_strategy(cfg.strategy)  # a bad option fails before the corpus is read
    precision = choose_precision(cfg.trainer.get("precision", "auto"), cfg.trainer.get("accelerator", "auto"))
    if first_process():
        print(precision)

    L.seed_everything(cfg.seed, workers=True)
    if cfg.get("threads"):
        # Lightning's launcher sets torch's thread count itself unless OMP_NUM_THREADS names one
        os.environ["OMP_NUM_THREADS"] = str(int(cfg.threads))
        torch.set_num_threads(int(cfg.threads))
    torch.set_float32_matmul_precision("high")
    datamodule = StdlibCharDataModule(**OmegaConf.to_container(cfg.data, resolve=True))  # type: ignore[arg-type]
    model_kwargs: dict[str, Any] = OmegaConf.to_container(cfg.model, resolve=True)  # type: ignore[assignment]
    vocab = model_kwargs["config"].get("vocab_size")
    if vocab is not None and vocab < datamodule.vocab_size:
        raise ValueError(
            f"`model.config.vocab_size` ({vocab}) is smaller than the corpus vocabulary ({datamodule.vocab_size})."
            f" HINT: set model.config.vocab_size >= {datamodule.vocab_size}."
        )
    model_kwargs["betas"] = tuple(model_kwargs["betas"])
    module = HFLightningModule(**model_kwargs)

    checkpoint = ModelCheckpoint(dirpath=output_dir / "checkpoints", save_last=True)
    losses = LossSummary()
    trainer_args: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    trainer = L.Trainer(
        **{**trainer_args, "precision": precision.precision},
        strategy=strategy,
        callbacks=[checkpoint, losses],
        logger=CSVLogger(output_dir, name="logs"),
        default_root_dir=output_dir,
    )
    trainer.fit(module, datamodule=datamodule)
    report = rank_reports(trainer.strategy)
    if not trainer.is_global_zero:
        return  # rank 0 prints the run's summary, with a line per rank
    if losses.first is not None and losses.last is not None:
        (first_step, first_loss), (last_step, last_loss) = losses.first, losses.last
        print(f"train_loss: {first_loss:.4f} (step {first_step}) -> {last_loss:.4f} (step {last_step})")
    if report is not None:
        print(report)
    print(f"last checkpoint: {checkpoint.last_model_path or '(none)'}")
    print(f"run directory: {output_dir} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    # the Hugging Face experiment is this script's default; an explicit +experiment=... replaces it
    if not any(arg.lstrip("+~").startswith("experiment=") for arg in sys.argv[1:]):
        sys.argv.insert(1, f"+experiment={DEFAULT_EXPERIMENT}")
    main()
