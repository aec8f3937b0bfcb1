"""Who can read the weights while a host-side optimizer step is in flight (issue 27), from outside, as user code
would: a callback or the LightningModule at batch end, validation, checkpoints, ``state_dict``, Fabric code between
steps, an exception with the jobs in flight, teardown.

The promise: a reader sees the UPDATED weights (the engine finishes the step first; a read of a parked weight on
the training loop's thread waits for its family: [Note: a read that waits] in ``runtime/parked.py``) or fails loudly
naming the problem; never a stale or half-updated weight silently. Every
scenario runs ``optimizer_overlap="off"`` and a pipelined mode on the same seed and data and compares, bit for bit,
the losses, the final weights, the optimizer states and every value the user's code read along the way; a read that
raises must raise :class:`ParkedParameterError` with a HINT, and the run must go on to the serial run's bits.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.runtime.outside_writes import OutsideWriteError
from lightning_pstar.runtime.parked import ParkedParameterError, park, unpark
from tests.helpers import assert_runs_bitwise, assert_states_close, assert_states_equal, optimizer_state
from tests.helpers.data import make_loader
from tests.helpers.models import SEED, FlatGPT, TinyGPT, lm_loss
from tests.helpers.runs import LM, LossRecorder, make_trainer
from tests.integration.test_step_pipeline_adversarial import (
    HOST,
    RTOL,
    WEIGHT_ATOL,
    _gpt,
    _run,
)

MODES = ["pipeline", "next_forward"]
Read = Callable[[L.LightningModule], Any]


def _total(module: nn.Module) -> float:
    return float(sum(p.double().sum() for p in module.parameters()))


# every way a user's code reads the weights between steps, outside the engine's hooks
READS: dict[str, Read] = {
    "sum": lambda pl: float(pl.net.ln_f.weight.sum()),
    "detach_clone": lambda pl: pl.net.lm_head.weight.detach().clone(),
    "data": lambda pl: float(sum(p.data.double().sum() for p in pl.parameters())),
    "named_parameters": lambda pl: {n: p.detach().clone() for n, p in pl.named_parameters()},
    "cat": lambda pl: torch.cat([p.detach().flatten() for p in pl.parameters()]),
    "parameters_to_vector": lambda pl: torch.nn.utils.parameters_to_vector(pl.parameters()).detach(),
    "module_state_dict": lambda pl: {k: v.clone() for k, v in pl.state_dict().items()},
    "deepcopy": lambda pl: _total(copy.deepcopy(pl.net)),
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


class BatchEndReader(L.Callback):
    """At every batch end, each read of ``READS`` (its value, or the error it raised: the user caught it)."""

    def __init__(self, reads: dict[str, Read], *, settle_first: bool = False) -> None:
        self.reads = reads
        self.settle_first = settle_first  # read the checkpoint's state dict first (the engine ends the step)
        self.values: dict[str, list[Any]] = {name: [] for name in reads}
        self.errors: dict[str, list[BaseException]] = {name: [] for name in reads}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.settle_first:
            trainer.strategy.lightning_module_state_dict()
        for name, read in self.reads.items():
            try:
                with torch.no_grad():
                    self.values[name].append(read(pl_module))
            except ParkedParameterError as error:
                self.errors[name].append(error)


def _assert_reads(got: BatchEndReader, want: BatchEndReader, *, may_refuse: bool) -> None:
    """Every read ``got`` made equals the serial run's read at the same step; a refused read (``may_refuse``)
    raised with a HINT, and then every read of that kind was refused (never a value one step, stale the next)."""
    for name in want.reads:
        assert not want.errors[name], f"{name}: the serial step refused a read: {want.errors[name][0]}"
        if got.errors[name]:
            assert may_refuse, f"{name}: refused without a step in flight: {got.errors[name][0]}"
            assert not got.values[name], f"{name}: read some steps and refused others"
            assert len(got.errors[name]) == len(want.values[name])
            for error in got.errors[name]:
                assert "HINT:" in str(error) and "optimizer_overlap" in str(error)
            continue
        assert len(got.values[name]) == len(want.values[name]), name
        for step, (a, b) in enumerate(zip(got.values[name], want.values[name], strict=True)):
            assert _same(a, b), f"{name}: the read after step {step + 1} differs from the serial run's"


# ---- Trainer: reads at batch end -----------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_batch_end_reads(mode: str, precision: str) -> None:
    """A callback reads the weights every way it can at every batch end: the serial run's values, or (the tail in
    flight, "next_forward") a loud refusal; the run the user went on with stays the serial run's bits."""
    serial_reader, piped_reader = BatchEndReader(READS), BatchEndReader(READS)
    serial, _ = _run(_gpt, "off", callbacks=[serial_reader], precision=precision)
    piped, _ = _run(_gpt, mode, callbacks=[piped_reader], precision=precision)
    assert_runs_bitwise(piped, serial, f"{mode} with batch-end reads")
    # the tail is in flight at every batch end under "next_forward": every read waits for its family's step
    _assert_reads(piped_reader, serial_reader, may_refuse=False)


