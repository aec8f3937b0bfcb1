"""What the distributed tests train: :class:`~tests.helpers.models.FlatGPT` on the shared token data, a
LightningModule that records per rank, and the functions the launched processes run.

Everything here is importable by a fresh ``spawn`` process (the tests' own launcher and Lightning's spawn
launcher pickle functions and modules by reference) and by ``two_nodes_main.py`` (a script started per node).
The LightningModule writes what each rank saw (its micro-batch losses, gradient norms, the engine's memory
report) to ``<out_dir>/<tag>-rank<r>.json`` at the end of training; the test reads and compares those files.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.comm import destroy_process_groups_at_exit
from tests.helpers.data import global_batch_sampler, make_dataset
from tests.helpers.models import N_EMBD, SEED, VOCAB, FlatGPT
from tests.helpers.runs import quiet_trainer_options

# ---- model --------------------------------------------------------------------------------------------------


def build_model(n_embd: int = N_EMBD) -> FlatGPT:
    """``FlatGPT(n_embd)`` built right after ``torch.manual_seed(SEED)`` (what every run starts from)."""
    torch.manual_seed(SEED)
    return FlatGPT(n_embd)


def num_params(n_embd: int = N_EMBD) -> int:
    """Unique parameter elements of ``FlatGPT(n_embd)`` (the tied weight counted once)."""
    return sum(p.numel() for p in FlatGPT(n_embd).parameters())


# ---- one training run ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RunSpec:
    """One ``trainer.fit``: what to train, how, and where each rank writes its record."""

    tag: str
    out_dir: str
    strategy: str = "patrickstar"
    """"patrickstar", "patrickstar_spawn", "ddp" or "ddp_spawn"."""
    devices: int = 2
    num_nodes: int = 1
    precision: str = "32-true"
    optim: str = "adamw"
    """"adamw" (fused, weight decay, cosine schedule) or "sgd" (fused, momentum 0.9, cosine schedule)."""
    steps: int = 20
    accumulate: int = 1
    clip: float | None = None
    batch_size: int = 4
    """Per rank."""
    chunk_size: int | None = None
    """PatrickStar chunk size in elements (None: the strategy's automatic choice)."""
    save_checkpoint: bool = False
    """Call ``trainer.save_checkpoint(<out_dir>/<tag>.ckpt)`` on every rank at the end of training."""
    fail_rank: int | None = None
    fail_step: int | None = None
    """Raise in ``training_step`` on ``fail_rank`` when ``global_step == fail_step``."""
    n_embd_by_rank: dict[int, int] = field(default_factory=dict)
    """Per-rank width (the model is then built in ``configure_model``, where the rank is known)."""
    checkpoint_blocks: bool = False
    """Activation checkpointing (non-reentrant) of every block: backward recomputes their forwards."""
    options: dict[str, Any] = field(default_factory=dict)
    """More PatrickStarStrategy keywords (``optimizer_placement``, ``optimizer_overlap``, ...)."""
    grad_hook: bool = True
    """Record the gradient norm and learning rate in ``on_before_optimizer_step`` (an overridden hook that may
    read gradients: it keeps PatrickStar from stepping inside the backward)."""

    @property
    def n_seq(self) -> int:
        """Exactly the sequences the run consumes over all ranks (one epoch)."""
        return self.steps * self.accumulate * self.batch_size * self.devices * self.num_nodes

    def record_path(self, rank: int) -> Path:
        return Path(self.out_dir) / f"{self.tag}-rank{rank}.json"

    @property
    def failure_time_path(self) -> Path:
        """Where the injected failure writes its ``time.monotonic()`` (system-wide on Linux)."""
        return Path(self.out_dir) / f"{self.tag}-failed-at"

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.out_dir) / f"{self.tag}.ckpt"


