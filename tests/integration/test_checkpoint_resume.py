"""Checkpoints that resume exactly, survive a crash mid-save and refuse bad input (one process).

- ``checkpoint="consolidated"`` and ``"sharded"``, ``32-true`` and fp16 ``16-mixed`` (a loss scale that grows
  before the checkpoint), AdamW and SGD with momentum: resuming ``fit`` from a ``ModelCheckpoint`` written at an
  epoch boundary gives the same losses (``==``), learning rates, loss scales, final weights and optimizer state
  as the uninterrupted run;
- a consolidated checkpoint is an ordinary Lightning checkpoint that a fresh plain model loads with
  ``strict=True`` and then computes the same outputs as the model patrickstar trained;
- a process killed (SIGKILL) in the middle of a save leaves the previous checkpoint (file or directory) intact
  and loadable under its name;
- plain Lightning weights and plain Lightning checkpoints start and resume patrickstar runs;
- truncated, corrupt, incomplete and foreign checkpoints raise an error that names the file and the problem
  before any training state changes;
- ``python -m lightning_pstar.consolidate`` turns a sharded checkpoint into the consolidated one.

The model is deliberately tiny (a tied embedding/head, a frozen Linear and a buffer that training updates) so
that every case runs in about a second on two cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import LossScaleConfig, PatrickStarPrecision, PatrickStarStrategy
from lightning_pstar.checkpoint import CheckpointError, consolidate, full_state_dict

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

VOCAB = 16
WIDTH = 16
SEQ = 8
N_SEQ = 16
BATCH = 4
STEPS_PER_EPOCH = N_SEQ // BATCH  # 4 optimizer steps per epoch
EPOCHS = 3
CLIP = 1.0
SEED = 1234
# fp16: small enough not to overflow, growing every 3 good steps so the scale changes before the epoch-0
# checkpoint (after step 3) and again after the resume (steps 6, 9, 12); `good_steps` must be restored too
LOSS_SCALE = LossScaleConfig(initial_scale=2.0**10, growth_interval=3)
# the plain-Lightning interop cases run torch's fused AdamW on the parameters against the same kernel on chunks:
# the losses agree within this relative difference, and in fact bit for bit (observed on CPU; both checked)
INTEROP_RTOL = 1e-5
WRITER_DEADLINE_S = 180  # for the crash tests' writer process to reach its second save (a loaded machine is slow)


# ---- model, data, module ---------------------------------------------------------------------------------------


class Net(nn.Module):
    """Tied embedding/head, LayerNorm, MLP, a frozen Linear and a buffer that every training forward updates."""

    def __init__(self, width: int = WIDTH, extra: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.extra = nn.Linear(width, width) if extra else None
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.wte.weight = self.head.weight  # tied: one Parameter, two names in state_dict
        self.register_buffer("running", torch.zeros(width))  # a running mean of the embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)  # (B, T, C)
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(x.float().mean((0, 1)), alpha=0.1)
        x = x + self.running.to(x.dtype)  # fp16 parameters take fp16 activations
        x = x + self.proj(F.gelu(self.fc(self.ln(x))))
        if self.extra is not None:
            x = self.extra(x)
        return self.head(x + self.frozen(x))  # (B, T, VOCAB)


def make_dataset(n_seq: int = N_SEQ) -> TensorDataset:
    """Arithmetic token sequences with 10% noise, inputs and targets shifted by one."""
    g = torch.Generator().manual_seed(4321)
    start = torch.randint(0, VOCAB, (n_seq, 1), generator=g)
    stride = torch.randint(1, 4, (n_seq, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB  # (N, SEQ + 1)
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def make_loader() -> DataLoader:
    return DataLoader(make_dataset(), batch_size=BATCH, shuffle=False)


class LM(L.LightningModule):
    """Trains :class:`Net` with AdamW (weight decay) or SGD with momentum, and a cosine schedule per step."""

    def __init__(self, *, optim: str = "adamw", seed: int = SEED, **net_kwargs: Any) -> None:
        super().__init__()
        self.optim = optim
        self.steps_run = 0
        torch.manual_seed(seed)
        self.net = Net(**net_kwargs)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB).float(), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optim == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        else:
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * STEPS_PER_EPOCH)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def current_weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The model's consolidated fp32 state_dict as training sees it now (any strategy, any checkpoint mode)."""
    strategy = trainer.strategy
    if isinstance(strategy, PatrickStarStrategy):
        return {k: v.detach().cpu().clone() for k, v in full_state_dict(strategy.chunk_manager).items()}
    assert trainer.lightning_module is not None
    return {k: v.detach().cpu().clone() for k, v in trainer.lightning_module.state_dict().items()}