def test_auto_through_its_trials_with_batch_end_reads() -> None:
    """ "auto" long enough to time all three schedules (the tail's turns leave it in flight at their batch ends, and
    every read there waits for its family): every read and the run are the serial run's, and the tail was timed."""
    from lightning_pstar.optim.overlap import SETTLE_STEPS, TRIALS

    steps = 1 + 1 + SETTLE_STEPS + 6 * TRIALS + 1
    serial_reader, auto_reader = BatchEndReader(READS), BatchEndReader(READS)
    serial, _ = _run(_gpt, "off", callbacks=[serial_reader], steps=steps)
    auto, peek = _run(_gpt, "auto", callbacks=[auto_reader], steps=steps)
    assert_runs_bitwise(auto, serial, "auto through its trials with batch-end reads")
    _assert_reads(auto_reader, serial_reader, may_refuse=False)
    assert peek.report is not None and set(peek.report.schedule_trial_ms) == {"pipeline", "serial", "next_forward"}


@pytest.mark.parametrize("mode", MODES)
def test_batch_end_reads_after_state_dict(mode: str) -> None:
    """The checkpoint's state dict ends every step in flight: reads after it see the updated weights, even with the
    tail of "next_forward" in flight before it."""
    serial_reader, piped_reader = BatchEndReader(READS, settle_first=True), BatchEndReader(READS, settle_first=True)
    serial, _ = _run(_gpt, "off", callbacks=[serial_reader])
    piped, _ = _run(_gpt, mode, callbacks=[piped_reader])
    assert_runs_bitwise(piped, serial, f"{mode} with reads after the state dict")
    _assert_reads(piped_reader, serial_reader, may_refuse=False)