class RecordingModule(L.LightningModule):
    """Trains :class:`FlatGPT` and writes this rank's record at the end of training (see module docstring)."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__()
        self.spec = spec
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []
        self.model: FlatGPT | None = None
        if not spec.n_embd_by_rank:
            self.model = build_model()
            self.model.checkpoint_blocks = spec.checkpoint_blocks

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model(self.spec.n_embd_by_rank.get(self.global_rank, N_EMBD))

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # two ranks share two cores
        destroy_process_groups_at_exit()  # ddp_spawn's gloo ranks: [Note: process groups at exit]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        spec = self.spec
        if self.global_rank == spec.fail_rank and self.trainer.global_step == spec.fail_step:
            spec.failure_time_path.write_text(repr(time.monotonic()))
            raise RuntimeError(f"injected failure on rank {self.global_rank} at step {self.trainer.global_step}")
        x, y = batch  # (B, T), (B, T)
        assert self.model is not None
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def record_step(self, optimizer: torch.optim.Optimizer) -> None:
        # plain DDP: the global norm Lightning clips by (PatrickStar keeps gradients in its chunks: its p.grad is a
        # stand-in that refuses to be read, [Note: gradients user code cannot see] in runtime/grad_guard.py)
        if getattr(self.trainer.strategy, "strategy_name", "").startswith("patrickstar"):
            self.lrs.append(float(optimizer.param_groups[0]["lr"]))
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.spec.optim == "adamw":
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)
        elif self.spec.optim == "sgd":
            optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
        else:
            raise ValueError(f"unknown optim {self.spec.optim!r}")
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.spec.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_end(self) -> None:
        spec = self.spec
        strategy = self.trainer.strategy
        record: dict[str, Any] = {
            "rank": self.global_rank,
            "world_size": self.trainer.world_size,
            "global_step": self.trainer.global_step,
            "losses": self.losses,
            "grad_norms": self.grad_norms,
            "lrs": self.lrs,
            "threads": torch.get_num_threads(),
        }
        if isinstance(strategy, PatrickStarStrategy):
            record["memory_report"] = strategy.memory_report().as_dict()
            reports = strategy.memory_report_all()  # a collective: every rank calls it
            record["all_ranks"] = [r.as_dict() for r in reports]
            record["summary"] = PatrickStarStrategy.format_rank_summary(reports)
        if spec.save_checkpoint:
            self.trainer.save_checkpoint(spec.checkpoint_path)  # a collective too; rank 0 writes
        spec.record_path(self.global_rank).write_text(json.dumps(record))


class HookedRecordingModule(RecordingModule):
    """:class:`RecordingModule` that records gradient norms and learning rates before each step."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.record_step(optimizer)


def build_strategy(spec: RunSpec) -> Any:
    if spec.strategy.startswith("patrickstar"):
        start_method: Literal["spawn", "popen"] = "spawn" if spec.strategy == "patrickstar_spawn" else "popen"
        options: dict[str, Any] = {} if spec.chunk_size is None else {"chunk_size": spec.chunk_size}
        return PatrickStarStrategy(start_method=start_method, **options, **spec.options)
    return spec.strategy


def fit(spec: RunSpec) -> None:
    """Train once as ``spec`` says. In a rank started by the launcher, or one that starts its own ranks."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=spec.devices,
        num_nodes=spec.num_nodes,
        strategy=build_strategy(spec),
        precision=spec.precision,  # type: ignore[arg-type]
        max_steps=spec.steps,
        accumulate_grad_batches=spec.accumulate,
        gradient_clip_val=spec.clip,
        limit_val_batches=0,
        **quiet_trainer_options(),
    )
    # W ranks: Lightning injects a DistributedSampler that shuffles (seed 0) and gives rank r the indices r, r + W,
    # ... of the permutation; one rank (none injected, as under auto) takes the same permutation unsplit
    data = make_dataset(spec.n_seq)
    sampler = global_batch_sampler(data) if spec.devices * spec.num_nodes == 1 else None
    loader = DataLoader(data, batch_size=spec.batch_size, shuffle=False, sampler=sampler)
    module = HookedRecordingModule(spec) if spec.grad_hook else RecordingModule(spec)
    trainer.fit(module, train_dataloaders=loader)


def read_records(spec: RunSpec) -> list[dict[str, Any]]:
    """Every rank's record of ``spec``, in rank order."""
    world = spec.devices * spec.num_nodes
    missing = [r for r in range(world) if not spec.record_path(r).exists()]
    assert not missing, f"{spec.tag}: ranks {missing} wrote no record in {spec.out_dir}"
    return [json.loads(spec.record_path(r).read_text()) for r in range(world)]


# ---- what launched processes run ----------------------------------------------------------------------------


def fit_in_rank(rank: int, world_size: int, specs: list[RunSpec]) -> None:
    """For ``launch.run_ranks``: the environment already names this rank, so the Trainer joins it."""
    assert int(os.environ["LOCAL_RANK"]) == rank
    for spec in specs:
        assert spec.devices * spec.num_nodes == world_size, spec
        fit(spec)


def fit_in_driver(specs: list[RunSpec]) -> None:
    """For ``launch.run_isolated``: runs one after the other; spawn strategies start their own ranks."""
    for spec in specs:
        fit(spec)


def spec_as_json(spec: RunSpec) -> str:
    return json.dumps(asdict(spec))


def spec_from_json(text: str) -> RunSpec:
    data = json.loads(text)
    data["n_embd_by_rank"] = {int(k): v for k, v in data["n_embd_by_rank"].items()}
    return RunSpec(**data)
