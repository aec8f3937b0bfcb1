"""Train the demo character-level GPT with a plain Fabric loop and ``Fabric(strategy="patrickstar")``.

    python examples/fabric_train.py                            # PatrickStar, a short run (well under a minute)
    python examples/fabric_train.py fabric_strategy=auto       # the same loop with plain Fabric, for comparison
    python examples/fabric_train.py fabric_strategy.checkpoint=sharded
    python examples/fabric_train.py fabric_strategy.memory.device_limit=2MiB fabric_strategy.placement.policy=static
    python examples/fabric_train.py fabric.devices=2 fabric.accelerator=cpu   # two ranks (Fabric's launcher)

The loop is what a Fabric user writes (LitGPT's pre-training loop has the same shape): ``fabric.launch()``, the
model built under ``fabric.init_module(empty_init=True)`` (the meta device: PatrickStar materialises it straight
into chunks), ``fabric.setup_module`` then ``fabric.setup_optimizers``, micro-batches under
``fabric.no_backward_sync``, ``fabric.backward``, ``fabric.clip_gradients``, a scheduler, evaluation under
``torch.no_grad()`` between steps, ``fabric.all_reduce``, ``fabric.save``, and the memory report at the end.
Every option lives in configs/fabric_gpt.yaml (Hydra). With ``fabric_strategy=auto`` the model is built eagerly
(plain Fabric's ``empty_init`` would leave it uninitialised), so the two runs start from different random draws.
"""

from __future__ import annotations

import logging
import os
import time
from itertools import cycle
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.fabric import Fabric
from lightning.fabric.strategies import Strategy
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarFabricStrategy  # importing the package registers "patrickstar" with Fabric
from lightning_pstar.demos import GPT, GPTConfig, StdlibCharDataModule
from lightning_pstar.demos.module import WarmupCosineSchedule, param_groups
from lightning_pstar.demos.output import first_process, rank_reports
from lightning_pstar.demos.strategies import build_strategy as build_any_strategy
from lightning_pstar.hardware import choose_precision

log = logging.getLogger(__name__)


def build_strategy(node: DictConfig) -> Strategy | str:
    """``cfg.fabric_strategy`` as ``Fabric(strategy=...)`` takes it (a registered name, or a class built with its
    ``from_config``, which validates every key)."""
    return build_any_strategy(node, base=Strategy, key="fabric_strategy")


def build_model(fabric: Fabric, cfg: DictConfig) -> tuple[Any, Any, Any]:
    """The GPT on the meta device (materialised at setup), its AdamW and warm-up/cosine schedule, set up."""
    model_cfg = cfg.model
    config = GPTConfig(
        vocab_size=int(model_cfg.vocab_size),
        block_size=int(model_cfg.block_size),
        n_layer=int(model_cfg.n_layer),
        n_head=int(model_cfg.n_head),
        n_embd=int(model_cfg.n_embd),
        dropout=float(model_cfg.dropout),
        bias=bool(model_cfg.bias),
    )
    # PatrickStar: the meta device, each module initialised by its reset_parameters() straight into the chunks.
    # Plain Fabric's empty_init leaves the weights uninitialised (for loading a checkpoint), so not there.
    with fabric.init_module(empty_init=isinstance(fabric.strategy, PatrickStarFabricStrategy)):
        gpt = GPT(config)
    model = fabric.setup_module(gpt)  # parameters are created now, in their chunks (plain Fabric: on the device)
    groups = param_groups(model, float(model_cfg.weight_decay))
    optimizer = torch.optim.AdamW(groups, lr=float(model_cfg.lr), betas=tuple(model_cfg.betas))
    optimizer = fabric.setup_optimizers(optimizer)
    schedule = WarmupCosineSchedule(
        warmup_steps=int(model_cfg.warmup_steps), total_steps=int(cfg.steps), min_lr_ratio=float(model_cfg.min_lr_ratio)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return model, optimizer, scheduler


@torch.no_grad()
def evaluate(fabric: Fabric, model: Any, loader: DataLoader, batches: int) -> float:
    """Mean validation loss over ``batches`` batches, averaged over ranks."""
    model.eval()
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= batches:
            break
        _, loss = model(x, y)
        losses.append(loss)
    model.train()
    return float(fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean"))


def train(fabric: Fabric, cfg: DictConfig, output_dir: Path) -> None:
    """The loop: micro-batches, backward, clipping, step, schedule, evaluation, checkpoint, report."""
    data = StdlibCharDataModule(**OmegaConf.to_container(cfg.data, resolve=True))  # type: ignore[arg-type]
    data.setup("fit")
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())
    model, optimizer, scheduler = build_model(fabric, cfg)
    batches = cycle(train_loader)
    accumulate = int(cfg.accumulate)
    start = time.perf_counter()
    for step in range(int(cfg.steps)):
        for micro in range(accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                _, loss = model(x, y)
                fabric.backward(loss / accumulate)
        if cfg.clip_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=float(cfg.clip_norm))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step == 0 or (step + 1) % 10 == 0:
            fabric.print(f"step {step + 1}: train_loss {float(loss.detach()):.4f}")
        if cfg.eval_every and (step + 1) % int(cfg.eval_every) == 0:
            fabric.print(f"step {step + 1}: val_loss {evaluate(fabric, model, val_loader, int(cfg.eval_batches)):.4f}")
    fabric.print(f"{cfg.steps} steps in {time.perf_counter() - start:.1f} s")
    if cfg.save:
        path = output_dir / "checkpoints" / "last.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": int(cfg.steps)})
        fabric.print(f"checkpoint: {path}")
    report = rank_reports(fabric.strategy)  # a collective: every rank
    if report is not None:
        fabric.print(report)


@hydra.main(config_path="../configs", config_name="fabric_gpt", version_base="1.3")
def main(cfg: DictConfig) -> None:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    strategy = build_strategy(cfg.fabric_strategy)  # a bad option fails before the corpus is read
    if cfg.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(int(cfg.threads))
        torch.set_num_threads(int(cfg.threads))
    precision = choose_precision(cfg.fabric.get("precision", "auto"), cfg.fabric.get("accelerator", "auto"))
    if first_process():  # every rank runs this script: one of them prints
        print(precision)
    fabric_args: dict[str, Any] = OmegaConf.to_container(cfg.fabric, resolve=True)  # type: ignore[assignment]
    fabric = Fabric(**{**fabric_args, "precision": precision.precision}, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(int(cfg.seed))
    train(fabric, cfg, output_dir)


if __name__ == "__main__":
    main()