class NormLogger(L.LightningModule):
    """``self.log`` of a weight norm and an EMA of the weights, both in the LightningModule's own batch-end hook,
    the errors caught (the user's code decides what to do with a refusal)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _gpt()
        self.norms: list[float] = []
        self.ema: dict[str, torch.Tensor] | None = None
        self.refused = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.inner.training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return self.inner.configure_optimizers()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        try:
            with torch.no_grad():
                norm = torch.linalg.vector_norm(self.inner.net.ln_f.weight)
                self.log("ln_f_norm", norm)
                self.norms.append(float(norm))
                current = {n: p.detach().clone() for n, p in self.inner.named_parameters()}
                if self.ema is None:
                    self.ema = current
                else:
                    for name, value in current.items():
                        self.ema[name].mul_(0.9).add_(value, alpha=0.1)
        except ParkedParameterError:
            self.refused += 1


@pytest.mark.parametrize("mode", MODES)
def test_module_batch_end_logs_norm_and_ema(mode: str) -> None:
    serial, _ = _run(NormLogger, "off")
    piped, _ = _run(NormLogger, mode)
    assert_runs_bitwise(piped, serial, f"{mode} with a batch-end norm and EMA")
    want, got = serial.module, piped.module
    assert isinstance(want, NormLogger) and isinstance(got, NormLogger)
    assert want.refused == 0 and len(want.norms) == 5
    assert got.refused == 0  # under "next_forward" each read waits for its family's step
    assert got.norms == want.norms
    assert got.ema is not None and want.ema is not None
    assert_states_equal(got.ema, want.ema, what=f"{mode}: EMA")


# ---- Trainer: checkpoints, validation, predict, after fit -------------------------------------------------------


class SaveEveryStep(L.Callback):
    """``trainer.save_checkpoint`` inside ``on_train_batch_end``, every step."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        trainer.save_checkpoint(self.directory / f"step{trainer.global_step}.ckpt")


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The weights and the optimizer states of a checkpoint file, flat."""
    checkpoint = torch.load(path, weights_only=False, map_location="cpu")
    flat = {f"w/{k}": v for k, v in checkpoint["state_dict"].items()}
    for i, optimizer in enumerate(checkpoint["optimizer_states"]):
        for index, entry in optimizer["state"].items():
            flat.update({f"o{i}/{index}/{k}": torch.as_tensor(v) for k, v in entry.items()})
    return flat


def _assert_same_checkpoints(got: Path, want: Path) -> None:
    names = sorted(p.name for p in want.iterdir())
    assert names and names == sorted(p.name for p in got.iterdir())
    for name in names:
        assert_states_equal(_checkpoint_tensors(got / name), _checkpoint_tensors(want / name), what=name)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("mode", MODES)
def test_save_checkpoint_every_batch_end(mode: str, precision: str, tmp_path: Path) -> None:
    """A checkpoint saved by user code at every batch end, with the tail in flight: file by file the serial run's
    (the save ends the step first, for "next_forward" too); ``ModelCheckpoint(save_last=True)`` alongside."""
    runs = {}
    for overlap in ("off", mode):
        directory = tmp_path / overlap / "user"
        directory.mkdir(parents=True)
        last = ModelCheckpoint(dirpath=tmp_path / overlap / "last", save_last=True, every_n_train_steps=1)
        runs[overlap], _ = _run(
            _gpt, overlap, callbacks=[SaveEveryStep(directory), last], enable_checkpointing=True, precision=precision
        )
    assert_runs_bitwise(runs[mode], runs["off"], f"{mode} with a checkpoint every step")
    for sub in ("user", "last"):
        _assert_same_checkpoints(tmp_path / mode / sub, tmp_path / "off" / sub)


class ValReader(L.Callback):
    """Weights read as validation starts (callbacks run before the strategy's own hook, which ends the steps in
    flight: under "next_forward" the read is refused) and as its epoch starts (after it), and each validation loss."""

    def __init__(self) -> None:
        self.at_start: list[float] = []
        self.refused_at_start: list[ParkedParameterError] = []
        self.at_epoch_start: list[float] = []
        self.losses: list[float] = []

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        try:
            with torch.no_grad():
                self.at_start.append(_total(pl_module))
        except ParkedParameterError as error:
            self.refused_at_start.append(error)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            self.at_epoch_start.append(_total(pl_module))

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self.losses.append(float(outputs))


class ValLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _gpt()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.inner.training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.inner.training_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return self.inner.configure_optimizers()


@pytest.mark.parametrize("mode", MODES)
def test_validation_every_step_predict_and_state_after_fit(mode: str) -> None:
    """``val_check_interval=1``: validation (and a callback reading the weights as it starts) after every step sees
    the serial run's weights; ``trainer.predict`` after fit and ``model.state_dict()`` after fit returns too."""
    out: dict[str, Any] = {}
    for overlap in ("off", mode):
        reader, recorder = ValReader(), LossRecorder()
        strategy = PatrickStarStrategy(optimizer_overlap=overlap, **HOST)
        trainer = make_trainer(strategy=strategy, max_steps=5, callbacks=[reader, recorder], val_check_interval=1)
        module = ValLM()
        val = make_loader(n_seq=4, batch_size=2)
        trainer.fit(module, train_dataloaders=make_loader(n_seq=20), val_dataloaders=val)
        after_fit = {k: v.clone() for k, v in module.state_dict().items()}
        predictions = trainer.predict(module, dataloaders=make_loader(n_seq=4, batch_size=2))
        out[overlap] = (recorder, reader, after_fit, predictions, trainer.optimizers)
    serial, piped = out["off"], out[mode]
    assert piped[0].losses == serial[0].losses
    assert_states_equal(piped[0].final_state, serial[0].final_state, what=f"{mode}: weights")
    assert len(serial[1].losses) == 5 * 2 and piped[1].losses == serial[1].losses
    assert len(serial[1].at_epoch_start) == 5 and piped[1].at_epoch_start == serial[1].at_epoch_start
    assert len(serial[1].at_start) == 5 and not serial[1].refused_at_start
    # under "next_forward" the tail is in flight when validation starts: the reads wait for it
    assert not piped[1].refused_at_start and piped[1].at_start == serial[1].at_start
    assert_states_equal(piped[2], serial[2], what="model.state_dict() after fit")
    for a, b in zip(piped[3], serial[3], strict=True):
        assert torch.equal(a, b)