class Recorder(L.Callback):
    """Loss, learning rate and loss scale of every step, and the weights when training starts."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.scales: list[float] = []
        self.initial_state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial_state = current_weights(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        self.scales.append(float(getattr(trainer.strategy.precision_plugin, "scale", 1.0)))


def make_trainer(
    *,
    strategy: Any,
    precision: str = "32-true",
    epochs: int = EPOCHS,
    callbacks: list[L.Callback] | None = None,
    ckpt_dir: Path | None = None,
    **kwargs: Any,
) -> L.Trainer:
    callbacks = list(callbacks or [])
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    if precision == "16-mixed":  # on CPU, Lightning would turn precision="16-mixed" into bf16: pass the plugin
        kwargs["plugins"] = [PatrickStarPrecision("16-mixed", loss_scale=LOSS_SCALE)]
    else:
        kwargs["precision"] = precision
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": epochs,
        "logger": False,
        "enable_checkpointing": ckpt_dir is not None,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "use_distributed_sampler": False,  # the same data order as strategy="auto"
        "gradient_clip_val": CLIP,
    }
    options.update(kwargs)
    return L.Trainer(strategy=strategy, callbacks=callbacks, **options)


@dataclass
class Run:
    module: LM
    trainer: L.Trainer
    recorder: Recorder


def run(module: LM, *, strategy: Any, ckpt_path: Path | str | None = None, **kwargs: Any) -> Run:
    recorder = Recorder()
    extra = kwargs.pop("callbacks", [])
    trainer = make_trainer(strategy=strategy, callbacks=[recorder, *extra], **kwargs)
    trainer.fit(module, make_loader(), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return Run(module=module, trainer=trainer, recorder=recorder)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def consolidated_dict(path: Path, tmp: Path) -> dict[str, Any]:
    """The checkpoint dict of a consolidated file, or of a sharded directory consolidated into ``tmp``."""
    if path.is_dir():
        out = tmp / f"{path.name}.consolidated"
        consolidate(path, out)
        return load(out)
    return load(path)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    for name, value in want.items():
        assert got[name].dtype == value.dtype, f"{what}: {name} {got[name].dtype} vs {value.dtype}"
        assert torch.equal(got[name], value), f"{what}: {name} differs by {(got[name] - value).abs().max():.3e}"


def assert_same_optimizer_state(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got["state"]) == sorted(want["state"]), f"{what}: parameter indices differ"
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry), f"{what}: fields of state[{index}] differ"
        for field, value in entry.items():
            other = got["state"][index][field]
            assert torch.equal(torch.as_tensor(other).float(), torch.as_tensor(value).float()), (
                f"{what}: state[{index}][{field!r}] differs"
            )
    strip = [{k: v for k, v in g.items() if k != "params"} for g in want["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in got["param_groups"]] == strip, what
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]], what


def pstar(checkpoint: str = "consolidated") -> PatrickStarStrategy:
    return PatrickStarStrategy(checkpoint=checkpoint)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Uninterrupted runs (EPOCHS epochs, a ModelCheckpoint every epoch), each trained once per module."""
    cache: dict[tuple[str, str, str], tuple[Run, Path]] = {}

    def get(precision: str, fmt: str, optim: str = "adamw") -> tuple[Run, Path]:
        key = (precision, fmt, optim)
        if key not in cache:
            ckpt_dir = tmp_path_factory.mktemp(f"full-{precision}-{fmt}-{optim}")
            result = run(LM(optim=optim), strategy=pstar(fmt), precision=precision, ckpt_dir=ckpt_dir)
            cache[key] = (result, ckpt_dir)
        return cache[key]

    return get


