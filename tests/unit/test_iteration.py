"""The iteration's boundaries both glues share (``lightning_pstar/iteration.py``), the data order at one rank
(``data_order.py``) and the disk tier's operation futures (``runtime/disk_ops.py``), on their own: a recording
stand-in for the manager, plain futures."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, cast

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType

from lightning_pstar.data_order import keep_data_order
from lightning_pstar.iteration import accumulating, eval_pass, nothing_reads_gradients, optimizer_stepped
from lightning_pstar.runtime.disk_ops import DiskOp, copy_outcome
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.state import MicroBatch


class _Manager:
    """Records the verbs called on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.micro_batch = MicroBatch.FINAL

    def __getattr__(self, name: str) -> Any:
        return lambda: self.calls.append(name)


def _manager() -> tuple[_Manager, ChunkManager]:
    fake = _Manager()
    return fake, cast(ChunkManager, fake)


def test_eval_pass_begins_and_ends_and_a_raising_step_ends_nothing() -> None:
    fake, manager = _manager()
    with eval_pass(manager):
        assert fake.calls == ["begin_eval_pass"]
    assert fake.calls == ["begin_eval_pass", "end_eval_pass"]
    fake.calls.clear()
    with pytest.raises(KeyError), eval_pass(manager):
        raise KeyError("step")
    assert fake.calls == ["begin_eval_pass"]  # no collectives after a failure on this rank
    with eval_pass(None):
        pass  # not set up: nothing to do


def test_accumulating_restores_the_final_micro_batch_even_on_error() -> None:
    fake, manager = _manager()
    with accumulating(manager):
        assert fake.micro_batch is MicroBatch.ACCUMULATING
    assert fake.micro_batch is MicroBatch.FINAL
    with pytest.raises(RuntimeError), accumulating(manager):
        raise RuntimeError("backward")
    assert fake.micro_batch is MicroBatch.FINAL


def test_optimizer_stepped_ends_the_warmup_only_with_one_step_per_iteration() -> None:
    fake, manager = _manager()
    optimizer_stepped(manager, one_per_iteration=True)
    optimizer_stepped(manager, one_per_iteration=False)
    assert fake.calls == ["end_warmup_if_recording", "optimizer_stepped"]


class _Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


class _Reads(_Plain):
    def on_after_backward(self) -> None:
        pass


class _Manual(_Plain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class _Trainer:
    def __init__(
        self, clip: float | None = None, algorithm: str | None = None, callbacks: list[pl.Callback] | None = None
    ) -> None:
        self.gradient_clip_val = clip
        self.gradient_clip_algorithm = None if algorithm is None else GradClipAlgorithmType(algorithm)
        self.callbacks = callbacks or []
        self._accelerator_connector = SimpleNamespace(use_distributed_sampler=True)


class _ReadingCallback(pl.Callback):
    def on_before_optimizer_step(self, *args: Any) -> None:
        pass


def _attached(module: pl.LightningModule, trainer: _Trainer) -> pl.LightningModule:
    module._trainer = cast(pl.Trainer, trainer)
    return module


def test_nothing_reads_gradients_only_without_readers_between_backward_and_step() -> None:
    one = [object()]
    assert nothing_reads_gradients(_attached(_Plain(), _Trainer()), one)
    assert nothing_reads_gradients(_attached(_Plain(), _Trainer(callbacks=[pl.Callback()])), one)
    assert not nothing_reads_gradients(None, one)
    assert not nothing_reads_gradients(_attached(_Plain(), _Trainer()), [object(), object()])
    assert not nothing_reads_gradients(_Plain(), one)  # no trainer
    assert not nothing_reads_gradients(_attached(_Plain(), _Trainer(clip=1.0)), one)
    assert not nothing_reads_gradients(_attached(_Reads(), _Trainer()), one)
    assert not nothing_reads_gradients(_attached(_Manual(), _Trainer()), one)
    assert not nothing_reads_gradients(_attached(_Plain(), _Trainer(callbacks=[_ReadingCallback()])), one)


@pytest.mark.parametrize(("algorithm", "expected"), [(None, True), ("norm", True), ("value", False)])
def test_nothing_reads_gradients_but_clipping_by_norm(algorithm: str | None, expected: bool) -> None:
    module = _attached(_Plain(), _Trainer(clip=1.0, algorithm=algorithm))
    assert nothing_reads_gradients(module, [object()], but_clipping_by_norm=True) is expected
    assert not nothing_reads_gradients(module, [object()])
    reading = _attached(_Reads(), _Trainer(clip=1.0, algorithm=algorithm))
    assert not nothing_reads_gradients(reading, [object()], but_clipping_by_norm=True)


@pytest.mark.parametrize(("world_size", "injects"), [(1, False), (2, True)])
def test_keep_data_order_turns_the_sampler_injection_off_at_one_rank_only(world_size: int, injects: bool) -> None:
    trainer = _Trainer()
    keep_data_order(cast(pl.Trainer, trainer), world_size)
    assert trainer._accelerator_connector.use_distributed_sampler is injects


def _done(error: BaseException | None = None) -> Future[None]:
    part: Future[None] = Future()
    if error is None:
        part.set_result(None)
    else:
        part.set_exception(error)
    return part


def test_disk_op_completes_its_future_after_the_last_part_with_the_first_error() -> None:
    finished: list[int] = []
    outer: Future[None] = Future()
    op = DiskOp(outer, 3, finish=lambda: finished.append(1))
    op.part_done(_done())
    op.part_done(_done(OSError("first")))
    assert not outer.done() and not finished
    op.part_done(_done(OSError("second")))
    assert finished == [1]
    assert str(outer.exception()) == "first"
    clean: Future[None] = Future()
    DiskOp(clean, 1, finish=lambda: None).part_done(_done())
    assert clean.result() is None


def test_disk_op_hands_on_an_error_of_its_finish() -> None:
    def finish() -> None:
        raise OSError("fdatasync")

    outer: Future[None] = Future()
    DiskOp(outer, 1, finish=finish).part_done(_done())
    assert str(outer.exception()) == "fdatasync"


def test_copy_outcome_hands_on_result_or_error() -> None:
    ok: Future[None] = Future()
    copy_outcome(_done(), ok)
    assert ok.result() is None
    failed: Future[None] = Future()
    copy_outcome(_done(ValueError("x")), failed)
    assert isinstance(failed.exception(), ValueError)