# ---- an exception in user code with the jobs in flight ----------------------------------------------------------


class RaiseAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            raise KeyError("user code failed")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("mode", MODES)
def test_exception_at_batch_end_then_save(mode: str, precision: str, tmp_path: Path) -> None:
    """User code raises at a batch end with the step's jobs in flight; the caller catches it and saves the model:
    the saved weights are those of the step that completed (the serial run's after the same step)."""
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for overlap in ("off", mode):
        module = _gpt()
        with pytest.raises(KeyError, match="user code failed"):
            _run(lambda m=module: m, overlap, callbacks=[RaiseAtStep(3)], precision=precision)  # type: ignore[misc]
        path = tmp_path / f"{overlap}.pt"
        torch.save(module.state_dict(), path)
        saved[overlap] = torch.load(path, weights_only=True)
        assert all(type(p) is nn.Parameter for p in module.parameters()), "a parameter stayed parked"
    assert_states_equal(saved[mode], saved["off"], what=f"{mode}: weights saved after the exception")


# ---- Fabric: user code between steps ----------------------------------------------------------------------------


def _fabric_loop(overlap: str, tmp_path: Path, *, steps: int = 4, accumulate: int = 2) -> dict[str, Any]:
    """A Fabric loop with accumulation (``no_backward_sync``), clipping by norm, and after every step: a weight sum
    (refusals counted), ``model.state_dict()`` after an eval forward under ``no_grad``, ``fabric.save``."""
    strategy = PatrickStarFabricStrategy(optimizer_overlap=overlap, **HOST)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01))
    stream = itertools.cycle(list(make_loader(n_seq=32, batch_size=4)))
    out: dict[str, Any] = {"losses": [], "sums": [], "refused": 0, "eval": [], "states": [], "files": []}
    for step in range(steps):
        for micro in range(accumulate):
            x, y = next(stream)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = lm_loss(model(x), y)
                fabric.backward(loss / accumulate)
            out["losses"].append(float(loss.detach()))
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        try:
            with torch.no_grad():
                out["sums"].append(_total(model.module))
        except ParkedParameterError as error:
            assert "HINT:" in str(error)
            out["refused"] += 1
        with torch.no_grad():
            x, y = next(stream)
            out["eval"].append(float(lm_loss(model(x), y)))
            out["states"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
            out["sums_after_eval"] = out.get("sums_after_eval", []) + [_total(model.module)]
        path = tmp_path / overlap / f"step{step}.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        out["files"].append(path)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_fabric_reads_between_steps(mode: str, tmp_path: Path) -> None:
    serial = _fabric_loop("off", tmp_path)
    piped = _fabric_loop(mode, tmp_path)
    assert piped["losses"] == serial["losses"]
    assert piped["eval"] == serial["eval"]
    assert piped["sums_after_eval"] == serial["sums_after_eval"]
    for got, want in zip(piped["states"], serial["states"], strict=True):
        assert_states_equal(got, want, what=f"{mode}: model.state_dict() between steps")
    assert piped["refused"] == 0 and piped["sums"] == serial["sums"]  # "next_forward": the reads wait
    for got, want in zip(piped["files"], serial["files"], strict=True):
        a, b = torch.load(got, weights_only=False), torch.load(want, weights_only=False)
        assert_states_equal(a["model"], b["model"], what=f"{mode}: fabric.save weights")
        flat = [{f"{i}/{k}": v for i, e in s["optimizer"]["state"].items() for k, v in e.items()} for s in (a, b)]
        assert_states_equal(flat[0], flat[1], what=f"{mode}: fabric.save optimizer states")


# ---- reads the parking does not see -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["as_subclass", "_make_subclass"])
def test_parked_parameter_refuses_subclass_views(how: str) -> None:
    """Neither reaches ``__torch_function__``: the parked class waits in ``as_subclass`` and a guard on
    ``torch.Tensor._make_subclass`` ([Note: a subclass made of a parked parameter] in runtime/parked.py)."""
    layer = nn.Linear(3, 2)
    park([layer.weight])
    try:
        with pytest.raises(ParkedParameterError, match="HINT"):
            if how == "as_subclass":
                layer.weight.as_subclass(torch.Tensor).sum()
            else:
                torch.Tensor._make_subclass(torch.Tensor, layer.weight).sum()
    finally:
        unpark(layer.weight)


def test_optimizer_state_matches_after_next_forward_tail() -> None:
    """The user's optimizer ``state_dict()`` right after the last step (the tail in flight) is the serial one."""
    serial, _ = _run(_gpt, "off")
    piped, _ = _run(_gpt, "next_forward")
    assert_states_equal(optimizer_state(piped), optimizer_state(serial), what="optimizer states")


# ---- a backward that raises after some families stepped inside it -----------------------------------------------


class RaiseInBackward(LM):
    """Raises from a tensor hook on the first block's output in the backward of the ``at``-th training forward (a
    user's check on a gradient, as anomaly detection would): the later blocks' final gradients landed before it,
    so under the pipelined schedule their families already stepped inside that backward."""

    def __init__(self, at: int = 4) -> None:
        super().__init__(lambda: TinyGPT())
        self.at, self.calls = at, 0
        self.net.blocks[0].register_forward_hook(self._arm)

    def _arm(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at:
                output.register_hook(_raise_from_backward)


def _raise_from_backward(grad: torch.Tensor) -> None:
    raise FloatingPointError("user check in the backward failed")


class SaveOnException(L.Callback):
    """The common "save what we have when the run crashes" callback."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("mode", MODES)
def test_backward_raises_then_model_state_after_fit(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """The user catches the backward's error and saves ``model.state_dict()``: a consistent step's weights (the
    serial run's, which never started step 4), or at least a warning (with a HINT) that the model handed back is
    not (the teardown after a failure must not raise)."""
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for overlap in ("off", mode):
        module = RaiseInBackward()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_pstar"), pytest.raises(FloatingPointError):
            _run(lambda m=module: m, overlap)  # type: ignore[misc]
        warned = [r for r in caplog.records if r.name.startswith("lightning_pstar") and "HINT:" in r.getMessage()]
        saved[overlap] = {k: v.clone() for k, v in module.state_dict().items()}
    # families had stepped inside the backward that raised: the run says its weights are a mix of two steps
    assert warned, f"{mode}: no warning that the weights handed back mix two steps"
    assert any(not torch.equal(saved[mode][k], saved["off"][k]) for k in saved["off"])  # (they do)


@pytest.mark.parametrize("checkpoint", ["consolidated", "sharded"])
@pytest.mark.parametrize("mode", MODES)
def test_backward_raises_then_checkpoint_on_exception(mode: str, checkpoint: str, tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` from ``on_exception`` after a backward that raised: the serial run's file (a
    consistent step), or a refusal with a HINT raised from the save (the backward's error as its context); a
    sharded save refuses the same way (each rank writes the weights it owns)."""
    for overlap in ("off", mode):
        with pytest.raises((FloatingPointError, RuntimeError)) as caught:
            _run(
                RaiseInBackward,
                overlap,
                options={"checkpoint": checkpoint},
                callbacks=[SaveOnException(tmp_path / f"{overlap}.ckpt")],
            )
        if overlap == "off":
            assert caught.type is FloatingPointError
    assert caught.type is RuntimeError, caught.value  # refused loudly: a file would hold a mix of two steps
    assert "HINT:" in str(caught.value) and isinstance(caught.value.__context__, FloatingPointError)
    assert not (tmp_path / f"{mode}.ckpt").exists()
    assert (tmp_path / "off.ckpt").exists()  # the serial run saved its consistent step
    if checkpoint == "consolidated":
        assert _checkpoint_tensors(tmp_path / "off.ckpt")


# ---- accumulation, and forwards without autograd inside the training step ---------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_batch_end_reads_with_accumulation(mode: str) -> None:
    """``accumulate_grad_batches=2``: after a micro-batch that only accumulates, the forward has waited for the last
    step's tail, so a read succeeds and must be the serial run's; after a stepping one it may be refused."""
    kwargs: dict[str, Any] = {"accumulate_grad_batches": 2, "loader": make_loader(n_seq=4 * 2 * 5)}
    serial_reader, piped_reader = BatchEndReader(READS), BatchEndReader(READS)
    serial, _ = _run(_gpt, "off", callbacks=[serial_reader], **kwargs)
    piped, _ = _run(_gpt, mode, callbacks=[piped_reader], **kwargs)
    assert_runs_bitwise(piped, serial, f"{mode} with accumulation and batch-end reads")
    for name in READS:
        assert not serial_reader.errors[name] and len(serial_reader.values[name]) == 10
        values = iter(piped_reader.values[name])
        refused = len(piped_reader.errors[name])
        assert refused in ((0,) if mode == "pipeline" else (0, 5)), f"{name}: {refused} refusals"
        for batch, want in enumerate(serial_reader.values[name]):
            if refused and batch % 2 == 1:
                continue  # after a step: refused
            assert _same(next(values), want), f"{name}: the read after micro-batch {batch} differs"


class NoGradPeek(LM):
    """Runs the model under ``torch.no_grad()`` at the start of every training step (a reference output, with the
    last step's tail in flight under "next_forward") and records it."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.peeks: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.peeks.append(self(batch[0]).detach().clone())
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("mode", MODES)
def test_no_grad_forward_inside_training_step(mode: str, precision: str) -> None:
    serial, _ = _run(NoGradPeek, "off", precision=precision)
    piped, _ = _run(NoGradPeek, mode, precision=precision)
    assert_runs_bitwise(piped, serial, f"{mode} with a no-grad forward in the training step")
    want, got = serial.module, piped.module
    assert isinstance(want, NoGradPeek) and isinstance(got, NoGradPeek) and len(want.peeks) == 5
    for step, (a, b) in enumerate(zip(got.peeks, want.peeks, strict=True)):
        assert torch.equal(a, b), f"the no-grad output at step {step} differs"


# ---- weights written in place between steps ---------------------------------------------------------------------


class ShrinkAtBatchEnd(L.Callback):
    """Halves every trainable weight in place at every batch end (weight clamping or shrinking between steps, as a
    WGAN's clipping or a manual decay does); a refusal is counted and the run goes on."""

    def __init__(self) -> None:
        self.refused: list[ParkedParameterError] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        try:
            with torch.no_grad():
                for p in pl_module.parameters():
                    if p.requires_grad:
                        p.mul_(0.5)
        except ParkedParameterError as error:
            self.refused.append(error)


def test_write_between_steps_serial_is_plain_lightning() -> None:
    """The reference for the next test: the serial step honours the write, as plain Lightning does."""
    serial, _ = _run(_gpt, "off", callbacks=[ShrinkAtBatchEnd()])
    plain, _ = _run(_gpt, None, callbacks=[ShrinkAtBatchEnd()])
    for i, (a, b) in enumerate(zip(serial.losses, plain.losses, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"micro-batch {i}: patrickstar {a!r} vs plain Lightning {b!r}"
    assert_states_close(serial.final, plain.final, what="writes between steps", atol=WEIGHT_ATOL)


def test_write_between_steps_pipeline() -> None:
    serial, _ = _run(_gpt, "off", callbacks=[ShrinkAtBatchEnd()])
    piped, _ = _run(_gpt, "pipeline", callbacks=[ShrinkAtBatchEnd()])
    assert_runs_bitwise(piped, serial, "pipeline with weights written between steps")


class HalveViaLoad(L.Callback):
    """``load_state_dict`` of the halved weights at every batch end (the checkpoint's state dict ends the step in
    flight first, so "next_forward" reads and writes too)."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        pl_module.load_state_dict({k: v * 0.5 for k, v in state.items()}, strict=False)


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_between_steps(mode: str) -> None:
    serial, _ = _run(_gpt, "off", callbacks=[HalveViaLoad()])
    plain, _ = _run(_gpt, None, callbacks=[HalveViaLoad()])
    assert_states_close(serial.final, plain.final, what="serial step against plain Lightning", atol=WEIGHT_ATOL)
    piped, _ = _run(_gpt, mode, callbacks=[HalveViaLoad()])
    assert_runs_bitwise(piped, serial, f"{mode} with load_state_dict between steps")


def test_write_between_steps_next_forward() -> None:
    """Under "next_forward" the tail is in flight at the batch end: each write waits for its family's step first
    ([Note: a read that waits] in runtime/parked.py), and the run is the serial run with the writes, bit for bit."""
    shrink = ShrinkAtBatchEnd()
    piped, _ = _run(_gpt, "next_forward", callbacks=[shrink])
    serial, _ = _run(_gpt, "off", callbacks=[ShrinkAtBatchEnd()])
    assert shrink.refused == []
    assert_runs_bitwise(piped, serial, "next_forward with writes between steps")


def test_write_between_steps_mixed_precision_is_refused() -> None:
    """Mixed precision, the serial step too: a weight written in place between steps would change only the
    compute-dtype copy (the next step updates the fp32 master, which never saw it), so it is refused at the next
    forward, naming the parameter ([Note: writes outside a forward] in runtime/outside_writes.py); plain Lightning
    keeps fp32 parameters and honours it."""
    with pytest.raises(OutsideWriteError, match="written in place outside"):
        _run(_gpt, "off", callbacks=[ShrinkAtBatchEnd()], precision="bf16-mixed")


def _fabric_writes(overlap: str | None, steps: int = 4) -> tuple[list[float], int]:
    """A Fabric loop halving every weight in place after each ``optimizer.step()``: its losses and the writes
    refused (``overlap=None``: plain Fabric)."""
    strategy: Any = "auto" if overlap is None else PatrickStarFabricStrategy(optimizer_overlap=overlap, **HOST)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01))
    stream = itertools.cycle(list(make_loader(n_seq=32, batch_size=4)))
    losses, refused = [], 0
    for _ in range(steps):
        x, y = next(stream)
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        try:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        except ParkedParameterError:
            refused += 1
    return losses, refused


@pytest.mark.parametrize("mode", MODES)
def test_fabric_write_between_steps(mode: str) -> None:
    plain, serial, piped = _fabric_writes(None), _fabric_writes("off"), _fabric_writes(mode)
    assert serial == plain  # the serial step honours the writes, as plain Fabric does
    assert piped == serial  # "next_forward": the writes wait for the steps in flight
