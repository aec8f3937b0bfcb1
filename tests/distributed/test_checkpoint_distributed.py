"""Checkpoints at two (and three) gloo ranks: exact resume, world-size changes, consolidation, bad input.

One launch of two ranks (``launch.run_ranks``: a crashed or stuck rank fails the test) trains, for ``32-true``
and fp16 ``16-mixed`` and for ``checkpoint="consolidated"`` and ``"sharded"``, an uninterrupted run with a
``ModelCheckpoint`` every epoch and a run resumed from its epoch-0 checkpoint. Every rank writes its losses,
learning rates and loss scales to ``<tag>-rank<r>.json`` and its final weights to ``<tag>-rank<r>.pt``. The tests
then check, from those files:

- the resumed runs repeat the uninterrupted ones exactly on every rank (losses ``==``, loss scale, weights);
- a consolidated checkpoint is written by rank 0 alone (rank 1's checkpoint dict holds no tensors) and loads
  into a fresh plain model; a sharded one has one data file per rank and every tensor in exactly one of them;
- the 2-rank sharded checkpoint, consolidated, equals the 2-rank consolidated checkpoint of the same state;
- it loads at 1 rank (this process) with the same weights, and the next two losses equal the mean of the two
  ranks' losses when continuing at 2 ranks (same global batch); it loads at 3 ranks with the same weights and
  trains a step;
- with one rank's data file deleted it is refused, naming the file, before anything changes.

Two ranks use batch size ``B`` each, one rank ``2B``. For training, Lightning's injected DistributedSampler shuffles
(seed 0, whatever the loader says) and gives rank ``r`` the indices ``r, r + 2, ...`` of the epoch's permutation;
the one-rank run puts in the same sampler unsplit (``global_batch_sampler``: at one rank the strategy, like
``auto``, injects none), so the global batch of every step holds the same samples at 1 and 2 ranks.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from launch import run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import LossScaleConfig, PatrickStarPrecision, PatrickStarStrategy
from lightning_pstar.checkpoint import CheckpointError, consolidate, full_state_dict
from tests.helpers.data import global_batch_sampler

pytestmark = pytest.mark.slow  # every test here trains on spawned ranks: tens of seconds each

VOCAB = 16
WIDTH = 16
SEQ = 8
N_SEQ = 16
BATCH = 2  # per rank at 2 ranks; 2 * BATCH at 1 rank
STEPS_PER_EPOCH = N_SEQ // (2 * BATCH)  # 4
EPOCHS = 3
CLIP = 1.0
SEED = 1234
CHUNK_SIZE = 300  # elements: several chunks, so that both ranks own some of the model
LOSS_SCALE = LossScaleConfig(initial_scale=2.0**10, growth_interval=3)  # grows after steps 3, 6, 9, 12
# 1 rank against 2 ranks: the same weights and the same samples, but the mean loss is reduced in another order
# (one mean over 2B sequences against the mean of two means over B): the first loss differs by rounding only.
# The gradients are averaged in another order too (a reduce-scatter over ranks), so the later steps may drift
# apart by rounding (observed: at most 2e-7 over 8 steps).
NEXT_STEP_RTOL = 1e-6
WORLD_SIZE_RTOL = 1e-5
PRECISIONS = ("32-true", "16-mixed")
FORMATS = ("consolidated", "sharded")
# a collective that one rank never joins fails the ranks after this long instead of hanging until the launcher's
# timeout: the traceback then shows where
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
LAUNCH_TIMEOUT_S = 300


# ---- model, data, module (importable by the spawned ranks) ---------------------------------------------------


class Net(nn.Module):
    """Tied embedding/head, LayerNorm, MLP and a frozen Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.head.weight  # tied: one Parameter, two names in state_dict

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)  # (B, T, C)
        x = x + self.proj(F.gelu(self.fc(self.ln(x))))
        return self.head(x + self.frozen(x))  # (B, T, VOCAB)


