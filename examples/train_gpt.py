"""Train the demo character-level GPT on the Python standard library's sources with PatrickStar.

    python examples/train_gpt.py                      # PatrickStar, bf16-mixed, about 5 minutes on 2 CPU cores
    python examples/train_gpt.py +experiment=tiny     # a smoke run of a few steps
    python examples/train_gpt.py strategy=auto        # plain Lightning, for comparison
    python examples/train_gpt.py strategy.memory.device_limit=160MiB trainer.max_steps=300

Every option lives in configs/ (Hydra); see configs/train_gpt.yaml. Outputs (logs, checkpoints, Hydra's
record of the config) go to Hydra's run directory, ``outputs/<date>/<time>/`` unless ``hydra.run.dir`` is set.
On a machine with a GPU the same command trains on it (``trainer.accelerator: auto``).
"""

from __future__ import annotations

import logging
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

from lightning_pstar.demos import GPTLightningModule, StdlibCharDataModule, decode, encode

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
    """Turn ``cfg.strategy`` into what ``L.Trainer(strategy=...)`` accepts.

    A node with ``name`` only (``strategy=auto``) is a registered strategy name. A node with ``_target_``
    names a class: when the class offers ``from_config`` (PatrickStarStrategy does), that validates every
    key, so a misspelled option fails here with its name instead of being swallowed; other classes are
    instantiated by Hydra, whose constructor call rejects unknown keyword arguments.
    """
    target = node.get("_target_")
    if target is None:
        return str(node.name)
    cls = hydra.utils.get_class(str(target))
    from_config = getattr(cls, "from_config", None)
    strategy = from_config(node) if callable(from_config) else hydra.utils.instantiate(node)
    if not isinstance(strategy, Strategy):
        raise TypeError(f"`strategy._target_={target}` built a {type(strategy).__name__}, not a Lightning Strategy.")
    return strategy


def sample(checkpoint_path: str, prompt: str = "def ", length: int = 200) -> str:
    """Continue ``prompt`` with a model loaded from ``checkpoint_path`` by plain Lightning on CPU.

    Also shows that a checkpoint written under PatrickStar is an ordinary one: no strategy is involved here.
    """
    module = GPTLightningModule.load_from_checkpoint(checkpoint_path, map_location="cpu")
    module.eval()
    generator = torch.Generator().manual_seed(0)
    out = module.gpt.generate(encode(prompt)[None, :], length, temperature=0.8, top_k=20, generator=generator)
    return decode(out[0])


@hydra.main(config_path="../configs", config_name="train_gpt", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Train, validate, then print the memory report, a sample and where the checkpoints are."""
    start = time.perf_counter()
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    # Build the strategy first: a bad option should fail before the corpus is read.
    strategy = build_strategy(cfg.strategy)

    L.seed_everything(cfg.seed, workers=True)
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
    trainer = L.Trainer(
        **OmegaConf.to_container(cfg.trainer, resolve=True),  # type: ignore[arg-type]
        strategy=strategy,
        callbacks=[checkpoint, losses],
        logger=CSVLogger(output_dir, name="logs"),
        default_root_dir=output_dir,
    )
    trainer.fit(module, datamodule=datamodule)
    # Read the report before validate(): a validation run sets the strategy up again without optimizer
    # states, and the report describes the strategy's current setup.
    memory_report = getattr(trainer.strategy, "memory_report", None)
    report = memory_report() if callable(memory_report) else None
    trainer.validate(module, datamodule=datamodule)

    if losses.first is not None and losses.last is not None:
        (first_step, first_loss), (last_step, last_loss) = losses.first, losses.last
        print(f"train_loss: {first_loss:.4f} (step {first_step}) -> {last_loss:.4f} (step {last_step})")
    if report is not None:
        print(report)
    if checkpoint.last_model_path:
        print(f"sample from the last checkpoint, loaded without any strategy:\n{sample(checkpoint.last_model_path)}")
    print(f"best checkpoint: {checkpoint.best_model_path or '(none: no validation ran)'}")
    print(f"last checkpoint: {checkpoint.last_model_path or '(none)'}")
    print(f"run directory: {output_dir} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