# ---- 1. exact resume -------------------------------------------------------------------------------------------

RESUME_CASES = [
    ("32-true", "consolidated", "adamw"),
    ("32-true", "sharded", "adamw"),
    ("16-mixed", "consolidated", "adamw"),
    ("16-mixed", "sharded", "adamw"),
    ("32-true", "sharded", "sgd"),
    ("16-mixed", "consolidated", "sgd"),
]


@pytest.mark.parametrize(("precision", "fmt", "optim"), RESUME_CASES)
def test_resume_is_exact(precision: str, fmt: str, optim: str, full_runs: Any, tmp_path: Path) -> None:
    full, full_dir = full_runs(precision, fmt, optim)
    k = STEPS_PER_EPOCH
    assert len(full.recorder.losses) == EPOCHS * k
    epoch0 = full_dir / "epoch=0.ckpt"
    if fmt == "sharded":
        assert epoch0.is_dir() and (epoch0 / "meta.pt").is_file(), sorted(p.name for p in full_dir.iterdir())
        assert list(epoch0.glob("*.distcp")), sorted(p.name for p in epoch0.iterdir())
    else:
        assert epoch0.is_file(), sorted(p.name for p in full_dir.iterdir())
    if precision == "16-mixed":
        assert full.recorder.scales[0] == LOSS_SCALE.initial_scale
        assert full.recorder.scales[k - 1] > LOSS_SCALE.initial_scale, (
            f"no growth before the checkpoint: {full.recorder.scales}"
        )

    resumed = run(
        LM(optim=optim, seed=999), strategy=pstar(fmt), precision=precision, ckpt_dir=tmp_path, ckpt_path=epoch0
    )
    # the weights the resumed run starts from are those of the checkpoint
    saved = consolidated_dict(epoch0, tmp_path)
    assert_same_tensors(resumed.recorder.initial_state, saved["state_dict"], "weights at resume")

    diffs = [abs(a - b) for a, b in zip(resumed.recorder.losses, full.recorder.losses[k:], strict=True)]
    print(f"{precision}/{fmt}/{optim}: max abs loss difference after resume {max(diffs):.3e}")
    assert resumed.recorder.losses == full.recorder.losses[k:]
    assert resumed.recorder.lrs == full.recorder.lrs[k:]
    assert resumed.recorder.scales == full.recorder.scales[k:]
    assert resumed.trainer.global_step == full.trainer.global_step == EPOCHS * k
    full_prec, resumed_prec = full.trainer.strategy.precision_plugin, resumed.trainer.strategy.precision_plugin
    assert resumed_prec.state_dict() == full_prec.state_dict()
    if precision == "16-mixed":
        assert resumed_prec.scale == full_prec.scale > full.recorder.scales[k - 1]
    # final weights (after fit the module holds ordinary fp32 weights) and optimizer state
    assert_same_tensors(resumed.module.state_dict(), full.module.state_dict(), "final weights")
    assert_same_optimizer_state(
        resumed.trainer.optimizers[0].state_dict(), full.trainer.optimizers[0].state_dict(), "final optimizer"
    )
    # and the last checkpoints agree too
    last = f"epoch={EPOCHS - 1}.ckpt"
    got, want = consolidated_dict(tmp_path / last, tmp_path), consolidated_dict(full_dir / last, tmp_path)
    assert_same_tensors(got["state_dict"], want["state_dict"], "last checkpoint")
    assert_same_optimizer_state(got["optimizer_states"][0], want["optimizer_states"][0], "last checkpoint")
    assert got["lr_schedulers"] == want["lr_schedulers"]