def make_dataset() -> TensorDataset:
    """Arithmetic token sequences with 10% noise, inputs and targets shifted by one."""
    g = torch.Generator().manual_seed(4321)
    start = torch.randint(0, VOCAB, (N_SEQ, 1), generator=g)
    stride = torch.randint(1, 4, (N_SEQ, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB  # (N, SEQ + 1)
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


@dataclass(kw_only=True)
class Job:
    """One ``trainer.fit`` and where each rank writes what it saw."""

    tag: str
    out_dir: str
    precision: str = "32-true"
    fmt: str = "consolidated"
    devices: int = 2
    batch_size: int = BATCH
    max_steps: int = -1
    ckpt_path: str | None = None
    checkpoint_every_epoch: bool = True

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.out_dir) / self.tag

    def record(self, rank: int) -> dict[str, Any]:
        return json.loads((Path(self.out_dir) / f"{self.tag}-rank{rank}.json").read_text())

    def final_weights(self, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(Path(self.out_dir) / f"{self.tag}-rank{rank}.pt", weights_only=True)

    def start_weights(self) -> dict[str, torch.Tensor]:
        return torch.load(Path(self.out_dir) / f"{self.tag}-start.pt", weights_only=True)


class LM(L.LightningModule):
    """AdamW with weight decay and a cosine schedule per step; records what each saved checkpoint dict held."""

    def __init__(self, seed: int = SEED) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = Net()
        self.saved: list[dict[str, int]] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB).float(), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * STEPS_PER_EPOCH)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("optimizer_states") or [{"state": {}}]
        # tensors with bytes: a sharded checkpoint dict holds stand-ins (meta tensors) for the weights only
        held = [v for v in checkpoint["state_dict"].values() if not v.is_meta]
        self.saved.append({"state_dict": len(held), "optimizer": len(states[0]["state"])})


