"""Train the demo character-level GPT on the Python standard library's sources with PatrickStar.

    python examples/train_gpt.py                      # PatrickStar, precision auto, a few minutes on 2 CPU cores
    python examples/train_gpt.py +experiment=tiny     # a smoke run of a few steps
    python examples/train_gpt.py strategy=auto        # plain Lightning, for comparison
    python examples/train_gpt.py strategy.checkpoint=sharded   # sharded checkpoints, consolidated for the sample
    python examples/train_gpt.py strategy.memory.device_limit=160MiB trainer.precision=32-true

Every option lives in configs/ (Hydra); see configs/train_gpt.yaml. ``trainer.precision: auto`` (the default)
trains in bf16-mixed where the CPU or GPU has bf16 units and in 32-true elsewhere
(:func:`lightning_pstar.hardware.choose_precision`); the run says which in its first lines. Outputs (logs,
checkpoints, Hydra's record of the config) go to Hydra's run directory, ``outputs/<date>/<time>/`` unless
``hydra.run.dir`` is set. On a machine with a GPU the same command trains on it (``trainer.accelerator: auto``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from lightning_pstar.checkpoint import consolidate
from lightning_pstar.demos import GPTLightningModule, StdlibCharDataModule, decode, encode
from lightning_pstar.demos.output import first_process, rank_reports
from lightning_pstar.demos.strategies import build_strategy as build_any_strategy
from lightning_pstar.hardware import choose_precision

log = logging.getLogger(__name__)


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
    """``cfg.strategy`` as ``L.Trainer(strategy=...)`` takes it (``lightning_pstar.demos.strategies``: the
    class's ``from_config`` validates every key, so a misspelled option fails here with its name)."""
    return build_any_strategy(node, base=Strategy, key="strategy")


def checkpoint_format(strategy: Strategy | str) -> str:
    """How ``strategy`` writes checkpoints: "sharded" (a directory per checkpoint) or "consolidated" (one file).

    Read from the built strategy's ``config`` (PatrickStar's ``checkpoint`` option, a string, an enum member
    or a section with a ``format``); every other strategy writes one ordinary file.
    """
    option = getattr(getattr(strategy, "config", None), "checkpoint", "consolidated")
    if not isinstance(option, str):  # a str is also an Enum member's value, and has a `format` method
        option = getattr(option, "format", option)
    return str(getattr(option, "value", option))


def sample(checkpoint_path: str | Path, prompt: str = "def ", length: int = 200) -> str:
    """Continue ``prompt`` with a model loaded from ``checkpoint_path`` by plain Lightning on CPU.

    Also shows that a checkpoint written under PatrickStar is an ordinary one: no strategy is involved here.
    """
    module = GPTLightningModule.load_from_checkpoint(str(checkpoint_path), map_location="cpu")
    module.eval()
    generator = torch.Generator().manual_seed(0)
    out = module.gpt.generate(encode(prompt)[None, :], length, temperature=0.8, top_k=20, generator=generator)
    return decode(out[0])


@hydra.main(config_path="../configs", config_name="train_gpt", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Train, validate, then print the memory report, a sample and where the checkpoints are."""
    start = time.perf_counter()
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    if first_process():  # every rank runs this script: one of them prints
        log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    # Build the strategy first: a bad option should fail before the corpus is read.
    strategy = build_strategy(cfg.strategy)
    precision = choose_precision(cfg.trainer.get("precision", "auto"), cfg.trainer.get("accelerator", "auto"))
    if first_process():
        print(precision)

    L.seed_everything(cfg.seed, workers=True)
    if cfg.get("threads"):
        # Lightning's launcher sets torch's thread count itself unless OMP_NUM_THREADS names one
        os.environ["OMP_NUM_THREADS"] = str(int(cfg.threads))
        torch.set_num_threads(int(cfg.threads))
    # TF32 matmuls on an Ampere+ GPU; no effect on CPU.
    torch.set_float32_matmul_precision("high")
    datamodule = StdlibCharDataModule(**OmegaConf.to_container(cfg.data, resolve=True))  # type: ignore[arg-type]
    model_kwargs: dict[str, Any] = OmegaConf.to_container(cfg.model, resolve=True)  # type: ignore[assignment]
    if model_kwargs["vocab_size"] < datamodule.vocab_size:
        raise ValueError(
            f"`model.vocab_size` ({model_kwargs['vocab_size']}) is smaller than the corpus vocabulary"
            f" ({datamodule.vocab_size}). HINT: set model.vocab_size >= {datamodule.vocab_size}."
        )
    model_kwargs["betas"] = tuple(model_kwargs["betas"])
    module = GPTLightningModule(**model_kwargs)

    checkpoint = ModelCheckpoint(
        dirpath=output_dir / "checkpoints",
        filename="step{step}-val_loss{val_loss:.3f}",
        auto_insert_metric_name=False,
        monitor="val_loss",
        mode="min",
        save_top_k=1,
        save_last=True,
    )
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
    # Read the reports before validate(): a validation run sets the strategy up again without optimizer
    # states, and the report describes the strategy's current setup.
    report = rank_reports(trainer.strategy)
    (final,) = trainer.validate(module, datamodule=datamodule)
    if not trainer.is_global_zero:
        return  # rank 0 prints the run's summary, with a line per rank
    print_summary(losses, final, report)
    print_checkpoints(checkpoint, checkpoint_format(strategy), output_dir)
    print(f"run directory: {output_dir} ({time.perf_counter() - start:.1f} s)")


def print_summary(losses: LossSummary, final: dict[str, float], report: str | None) -> None:
    """The first and last training loss, the final validation loss and perplexity, the memory report(s)."""
    if losses.first is not None and losses.last is not None:
        (first_step, first_loss), (last_step, last_loss) = losses.first, losses.last
        print(f"train_loss: {first_loss:.4f} (step {first_step}) -> {last_loss:.4f} (step {last_step})")
    if "val_loss" in final:
        perplexity = final.get("val_ppl", math.exp(final["val_loss"]))
        print(f"final val_loss: {final['val_loss']:.4f} (perplexity {perplexity:.2f})")
    if report is not None:
        print(report)


def print_checkpoints(checkpoint: ModelCheckpoint, fmt: str, output_dir: Path) -> None:
    """A sample from the last checkpoint and where the checkpoints are.

    A sharded checkpoint is a directory that plain Lightning cannot load: it is consolidated into one ordinary
    file first (what ``python -m lightning_pstar.consolidate DIR OUT.ckpt`` does), and the sample comes from that.
    """
    last = checkpoint.last_model_path
    loadable = last
    if last and fmt == "sharded":
        target = output_dir / "consolidated" / Path(last).name
        target.parent.mkdir(parents=True, exist_ok=True)
        consolidate(last, target)
        loadable = str(target)
    if loadable:
        print(f"sample from the last checkpoint, loaded without any strategy:\n{sample(loadable)}")
    kind = " (sharded: a directory)" if fmt == "sharded" else ""
    print(f"best checkpoint{kind}: {checkpoint.best_model_path or '(none: no validation ran)'}")
    print(f"last checkpoint{kind}: {last or '(none)'}")
    if loadable != last:
        print(f"last checkpoint, consolidated into one file: {loadable}")


if __name__ == "__main__":
    main()