# ---- 3. a consolidated checkpoint is an ordinary one -------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_consolidated_checkpoint_loads_into_plain_model(precision: str, full_runs: Any) -> None:
    full, full_dir = full_runs(precision, "consolidated")
    checkpoint = torch.load(full_dir / f"epoch={EPOCHS - 1}.ckpt", map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    fresh = LM(seed=999)
    assert list(state) == list(fresh.state_dict()), "not the model's own names in its own order"
    assert all(v.dtype == torch.float32 for v in state.values()), {k: v.dtype for k, v in state.items()}
    assert torch.equal(state["net.wte.weight"], state["net.head.weight"])
    fresh.load_state_dict(state, strict=True)
    assert fresh.net.wte.weight is fresh.net.head.weight
    assert_same_tensors(full.module.state_dict(), state, "module after fit vs its last checkpoint")

    # torch's optimizer layout: int keys over the trainable parameters in order, index lists in param_groups
    trainable = [p for p in fresh.parameters() if p.requires_grad]
    (optim_state,) = checkpoint["optimizer_states"]
    assert sorted(optim_state["state"]) == list(range(len(trainable)))
    assert [g["params"] for g in optim_state["param_groups"]] == [list(range(len(trainable)))]
    for index, param in enumerate(trainable):
        entry = optim_state["state"][index]
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}, sorted(entry)
        assert entry["exp_avg"].shape == param.shape and entry["exp_avg"].dtype == torch.float32
        assert float(entry["step"]) == EPOCHS * STEPS_PER_EPOCH
    # the loss scaler travels as Lightning's precision-plugin state
    assert checkpoint["PatrickStarPrecision"] == full.trainer.strategy.precision_plugin.state_dict()

    x = make_dataset().tensors[0][:8]
    fresh.eval()
    full.module.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), full.module(x))


# ---- 5. crash safety ---------------------------------------------------------------------------------------------

# The writer process: trains 3 steps, saves `target` after step 2 (the previous checkpoint), then starts a second
# save of the same target after step 3 with a writer that stops in the middle (and says so in `markers/killme`).
_WRITER = textwrap.dedent(
    """
    import hashlib, io, json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {here!r})
    import torch
    import lightning as L
    import test_checkpoint_resume as T

    fmt, where, target, markers = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)

    def digest(path):
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return {{str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}}

    def block(what):
        (markers / "killme").write_text(what)
        time.sleep(600)
        raise SystemExit("not killed")

    def slow_writer():
        real_save = torch.save
        def save(obj, f, *args, **kwargs):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            try:
                os.fsync(f.fileno())
            except (AttributeError, OSError):  # a stream dcp wraps around the file
                pass
            block(f"torch.save stopped after {{len(data) // 2}} of {{len(data)}} bytes")
        torch.save = save

    def stop_between_renames():
        # the last moment before the new checkpoint is published under the final name: all of its data is
        # written, the previous checkpoint must still be the one found there
        real_replace = os.replace
        def replace(src, dst):
            if Path(dst) == target:
                block(f"stopped before os.replace({{src}}, {{dst}})")
            real_replace(src, dst)
        os.replace = replace

    class Saver(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.save_checkpoint(target)
                (markers / "first.json").write_text(json.dumps(digest(target)))
            elif trainer.global_step == 3:
                slow_writer() if where == "write" else stop_between_renames()
                trainer.save_checkpoint(target)
                raise SystemExit("the second save returned")

    trainer = T.make_trainer(strategy=T.pstar(fmt), callbacks=[Saver()], max_steps=4)
    trainer.fit(T.LM(), T.make_loader())
    """
)


def _digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


KILL_CASES = [("consolidated", "write"), ("sharded", "write"), ("sharded", "between-renames")]


@dataclass
class _Writer:
    """A started writer (``_WRITER``) and its directory: ``ckpts/last.ckpt``, ``markers/``, ``writer.log``."""

    proc: subprocess.Popen[bytes]
    root: Path

    @property
    def target(self) -> Path:
        return self.root / "ckpts" / "last.ckpt"