class Recorder(L.Callback):
    """Writes this rank's losses, learning rates, loss scales and saved-checkpoint sizes when training ends; at
    the start, gathers the consolidated weights to rank 0 (a collective) and writes them."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.scales: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(trainer.strategy, PatrickStarStrategy)
        state = full_state_dict(trainer.strategy.chunk_manager, rank0_only=True)
        if trainer.global_rank == 0:
            torch.save(state, Path(self.job.out_dir) / f"{self.job.tag}-start.pt")
        else:
            assert state == {}, f"rank {trainer.global_rank} holds {len(state)} tensors of a rank-0 gather"

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        self.scales.append(float(trainer.strategy.precision_plugin.scale))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(pl_module, LM)
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "losses": self.losses,
            "lrs": self.lrs,
            "scales": self.scales,
            "precision_state": trainer.strategy.precision_plugin.state_dict(),
            "saved": pl_module.saved,
        }
        path = Path(self.job.out_dir) / f"{self.job.tag}-rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record))


def fit_job(job: Job) -> LM:
    """Train as ``job`` says (in a rank the launcher started, or in this process at 1 rank)."""
    callbacks: list[L.Callback] = [Recorder(job)]
    if job.checkpoint_every_epoch:
        callbacks.append(ModelCheckpoint(dirpath=job.ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    precision: dict[str, Any] = (
        {"plugins": [PatrickStarPrecision("16-mixed", loss_scale=LOSS_SCALE)]}
        if job.precision == "16-mixed"
        else {"precision": job.precision}
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=job.devices,
        strategy=PatrickStarStrategy(checkpoint=job.fmt, chunk_size=CHUNK_SIZE, timeout=COLLECTIVE_TIMEOUT),
        max_epochs=EPOCHS,
        max_steps=job.max_steps,
        gradient_clip_val=CLIP,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=job.checkpoint_every_epoch,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **precision,
    )
    module = LM(seed=SEED if job.ckpt_path is None else 999)
    data = make_dataset()
    # several ranks: Lightning injects its DistributedSampler; one rank: the same permutation, unsplit
    sampler = global_batch_sampler(data) if job.devices == 1 else None
    loader = DataLoader(data, batch_size=job.batch_size, shuffle=False, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=job.ckpt_path)
    # after fit the module holds ordinary fp32 weights on every rank
    torch.save(module.state_dict(), Path(job.out_dir) / f"{job.tag}-rank{trainer.global_rank}.pt")
    return module


def fit_in_rank(rank: int, world_size: int, jobs: list[Job]) -> None:
    """For ``launch.run_ranks``: the environment names this rank, so each Trainer joins it."""
    assert int(os.environ["LOCAL_RANK"]) == rank
    torch.set_num_threads(1)
    for job in jobs:
        assert job.devices == world_size, job
        fit_job(job)


# ---- the runs ----------------------------------------------------------------------------------------------------


@dataclass
class TwoRankRuns:
    """Per precision: the uninterrupted run and the run resumed from its epoch-0 checkpoint (one format)."""

    full: dict[str, Job]
    resumed: dict[str, Job]


def _two_rank_runs(fmt: str, tmp_path_factory: pytest.TempPathFactory) -> TwoRankRuns:
    out = str(tmp_path_factory.mktemp(f"two-ranks-{fmt}"))
    full, resumed, jobs = {}, {}, []
    for precision in PRECISIONS:
        full[precision] = Job(tag=f"full-{precision}", out_dir=out, precision=precision, fmt=fmt)
        epoch0 = str(full[precision].ckpt_dir / "epoch=0.ckpt")
        resumed[precision] = Job(
            tag=f"resumed-{precision}", out_dir=out, precision=precision, fmt=fmt, ckpt_path=epoch0
        )
        jobs += [full[precision], resumed[precision]]
    run_ranks(fit_in_rank, 2, jobs, timeout=LAUNCH_TIMEOUT_S)
    return TwoRankRuns(full=full, resumed=resumed)


# one launch per format, so that a failure of one format does not hide the results of the other
@pytest.fixture(scope="module")
def consolidated_runs(tmp_path_factory: pytest.TempPathFactory) -> TwoRankRuns:
    return _two_rank_runs("consolidated", tmp_path_factory)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory: pytest.TempPathFactory) -> TwoRankRuns:
    return _two_rank_runs("sharded", tmp_path_factory)


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for name, value in want.items():
        assert got[name].dtype == value.dtype, f"{what}: {name}: {got[name].dtype} vs {value.dtype}"
        assert torch.equal(got[name], value), f"{what}: {name} differs by {(got[name] - value).abs().max():.3e}"


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


# ---- 2. exact resume at two ranks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_rank_resume_is_exact(precision: str, fmt: str, request: pytest.FixtureRequest) -> None:
    runs: TwoRankRuns = request.getfixturevalue(f"{fmt}_runs")
    full, resumed = runs.full[precision], runs.resumed[precision]
    k = STEPS_PER_EPOCH
    records = []
    for rank in range(2):
        f, r = full.record(rank), resumed.record(rank)
        records.append(f)
        assert f["rank"] == r["rank"] == rank and f["world_size"] == r["world_size"] == 2
        assert len(f["losses"]) == EPOCHS * k
        assert f["global_step"] == r["global_step"] == EPOCHS * k
        diffs = [abs(a - b) for a, b in zip(r["losses"], f["losses"][k:], strict=True)]
        print(f"{precision}/{fmt} rank {rank}: max abs loss difference after resume {max(diffs):.3e}")
        assert r["losses"] == f["losses"][k:], f"rank {rank}"
        assert r["lrs"] == f["lrs"][k:], f"rank {rank}"
        assert r["scales"] == f["scales"][k:], f"rank {rank}"
        assert r["precision_state"] == f["precision_state"], f"rank {rank}"
        if precision == "16-mixed":
            assert f["scales"][k - 1] > LOSS_SCALE.initial_scale, f"no growth before the checkpoint: {f['scales']}"
            assert r["scales"][-1] > f["scales"][k - 1], r["scales"]
        _assert_same_tensors(resumed.final_weights(rank), full.final_weights(rank), f"final weights, rank {rank}")
    assert records[0]["losses"] != records[1]["losses"], "the two ranks saw the same data"
    assert records[0]["scales"] == records[1]["scales"], "the ranks disagree on the loss scale"
    _assert_same_tensors(full.final_weights(1), full.final_weights(0), "final weights of rank 1 vs rank 0")

    saved = _consolidated(full.ckpt_dir / "epoch=0.ckpt")
    _assert_same_tensors(resumed.start_weights(), saved["state_dict"], "weights at resume")
    # the last checkpoints agree
    last = f"epoch={EPOCHS - 1}.ckpt"
    got, want = _consolidated(resumed.ckpt_dir / last), _consolidated(full.ckpt_dir / last)
    _assert_same_tensors(got["state_dict"], want["state_dict"], "last checkpoint")
    _assert_same_optimizer_state(got["optimizer_states"][0], want["optimizer_states"][0], "last checkpoint")


def _consolidated(path: Path) -> dict[str, Any]:
    if path.is_dir():
        out = path.with_name(path.name + ".consolidated")
        if not out.exists():
            consolidate(path, out)
        return _load(out)
    return _load(path)


def _assert_same_optimizer_state(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got["state"]) == sorted(want["state"]), f"{what}: parameter indices differ"
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry), f"{what}: state[{index}]"
        for field, value in entry.items():
            other = got["state"][index][field]
            assert torch.equal(torch.as_tensor(other).float(), torch.as_tensor(value).float()), (
                f"{what}: state[{index}][{field!r}] differs"
            )
    assert got["param_groups"] == want["param_groups"], what


# ---- what each rank writes; consolidation -------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_consolidated_is_written_by_rank_0_alone(precision: str, consolidated_runs: TwoRankRuns) -> None:
    consolidated = consolidated_runs.full[precision]
    n_params = len(LM().state_dict())
    n_trainable = sum(p.requires_grad for p in LM().parameters())
    # consolidated: gathered to rank 0; rank 1's checkpoint dict holds nothing
    saved0, saved1 = consolidated.record(0)["saved"], consolidated.record(1)["saved"]
    assert saved0 and all(s == {"state_dict": n_params, "optimizer": n_trainable} for s in saved0), saved0
    assert saved1 and all(s == {"state_dict": 0, "optimizer": 0} for s in saved1), saved1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sharded_is_written_by_every_rank(precision: str, sharded_runs: TwoRankRuns) -> None:
    sharded = sharded_runs.full[precision]
    # sharded: one data file per rank, every tensor stored once, both ranks own some
    path = sharded.ckpt_dir / "epoch=0.ckpt"
    metadata = FileSystemReader(path).read_metadata()
    files: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(info.relative_path, set()).add(index.fqn)
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"], sorted(files)
    assert all(files.values()), files
    assert not files["__0_0.distcp"] & files["__1_0.distcp"], "a tensor stored by both ranks"
    for rank in range(2):
        saved = sharded.record(rank)["saved"]
        assert saved and all(s == {"state_dict": 0, "optimizer": 0} for s in saved), (rank, saved)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sharded_consolidates_to_the_consolidated_checkpoint(
    precision: str, consolidated_runs: TwoRankRuns, sharded_runs: TwoRankRuns
) -> None:
    """The same state saved both ways at 2 ranks (the runs differ only in checkpoint mode)."""
    for epoch in range(EPOCHS):
        name = f"epoch={epoch}.ckpt"
        got = _consolidated(sharded_runs.full[precision].ckpt_dir / name)
        want = _load(consolidated_runs.full[precision].ckpt_dir / name)
        _assert_same_tensors(got["state_dict"], want["state_dict"], name)
        _assert_same_optimizer_state(got["optimizer_states"][0], want["optimizer_states"][0], name)
        for key in ("epoch", "global_step", "lr_schedulers"):
            assert got[key] == want[key], (name, key)
        if precision == "16-mixed":
            assert got["PatrickStarPrecision"] == want["PatrickStarPrecision"], name


@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_rank_consolidated_checkpoint_loads_into_plain_model(
    precision: str, consolidated_runs: TwoRankRuns
) -> None:
    full = consolidated_runs.full[precision]
    state = torch.load(full.ckpt_dir / f"epoch={EPOCHS - 1}.ckpt", weights_only=True)["state_dict"]
    trained = LM(seed=0)
    trained.load_state_dict(full.final_weights(0))  # what patrickstar handed back after fit
    fresh = LM(seed=999)
    fresh.load_state_dict(state, strict=True)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert fresh.net.wte.weight is fresh.net.head.weight
    x = make_dataset().tensors[0][:8]
    with torch.no_grad():
        assert torch.equal(fresh(x), trained(x))


# ---- 4. other world sizes ------------------------------------------------------------------------------------------


def test_two_rank_sharded_checkpoint_at_one_rank(sharded_runs: TwoRankRuns, tmp_path: Path) -> None:
    """Loaded at 1 rank, the 2-rank checkpoint continues like the 2-rank run from it: each step's loss (one mean
    over the global batch) equals the mean of the two ranks' losses of that step.

    Both runs go to the end of the last epoch (``max_steps=-1``): with Lightning 2.6 a ``max_steps`` that ends
    training mid-epoch changes the order in which the resumed epoch's shuffled batches arrive.
    """
    two = sharded_runs.resumed["32-true"]  # continued at 2 ranks from the 2-rank epoch-0 checkpoint
    assert two.ckpt_path is not None
    one = Job(
        tag="one-rank",
        out_dir=str(tmp_path),
        fmt="sharded",
        devices=1,
        batch_size=2 * BATCH,
        ckpt_path=two.ckpt_path,
        checkpoint_every_epoch=False,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernels of the 2-rank run
    try:
        fit_job(one)
    finally:
        torch.set_num_threads(threads)
    _assert_same_tensors(one.start_weights(), two.start_weights(), "weights loaded at 1 rank vs at 2 ranks")
    got = one.record(0)
    per_rank = [two.record(rank)["losses"] for rank in range(2)]
    want = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and len(got["losses"]) == len(want)
    rels = [abs(a - b) / abs(b) for a, b in zip(got["losses"], want, strict=True)]
    print(f"1 rank vs the 2-rank mean, relative loss difference per step: {[f'{r:.1e}' for r in rels]}")
    # the next step: the same weights, only the loss reduction differs
    assert rels[0] <= NEXT_STEP_RTOL, (got["losses"][0], want[0])
    # the steps after: the same optimizer state at both world sizes, gradients reduced in another order
    assert max(rels) <= WORLD_SIZE_RTOL, (got["losses"], want)
    assert got["lrs"] == two.record(0)["lrs"]


def test_two_rank_sharded_checkpoint_at_three_ranks(sharded_runs: TwoRankRuns, tmp_path: Path) -> None:
    two = sharded_runs.resumed["32-true"]
    three = Job(
        tag="three-ranks",
        out_dir=str(tmp_path),
        fmt="sharded",
        devices=3,
        ckpt_path=two.ckpt_path,
        max_steps=STEPS_PER_EPOCH + 1,
        checkpoint_every_epoch=False,
    )
    run_ranks(fit_in_rank, 3, [three], timeout=240)
    _assert_same_tensors(three.start_weights(), two.start_weights(), "weights loaded at 3 ranks vs at 2 ranks")
    for rank in range(3):
        record = three.record(rank)
        assert record["world_size"] == 3 and record["global_step"] == STEPS_PER_EPOCH + 1
        assert len(record["losses"]) == 1 and torch.isfinite(torch.tensor(record["losses"])).all(), record
    weights = [three.final_weights(rank) for rank in range(3)]
    for rank in (1, 2):
        _assert_same_tensors(weights[rank], weights[0], f"final weights of rank {rank} vs rank 0")
    moved = [name for name, value in weights[0].items() if not torch.equal(value, three.start_weights()[name])]
    assert moved, "the step at 3 ranks changed no weight"


# ---- 7. a sharded checkpoint with one rank's data missing ----------------------------------------------------------


def test_missing_rank_data_file_is_refused(sharded_runs: TwoRankRuns, tmp_path: Path) -> None:
    source = sharded_runs.full["32-true"].ckpt_dir / "epoch=0.ckpt"
    broken = tmp_path / "incomplete.ckpt"
    shutil.copytree(source, broken)
    (broken / "__1_0.distcp").unlink()
    module = LM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=PatrickStarStrategy(checkpoint="sharded", chunk_size=CHUNK_SIZE),
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp") as info:
        trainer.fit(module, DataLoader(make_dataset(), batch_size=2 * BATCH), ckpt_path=str(broken))
    print(info.value)
    assert str(broken) in str(info.value)
    assert trainer.global_step == 0
    _assert_same_tensors(module.state_dict(), before, "weights after the refused load")
    # the command line says the same and writes nothing
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp"):
        consolidate(broken, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()