def _start_writer(fmt: str, where: str, root: Path) -> _Writer:
    script = root / "writer.py"
    script.write_text(_WRITER.format(here=str(HERE)))
    markers = root / "markers"
    markers.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    with open(root / "writer.log", "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, str(script), fmt, where, str(root / "ckpts" / "last.ckpt"), str(markers)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return _Writer(proc=proc, root=root)


def _stop(writer: _Writer) -> None:
    if writer.proc.poll() is None:
        os.killpg(writer.proc.pid, signal.SIGKILL)
        writer.proc.wait(timeout=30)


def _kill_in_the_middle_of_a_save(writer: _Writer) -> tuple[Path, str]:
    """Wait until the writer blocks inside its second save, then SIGKILL it; the target and what it said."""
    proc, markers, log = writer.proc, writer.root / "markers", writer.root / "writer.log"
    try:
        deadline = time.monotonic() + WRITER_DEADLINE_S
        while not (markers / "killme").exists():
            assert proc.poll() is None, f"the writer exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the writer never reached the save:\n{log.read_text()[-4000:]}"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        _stop(writer)
    return writer.target, (markers / "killme").read_text()


@pytest.fixture(scope="module")
def writers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Any, _Writer]]:
    """The writers of the selected kill cases, started together (one interpreter on one core each, blocked once
    they reach the save: [Note: one-process runs started together] in tests/helpers/together.py)."""
    name = "test_kill_during_save_keeps_previous_checkpoint"
    cases = {
        (item.callspec.params["fmt"], item.callspec.params["where"])
        for item in request.session.items
        if getattr(item, "module", None) is request.module and item.originalname == name
    }
    started: dict[Any, _Writer] = {}
    try:
        for fmt, where in KILL_CASES:
            if (fmt, where) in cases:
                started[(fmt, where)] = _start_writer(fmt, where, tmp_path_factory.mktemp(f"writer-{fmt}-{where}"))
        yield started
    finally:
        for writer in started.values():
            _stop(writer)


@pytest.mark.slow  # a Trainer killed in a subprocess; test_checkpoint_safety.py kills every filesystem step quickly
@pytest.mark.parametrize(("fmt", "where"), KILL_CASES)
def test_kill_during_save_keeps_previous_checkpoint(
    fmt: str, where: str, writers: dict[Any, _Writer], tmp_path: Path
) -> None:
    writer = writers[(fmt, where)]
    target, stopped = _kill_in_the_middle_of_a_save(writer)
    print(f"{fmt}/{where}: killed with SIGKILL, {stopped}")
    first = json.loads((writer.root / "markers" / "first.json").read_text())
    leftovers = sorted(p.name for p in target.parent.iterdir() if p.name != target.name)
    # the final name holds exactly the previous checkpoint: nothing half-written carries it
    assert target.exists(), f"'{target.name}' is gone after a crash mid-save; the directory holds {leftovers}"
    assert _digest(target) == first, f"'{target.name}' changed although its save never finished ({leftovers})"
    if where == "write":
        # the killed save had written part of its data somewhere else (a temporary name)
        assert leftovers and all(name.startswith(f".{target.name}") for name in leftovers), leftovers
    # loadable, and training resumes from it
    saved = consolidated_dict(target, tmp_path)
    assert saved["global_step"] == 2
    resumed = run(LM(seed=999), strategy=pstar(fmt), ckpt_path=target, max_steps=4, epochs=-1)
    assert_same_tensors(resumed.recorder.initial_state, saved["state_dict"], "weights at resume")
    assert resumed.trainer.global_step == 4
    assert resumed.recorder.losses and all(torch.isfinite(torch.tensor(resumed.recorder.losses)))


class _SaveAt(L.Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_sharded_save_after_a_crash_that_left_the_old_directory(tmp_path: Path) -> None:
    """A crash after the new directory was renamed into place but before the old one was deleted leaves
    ``.<name>.old``; the next save of the same name must still work."""
    target = tmp_path / "last.ckpt"
    run(LM(), strategy=pstar("sharded"), max_steps=1, epochs=-1, callbacks=[_SaveAt(1, target)])
    stale = tmp_path / f".{target.name}.old"
    shutil.copytree(target, stale)
    run(LM(), strategy=pstar("sharded"), max_steps=2, epochs=-1, callbacks=[_SaveAt(2, target)])
    assert load(target / "meta.pt")["global_step"] == 2


# ---- 6. plain Lightning weights and checkpoints -------------------------------------------------------------------


def test_plain_lightning_weights_and_checkpoint_start_patrickstar(tmp_path: Path) -> None:
    plain = run(LM(), strategy="auto", ckpt_dir=tmp_path / "plain", epochs=2)
    epoch0 = tmp_path / "plain" / "epoch=0.ckpt"
    k = STEPS_PER_EPOCH

    # a plain state_dict loaded with LightningModule.load_state_dict before fit
    weights = plain.module.state_dict()
    from_weights = LM(seed=999)
    from_weights.load_state_dict(weights)
    got = run(from_weights, strategy=pstar(), epochs=1)
    reference = LM(seed=999)
    reference.load_state_dict(weights)
    want = run(reference, strategy="auto", epochs=1)
    assert_same_tensors(got.recorder.initial_state, {k_: v.float() for k_, v in weights.items()}, "start weights")
    rel = max(abs(a - b) / abs(b) for a, b in zip(got.recorder.losses, want.recorder.losses, strict=True))
    bitwise = got.recorder.losses == want.recorder.losses
    print(f"from plain weights: max relative loss difference {rel:.3e} (bitwise: {bitwise})")
    assert got.recorder.losses == pytest.approx(want.recorder.losses, rel=INTEROP_RTOL)
    assert bitwise, "32-true from plain weights: expected the same losses bit for bit (the same fused AdamW kernel)"

    # a plain Lightning checkpoint (torch AdamW state, cosine schedule) resumed with fit(ckpt_path=...)
    resumed = run(LM(seed=999), strategy=pstar(), ckpt_path=epoch0, epochs=2)
    assert_same_tensors(resumed.recorder.initial_state, load(epoch0)["state_dict"], "weights at resume")
    tail = plain.recorder.losses[k:]  # plain Lightning continuing from its epoch-0 checkpoint (bitwise resumable)
    rel = max(abs(a - b) / abs(b) for a, b in zip(resumed.recorder.losses, tail, strict=True))
    bitwise = resumed.recorder.losses == tail
    print(f"plain checkpoint resumed: max relative loss difference {rel:.3e} (bitwise: {bitwise})")
    assert resumed.recorder.losses == pytest.approx(tail, rel=INTEROP_RTOL)
    assert bitwise, "32-true from a plain checkpoint: expected the same losses bit for bit"
    assert resumed.recorder.lrs == plain.recorder.lrs[k:]
    assert resumed.trainer.global_step == plain.trainer.global_step
    steps = [float(s["step"]) for s in resumed.trainer.optimizers[0].state_dict()["state"].values()]
    assert steps and all(s == 2 * k for s in steps), steps


# ---- 7. bad input ------------------------------------------------------------------------------------------------


def _snapshot(module: LM) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fails_untouched(module: LM, ckpt: Path, fmt: str, error: type[BaseException], *patterns: str) -> str:
    """``fit(ckpt_path=ckpt)`` raises ``error`` whose message names the file and matches every pattern; no
    training step ran and the module's weights and buffers are unchanged."""
    before = _snapshot(module)
    trainer = make_trainer(strategy=pstar(fmt), epochs=1)
    with pytest.raises(error) as info:
        trainer.fit(module, make_loader(), ckpt_path=str(ckpt))
    message = str(info.value)
    print(f"{type(info.value).__name__}: {message}")
    for pattern in patterns:
        assert pattern in message, f"{pattern!r} not in the message: {message}"
    assert module.steps_run == 0 and trainer.global_step == 0
    assert_same_tensors(_snapshot(module), before, "weights after the failed load")
    assert module.net.wte.weight is module.net.head.weight
    assert str(ckpt) in message or ckpt.name in message, f"the message does not name the file: {message}"
    return message


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A consolidated file and a sharded directory of the same 1-step state."""
    out = tmp_path_factory.mktemp("saved")
    paths = {"consolidated": out / "c.ckpt", "sharded": out / "s.ckpt"}
    for fmt, path in paths.items():
        run(LM(), strategy=pstar(fmt), max_steps=1, epochs=-1, callbacks=[_SaveAt(1, path)])
    return paths


def test_truncated_file(saved_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    data = saved_checkpoints["consolidated"].read_bytes()
    bad = tmp_path / "truncated.ckpt"
    bad.write_bytes(data[: len(data) // 2])
    _fails_untouched(LM(), bad, "consolidated", CheckpointError, "truncated or corrupt")


CORRUPT = {
    "random": random.Random(0).randbytes(4096),
    # what random bytes also produce now and then (about 6% of seeds): a decode error or a ValueError in the
    # unpickler rather than an UnpicklingError
    "bad-utf8": b"X\x04\x00\x00\x00\xff\xfe\xfd\xfc" + random.Random(1).randbytes(4096),
    "bad-int": b"Iabc\n" + random.Random(2).randbytes(4096),
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_corrupt_file(kind: str, tmp_path: Path) -> None:
    bad = tmp_path / f"{kind}.ckpt"
    bad.write_bytes(CORRUPT[kind])
    _fails_untouched(LM(), bad, "consolidated", CheckpointError, "truncated or corrupt")


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
@pytest.mark.parametrize("other", ["extra-layer", "wider"])
def test_checkpoint_of_another_model(other: str, fmt: str, saved_checkpoints: dict[str, Path]) -> None:
    ckpt = saved_checkpoints[fmt]
    if other == "extra-layer":  # names: the model has a layer the checkpoint lacks
        _fails_untouched(LM(extra=True), ckpt, fmt, Exception, "missing keys", "net.extra.weight", "net.extra.bias")
    else:  # shapes: the same names, another width
        _fails_untouched(LM(width=2 * WIDTH), ckpt, fmt, Exception, "shape", str((VOCAB, 2 * WIDTH)))


def test_sharded_checkpoint_with_a_missing_data_file(saved_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "incomplete.ckpt"
    shutil.copytree(saved_checkpoints["sharded"], ckpt)
    (data_file,) = sorted(ckpt.glob("*.distcp"))
    data_file.unlink()
    _fails_untouched(LM(), ckpt, "sharded", CheckpointError, data_file.name, "missing")


# ---- 8. the consolidate command ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_consolidate_command(full_runs: Any, tmp_path: Path) -> None:
    """``python -m lightning_pstar.consolidate`` on the epoch-0 sharded checkpoint of a run gives the epoch-0
    consolidated checkpoint of the same run in consolidated mode (same arithmetic, so the same state)."""
    _, sharded_dir = full_runs("32-true", "sharded")
    _, consolidated_dir = full_runs("32-true", "consolidated")
    good_out = tmp_path / "out.ckpt"
    incomplete = tmp_path / "incomplete.ckpt"
    shutil.copytree(sharded_dir / "epoch=0.ckpt", incomplete)
    (data_file,) = sorted(incomplete.glob("*.distcp"))
    data_file.unlink()
    calls = {
        "good": [str(sharded_dir / "epoch=0.ckpt"), str(good_out)],
        "no-such-dir": [str(tmp_path / "nowhere"), str(tmp_path / "x.ckpt")],
        "incomplete": [str(incomplete), str(tmp_path / "y.ckpt")],
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "lightning_pstar.consolidate", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in calls.items()
    }
    # communicate, not wait: a child that fills its pipe would block on it; the timeout only guards a hang
    results = {name: (*p.communicate(timeout=600), p.returncode) for name, p in procs.items()}
    out, err, code = results["good"]
    assert code == 0, err
    assert str(good_out) in out
    for name, missing in (("no-such-dir", "nowhere"), ("incomplete", data_file.name)):
        out, err, code = results[name]
        assert code == 2, (name, code, err)
        assert "error" in err and missing in err and "Traceback" not in err, (name, err)
    assert not (tmp_path / "x.ckpt").exists() and not (tmp_path / "y.ckpt").exists()

    got, want = load(good_out), load(consolidated_dir / "epoch=0.ckpt")
    assert list(got["state_dict"]) == list(want["state_dict"]), "names or order differ"
    assert_same_tensors(got["state_dict"], want["state_dict"], "consolidated state_dict")
    assert len(got["optimizer_states"]) == len(want["optimizer_states"]) == 1
    assert_same_optimizer_state(got["optimizer_states"][0], want["optimizer_states"][0], "consolidated optimizer")
    for key in ("epoch", "global_step", "lr_schedulers", "PatrickStarPrecision", "loops"):
        assert got[key] == want[key], key
    assert not any(key.startswith("pstar_") for key in got), sorted(got)
    # the consolidated file loads into a plain model
    LM(seed=999).load_state_dict(got["state_dict"], strict=True)
