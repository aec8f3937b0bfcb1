"""Evaluation, inference and repeated runs, adversarially, against plain Lightning and plain Fabric.

Every probe runs the same module, seed and data under plain Lightning (``strategy="auto"``) and under PatrickStar in
four configurations: the defaults, the optimizer on the host, the host step's tail overlapped with the next forward
(``optimizer_overlap="next_forward"``), and that under a device budget small enough to force evictions
(``placement="static"``, 4096-element chunks, 48 KiB). 32-true must give plain's numbers within 3e-7 (relative on
losses; weights handed back within Adam's rounding), and a PatrickStar configuration must give the serial step's
bits where they are compared with each other.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from tests.helpers import assert_states_close
from tests.helpers.data import make_loader
from tests.helpers.models import N_EMBD, VOCAB, FlatGPT, TinyGPT, lm_loss
from tests.helpers.runs import LM, LossRecorder, make_trainer

RTOL = 3e-7  # 32-true losses against plain Lightning (relative)
WEIGHT_ATOL = 1e-5  # weights after Adam steps: Adam divides near-zero gradients by their own size
OUT_ATOL = 1e-5  # outputs of the trained model

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "host": {"optimizer_placement": "host"},
    "next_forward": {"optimizer_placement": "host", "optimizer_overlap": "next_forward"},
    "evicting": {
        "optimizer_placement": "host",
        "optimizer_overlap": "next_forward",
        "placement": "static",
        "chunk_size": 4096,
        "device_memory_limit": 3 * 4096 * 4,
    },
    "auto-evicting": {
        "optimizer_placement": "host",
        "optimizer_overlap": "next_forward",
        "placement": "auto",
        "chunk_size": 2048,
        "device_memory_limit": "600KiB",
    },
}
NAMES = tuple(n for n in CONFIGS if n != "host")  # "next_forward" runs the host optimizer and more; "host" where named


SMALL_EVICTING = {"chunk_size": 1024, "device_memory_limit": 2 * 1024 * 4}
"""For models of a few thousand parameters: 1024-element chunks, two of them on the device."""


SMALL_AUTO_EVICTING = {"chunk_size": 512, "device_memory_limit": "76KiB"}
BF16_AUTO_EVICTING = {"device_memory_limit": "240KiB"}


def strategy(name: str | None, small: bool = False, bf16: bool = False) -> Any:
    """Plain Lightning (``None``) or PatrickStar in configuration ``name`` (``small``: a small model's budget;
    ``bf16``: a bf16-mixed run's)."""
    if name is None:
        return "auto"
    options = CONFIGS[name]
    if small and name == "evicting":
        options = {**options, **SMALL_EVICTING}
    if small and name == "auto-evicting":
        options = {**options, **SMALL_AUTO_EVICTING}
    if bf16 and name == "auto-evicting":
        options = {**options, **BF16_AUTO_EVICTING}
    return PatrickStarStrategy(**options)


def assert_evicted_if(name: str, trainer: L.Trainer) -> None:
    if name.endswith("evicting"):
        report = trainer.strategy.memory_report()
        assert report.evictions > 0, f"the budget never forced an eviction:\n{report}"


def close(a: float, b: float, what: str, rtol: float = RTOL) -> None:
    assert abs(a - b) <= rtol * abs(b) + 1e-12, f"{what}: patrickstar {a!r} vs plain {b!r}"


def close_lists(got: list[float], ref: list[float], what: str, rtol: float = RTOL) -> None:
    assert len(got) == len(ref) > 0, f"{what}: {len(got)} values vs plain's {len(ref)}"
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        close(a, b, f"{what} [{i}]", rtol)


def val_loader() -> DataLoader:
    return make_loader(n_seq=12, seed=99)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- a LightningModule that evaluates in every way ----------------------------------------------------------------


class EvalLM(LM):
    """TinyGPT under fused AdamW; validation logs the loss, a norm computed from the weights and a torchmetrics
    accuracy; test logs the loss; predict returns logits. ``inference_in_val``: validation's forward runs under
    ``torch.inference_mode()`` (for ``Trainer(inference_mode=False)``)."""

    def __init__(self, inference_in_val: bool = False) -> None:
        super().__init__(lambda: TinyGPT())
        import torchmetrics

        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.inference_in_val = inference_in_val
        self.val_records: list[tuple[int, float, float]] = []

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.inference_in_val:
            with torch.inference_mode():
                logits = self(x)
        else:
            logits = self(x)
        loss = lm_loss(logits, y)
        wnorm = torch.linalg.vector_norm(torch.stack([p.detach().float().norm() for p in self.parameters()]))
        self.acc.update(logits.argmax(-1).reshape(-1), y.reshape(-1))
        self.log("val_loss", loss)
        self.log("wnorm", wnorm)
        self.log("val_acc", self.acc, on_epoch=True)
        self.val_records.append((self.trainer.global_step, float(loss), float(wnorm)))
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self(batch[0]), batch[1])
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def _eval_everything(name: str | None, inference_mode: bool) -> dict[str, Any]:
    rec = LossRecorder()
    trainer = make_trainer(
        strategy=strategy(name),
        max_steps=6,
        callbacks=[rec],
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=2,
        inference_mode=inference_mode,
    )
    module = EvalLM(inference_in_val=not inference_mode)
    before = trainer.validate(module, dataloaders=val_loader(), verbose=False)[0]
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24), val_dataloaders=val_loader())
    if name is not None:
        assert_evicted_if(name, trainer)
    tested = trainer.test(module, dataloaders=val_loader(), verbose=False)[0]
    predicted = trainer.predict(module, dataloaders=make_loader(n_seq=8))
    return {
        "before": before,
        "val": module.val_records,
        "tested": tested,
        "predicted": predicted,
        "losses": rec.losses,
        "state": snapshot(module),
    }


@pytest.mark.parametrize("inference_mode", [True, False], ids=["inference-mode", "no-inference-mode"])
@pytest.mark.parametrize("name", NAMES)
def test_validate_fit_with_mid_epoch_validation_test_and_predict(name: str, inference_mode: bool) -> None:
    """validate before fit, fit with a sanity check and validation every 2 steps (logging a weight norm and a
    torchmetrics accuracy), test and predict after fit on the same Trainer: plain Lightning's numbers."""
    ref = _eval_everything(None, inference_mode)
    got = _eval_everything(name, inference_mode)
    for key, value in ref["before"].items():
        close(got["before"][key], value, f"validate before fit: {key}")
    assert [r[0] for r in got["val"]] == [r[0] for r in ref["val"]], "validation ran at other steps"
    close_lists([r[1] for r in got["val"]], [r[1] for r in ref["val"]], "validation losses")
    close_lists([r[2] for r in got["val"]], [r[2] for r in ref["val"]], "weight norm logged in validation", 1e-6)
    close_lists(got["losses"], ref["losses"], "training losses")
    for key, value in ref["tested"].items():
        close(got["tested"][key], value, f"test after fit: {key}", 1e-6)
    assert len(got["predicted"]) == len(ref["predicted"])
    for a, b in zip(got["predicted"], ref["predicted"], strict=True):
        assert type(a) is torch.Tensor and a.dtype == torch.float32 and a.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=OUT_ATOL)
    assert_states_close(got["state"], ref["state"], what=f"{name}: module after fit", atol=WEIGHT_ATOL)


# ---- the module handed back --------------------------------------------------------------------------------------


def _fit_and_hand_back(name: str | None, tmp_path: Path) -> dict[str, Any]:
    module = EvalLM()
    trainer = make_trainer(strategy=strategy(name), max_steps=5)
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
    if name is not None:
        assert_evicted_if(name, trainer)
    x = make_loader(n_seq=4, seed=7).dataset.tensors[0]
    out: dict[str, Any] = {"module": module}
    params = list(module.parameters())
    for p in params:
        assert type(p) is nn.Parameter, f"{type(p).__name__} handed back"
        assert p.device.type == "cpu" and p.dtype == torch.float32 and not p.is_meta
    assert module.net.wte.weight is module.net.lm_head.weight, "the tie was lost"
    module.train()
    out["train_out"] = module(x).detach()
    module.eval()
    with torch.no_grad():
        out["eval_out"] = module(x)
    out["state"] = snapshot(module)
    # a backward through the handed-back module gives plain gradients
    module.zero_grad(set_to_none=True)
    lm_loss(module(x), x).backward()
    out["grads"] = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    clone = copy.deepcopy(module)
    with torch.no_grad():
        out["copy_out"] = clone(x)
    torch.save(module, tmp_path / f"{name}.pt")
    loaded = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    with torch.no_grad():
        out["loaded_out"] = loaded(x)
    double = copy.deepcopy(module).to(torch.float64)
    with torch.no_grad():
        out["double_out"] = double(x)
    assert out["double_out"].dtype == torch.float64
    return out


@pytest.mark.parametrize("name", NAMES)
def test_module_after_fit_is_plain(name: str, tmp_path: Path) -> None:
    """After fit, the module's parameters are plain fp32 CPU ``nn.Parameter``s with the trained values, the tie
    kept: its forward (train and eval), state_dict, gradients, deepcopy, ``torch.save`` and ``.to(float64)`` give
    plain Lightning's."""
    ref = _fit_and_hand_back(None, tmp_path)
    got = _fit_and_hand_back(name, tmp_path)
    assert_states_close(got["state"], ref["state"], what=f"{name}: state_dict after fit", atol=WEIGHT_ATOL)
    for key in ("train_out", "eval_out", "copy_out", "loaded_out", "double_out"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=OUT_ATOL, msg=lambda m, k=key: f"{k}: {m}")
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for n, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"grad {n}: {m}")
    # and the module is still trainable by plain PyTorch
    module = got["module"]
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    x, y = next(iter(make_loader(n_seq=4)))
    lm_loss(module(x), y).backward()
    opt.step()


# ---- fitting again -------------------------------------------------------------------------------------------------


def _fit_again(name: str | None) -> dict[str, Any]:
    rec, rec2 = LossRecorder(), LossRecorder()
    module = EvalLM()
    trainer = make_trainer(strategy=strategy(name), max_steps=3, callbacks=[rec])
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
    after_first = snapshot(module)
    trainer.fit_loop.epoch_loop.max_steps = 6  # the same Trainer, more steps
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
    steps = trainer.global_step
    after_second = snapshot(module)
    other = make_trainer(strategy=strategy(name), max_steps=4, callbacks=[rec2])  # a new Trainer, same module
    other.fit(module, train_dataloaders=make_loader(n_seq=24, seed=5))
    if name is not None:
        assert_evicted_if(name, other)
    return {
        "losses": rec.losses,
        "losses2": rec2.losses,
        "steps": steps,
        "first": after_first,
        "second": after_second,
        "third": snapshot(module),
    }


@pytest.mark.parametrize("name", NAMES)
def test_same_trainer_more_max_steps_then_a_new_trainer(name: str) -> None:
    """``trainer.fit`` for 3 steps, the same Trainer fits again with ``max_steps`` raised to 6, then a new Trainer
    fits the module the first trained: plain Lightning's losses and weights at each point."""
    ref = _fit_again(None)
    got = _fit_again(name)
    assert got["steps"] == ref["steps"]
    close_lists(got["losses"], ref["losses"], "same Trainer's two fits")
    close_lists(got["losses2"], ref["losses2"], "new Trainer's fit", 1e-6)
    for key in ("first", "second", "third"):
        assert_states_close(got[key], ref[key], what=f"{name}: after fit {key}", atol=WEIGHT_ATOL)


def _resume_in_process(name: str | None, tmp_path: Path) -> dict[str, Any]:
    ckpt_dir = tmp_path / str(name)
    module = EvalLM()
    first = make_trainer(
        strategy=strategy(name),
        max_steps=4,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
    )
    first.fit(module, train_dataloaders=make_loader(n_seq=24))
    rec = LossRecorder()
    resumed = EvalLM()
    second = make_trainer(strategy=strategy(name), max_steps=8, callbacks=[rec])
    second.fit(resumed, train_dataloaders=make_loader(n_seq=24), ckpt_path=str(ckpt_dir / "last.ckpt"))
    # the first module, trained on by a third Trainer from the same checkpoint, again
    rec3 = LossRecorder()
    third = make_trainer(strategy=strategy(name), max_steps=8, callbacks=[rec3])
    third.fit(module, train_dataloaders=make_loader(n_seq=24), ckpt_path=str(ckpt_dir / "last.ckpt"))
    return {"losses": rec.losses, "resumed": snapshot(resumed), "losses3": rec3.losses, "again": snapshot(module)}


@pytest.mark.parametrize("name", NAMES)
def test_fit_from_a_checkpoint_written_in_the_same_process(name: str, tmp_path: Path) -> None:
    """A fit writes ``last.ckpt``; a new module and Trainer resume from it, and the first module (already handed
    back) is fitted from it again by a third Trainer: plain Lightning's resumed runs, and both the same."""
    ref = _resume_in_process(None, tmp_path)
    got = _resume_in_process(name, tmp_path)
    close_lists(got["losses"], ref["losses"], "resumed fit")
    close_lists(got["losses3"], ref["losses3"], "first module resumed again")
    assert got["losses"] == got["losses3"]
    assert_states_close(got["resumed"], ref["resumed"], what=f"{name}: resumed", atol=WEIGHT_ATOL)
    assert_states_close(got["again"], got["resumed"], what=f"{name}: first module resumed again", atol=0, rtol=0)


# ---- stopping early, limits, accumulation windows at the epoch's end -----------------------------------------------


class StopInHook(L.Callback):
    """``trainer.should_stop = True`` in ``on_train_batch_end`` at global step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            trainer.should_stop = True


SCHEDULES: dict[str, dict[str, Any]] = {
    "early-stopping": {
        "max_epochs": 10,
        "callbacks": lambda: [EarlyStopping(monitor="val_loss", mode="max", patience=0)],
        "val": True,
    },
    "should-stop-in-hook-mid-window": {
        "max_epochs": 3,
        "accumulate_grad_batches": 2,
        "callbacks": lambda: [StopInHook(4)],
    },
    "limit-int-partial-window": {"max_epochs": 2, "limit_train_batches": 5, "accumulate_grad_batches": 2},
    "limit-float-partial-window": {"max_epochs": 2, "limit_train_batches": 0.7, "accumulate_grad_batches": 3},
    "epoch-not-multiple-of-accumulation": {"max_epochs": 2, "accumulate_grad_batches": 4},
    "check-val-every-2nd-epoch": {"max_epochs": 4, "check_val_every_n_epoch": 2, "limit_train_batches": 3, "val": True},
}


def _scheduled(name: str | None, case: str) -> dict[str, Any]:
    spec = dict(SCHEDULES[case])
    callbacks = spec.pop("callbacks", lambda: [])()
    val = spec.pop("val", False)
    rec = LossRecorder()
    module = EvalLM()
    trainer = make_trainer(strategy=strategy(name), max_steps=-1, callbacks=[rec, *callbacks], **spec)
    trainer.fit(module, train_dataloaders=make_loader(n_seq=26), val_dataloaders=val_loader() if val else None)
    if name is not None:
        assert_evicted_if(name, trainer)
    return {
        "losses": rec.losses,
        "val": module.val_records,
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "state": snapshot(module),
        "optim": trainer.optimizers[0].state_dict()["state"],
    }


@pytest.mark.parametrize("case", sorted(SCHEDULES))
@pytest.mark.parametrize("name", NAMES)
def test_stopping_limits_and_partial_windows(name: str, case: str) -> None:
    """EarlyStopping, ``should_stop`` set in a hook inside an accumulation window, int and float
    ``limit_train_batches`` leaving a short last window, an epoch (7 batches) not a multiple of the accumulation, and
    validation every second epoch: the same steps, epochs, losses, validations and weights as plain Lightning."""
    ref = _scheduled(None, case)
    got = _scheduled(name, case)
    assert (got["step"], got["epoch"]) == (ref["step"], ref["epoch"]), "stopped elsewhere"
    close_lists(got["losses"], ref["losses"], "training losses")
    assert [r[0] for r in got["val"]] == [r[0] for r in ref["val"]], "validation ran at other steps"
    if ref["val"]:
        close_lists([r[1] for r in got["val"]], [r[1] for r in ref["val"]], "validation losses")
    assert_states_close(got["state"], ref["state"], what=f"{name}: {case}", atol=WEIGHT_ATOL)
    for i, entry in ref["optim"].items():
        for k, v in entry.items():
            have = got["optim"][i][k]
            torch.testing.assert_close(have, v, rtol=1e-4, atol=1e-6, msg=lambda m, i=i, k=k: f"{i}/{k}: {m}")


@pytest.mark.parametrize("name", ["next_forward", "evicting"])
def test_max_time_stops_where_plain_would_at_that_step(name: str) -> None:
    """``max_time`` ends a long run after some steps (however many): the weights handed back and the losses are
    plain Lightning's run of exactly that many steps."""
    rec = LossRecorder()
    module = EvalLM()
    trainer = make_trainer(
        strategy=strategy(name), max_steps=-1, max_epochs=10_000, max_time={"seconds": 1}, callbacks=[rec]
    )
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
    steps = trainer.global_step
    assert 0 < steps < 60_000, steps
    assert_evicted_if(name, trainer)
    ref_rec = LossRecorder()
    ref_module = EvalLM()
    make_trainer(strategy="auto", max_steps=steps, callbacks=[ref_rec]).fit(
        ref_module, train_dataloaders=make_loader(n_seq=24)
    )
    close_lists(rec.losses, ref_rec.losses, "losses", 1e-5)
    assert_states_close(snapshot(module), snapshot(ref_module), what=f"{name}: after max_time", atol=1e-4)


# ---- dropout and BatchNorm: train and eval modes, frozen statistics, inference mode in validation --------------------


class DropBN(nn.Module):
    """Embedding -> Linear -> BatchNorm1d over channels -> dropout -> a frozen-able BatchNorm1d -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, N_EMBD)
        self.lin = nn.Linear(N_EMBD, N_EMBD)
        self.bn = nn.BatchNorm1d(N_EMBD)
        self.drop = nn.Dropout(0.3)
        self.frozen_bn = nn.BatchNorm1d(N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.lin(self.emb(idx))  # (B, T, C)
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        x = self.drop(F.gelu(x))
        x = self.frozen_bn(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x)


class DropBNLM(LM):
    """``freeze_bn``: ``frozen_bn.train(False)`` inside every training step (its running statistics used and kept).
    Validation runs under ``torch.inference_mode()`` and records its losses."""

    def __init__(self, freeze_bn: bool) -> None:
        super().__init__(DropBN)
        self.freeze_bn = freeze_bn
        self.val_losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.freeze_bn:
            self.net.frozen_bn.train(False)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert not self.net.training and not self.net.drop.training
        with torch.inference_mode():
            loss = lm_loss(self(batch[0]), batch[1])
        self.val_losses.append(float(loss))
        return loss


def _dropout_bn(name: str | None, freeze_bn: bool) -> dict[str, Any]:
    L.seed_everything(11, verbose=False)
    rec = LossRecorder()
    module = DropBNLM(freeze_bn)
    trainer = make_trainer(
        strategy=strategy(name, small=True),
        max_steps=6,
        callbacks=[rec],
        val_check_interval=2,
        limit_val_batches=2,
        inference_mode=False,
    )
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24), val_dataloaders=val_loader())
    if name is not None:
        assert_evicted_if(name, trainer)
    module.eval()
    x = make_loader(n_seq=4, seed=7).dataset.tensors[0]
    with torch.no_grad():
        out = module(x)
    return {"losses": rec.losses, "val": module.val_losses, "state": snapshot(module), "out": out}


@pytest.mark.parametrize("freeze_bn", [False, True], ids=["bn-training", "bn-frozen-in-step"])
@pytest.mark.parametrize("name", NAMES)
def test_dropout_and_batchnorm_train_eval_and_frozen(name: str, freeze_bn: bool) -> None:
    """Dropout draws the same masks (the engine consumes no random numbers), BatchNorm's running statistics are
    updated as plain Lightning's, used in validation (eval mode, under ``torch.inference_mode()``) and in the
    handed-back module's eval forward, and a BatchNorm put in eval mode inside the training step keeps its
    statistics."""
    ref = _dropout_bn(None, freeze_bn)
    got = _dropout_bn(name, freeze_bn)
    close_lists(got["losses"], ref["losses"], "training losses (dropout masks)")
    close_lists(got["val"], ref["val"], "validation losses (running statistics)", 1e-6)
    assert_states_close(got["state"], ref["state"], what=f"{name}: weights and BatchNorm buffers", atol=WEIGHT_ATOL)
    torch.testing.assert_close(got["out"], ref["out"], rtol=1e-5, atol=OUT_ATOL)
    if freeze_bn:
        assert torch.equal(got["state"]["net.frozen_bn.running_mean"], torch.zeros(N_EMBD))
        assert int(got["state"]["net.frozen_bn.num_batches_tracked"]) == 0


# ---- Fabric ---------------------------------------------------------------------------------------------------------


class ScoredGPT(FlatGPT):
    """FlatGPT (no key bias: final weights compare across strategies) with dropout on the position embeddings and
    ``score``, a method Fabric is told is a forward (``mark_forward_method``): the mean log-likelihood."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.wpe.register_forward_hook(lambda m, i, o: self.drop(o))

    def score(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -lm_loss(self(idx), targets)


def fabric_strategy(name: str | None) -> Any:
    return "auto" if name is None else PatrickStarFabricStrategy(**CONFIGS[name])


def _fabric_loop(name: str | None, tmp_path: Path, no_grad: Any = torch.no_grad) -> dict[str, Any]:
    """4 steps of 2 micro-batches (``no_backward_sync``); after each step an eval pass (``model.eval()``,
    ``torch.no_grad()``) through ``forward`` and the marked ``score``; a save after step 2; then a load of that save
    and the last two steps again."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=fabric_strategy(name), precision="32-true")
    fabric.launch()
    fabric.seed_everything(3)
    net = ScoredGPT()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01))
    model.mark_forward_method("score")
    batches = list(make_loader(n_seq=40, batch_size=4))
    held_out = fabric.to_device(next(iter(make_loader(n_seq=4, seed=7))))
    out: dict[str, Any] = {"losses": [], "evals": [], "scores": []}
    model.eval()
    with no_grad():  # an evaluation before any training step
        out["evals"].append(float(lm_loss(model(held_out[0]), held_out[1])))
    path = tmp_path / f"fabric-{name}.ckpt"

    def steps(first: int, last: int, record: str) -> None:
        for step in range(first, last):
            model.train()
            for micro in range(2):
                x, y = fabric.to_device(batches[2 * step + micro])
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    loss = lm_loss(model(x), y)
                    fabric.backward(loss / 2)
                out[record].append(float(loss))
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            with no_grad():
                out["evals"].append(float(lm_loss(model(held_out[0]), held_out[1])))
                out["scores"].append(float(model.score(*held_out)))
            if step == 1 and record == "losses":
                rng = torch.get_rng_state()
                fabric.save(path, {"model": model, "optimizer": optimizer, "step": step + 1, "rng": rng})

    steps(0, 4, "losses")
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if name is not None:
        report = fabric.strategy.memory_report()
        assert name != "evicting" or report.evictions > 0, report
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0, "rng": None}
    fabric.load(path, state)
    assert state["step"] == 2
    torch.set_rng_state(state["rng"])  # the same dropout masks as the first time
    out["again"] = []
    steps(2, 4, "again")
    out["state_again"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


# Under an evicting budget a forward in torch.inference_mode() allocated chunk buffers as inference tensors, and a
# later in-place write (fabric.load, the host step's copy-out, a chunk move) raised 'Inplace update to inference tensor
# outside InferenceMode'; the engine now makes its buffers and views outside inference mode (runtime/chunk.py).


class InferenceTensorChunk(AssertionError):
    """torch refused an in-place write into a chunk buffer that became an inference tensor."""


@contextlib.contextmanager
def inference_tensor_refusal() -> Any:
    """Turns torch's 'Inplace update to inference tensor' RuntimeError into :class:`InferenceTensorChunk`, so an
    xfail names exactly that defect."""
    try:
        yield
    except RuntimeError as error:
        if "Inplace update to inference tensor" in str(error):
            raise InferenceTensorChunk(str(error)) from error
        raise


def _fabric_cases() -> list[Any]:
    cases = []
    for name in NAMES:
        for grad_mode in ("no_grad", "inference_mode"):
            cases.append(pytest.param(name, grad_mode, id=f"{name}-{grad_mode}"))
    return cases


@pytest.mark.parametrize(("name", "grad_mode"), _fabric_cases())
def test_fabric_eval_between_steps_marked_method_and_reload(name: str, grad_mode: str, tmp_path: Path) -> None:
    """Fabric with dropout: micro-batches under ``no_backward_sync``, an eval pass in eval mode (under no_grad or
    inference mode, the first before any step) through
    the forward and a ``mark_forward_method`` method after every step, batches moved by ``fabric.to_device``, a save,
    then a load in the same process and the same steps again: plain Fabric's numbers, and the replay the same as
    the first time."""
    ref = _fabric_loop(None, tmp_path, getattr(torch, grad_mode))
    with inference_tensor_refusal():
        got = _fabric_loop(name, tmp_path, getattr(torch, grad_mode))
    close_lists(got["losses"], ref["losses"], "training losses")
    close_lists(got["evals"], ref["evals"], "eval losses", 1e-6)
    close_lists(got["scores"], ref["scores"], "scores through the marked method", 1e-6)
    close_lists(got["again"], ref["again"], "training losses after the load", 1e-6)
    assert got["again"] == got["losses"][4:], "the replay after the load differs from the first run"
    for key in ("state", "state_again"):
        want = {k: v for k, v in ref[key].items()}
        have = {k.removeprefix("_forward_module."): v for k, v in got[key].items()}
        assert_states_close(have, want, what=f"{name}: {key}", atol=WEIGHT_ATOL)


@pytest.mark.parametrize("name", ["evicting", "auto-evicting"])
def test_fabric_load_after_an_inference_mode_forward_under_evictions(name: str, tmp_path: Path) -> None:
    """The smallest case: set up, save, one forward under ``torch.inference_mode()`` (chunks fetched and evicted),
    ``fabric.load`` of the save: plain Fabric loads (and so does PatrickStar without a budget)."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=fabric_strategy(name), precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    net = FlatGPT()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    x = next(iter(make_loader(n_seq=4)))[0]
    path = tmp_path / "start.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    with torch.inference_mode():
        model(x)
    assert fabric.strategy.memory_report().evictions > 0
    with inference_tensor_refusal():
        fabric.load(path, {"model": model, "optimizer": optimizer})


def _two_models(name: str | None) -> dict[str, Any]:
    """Model A trains 2 steps; then ``fabric.setup`` of model B: plain Fabric trains both alternately; PatrickStar
    refuses (one model per strategy) and A trains on alone. Returns A's losses, A's and B's states."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=fabric_strategy(name), precision="32-true")
    fabric.launch()
    torch.manual_seed(5)
    a_net = FlatGPT()
    a, a_opt = fabric.setup(a_net, torch.optim.AdamW(a_net.parameters(), lr=1e-2))
    batches = list(make_loader(n_seq=24, batch_size=4))
    losses: list[float] = []

    def step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(loss)

    for x, y in batches[:2]:
        losses.append(step(a, a_opt, x, y))
    torch.manual_seed(6)
    b_net = FlatGPT(n_embd=16)
    b_before = {k: v.detach().clone() for k, v in b_net.state_dict().items()}
    b_opt = torch.optim.AdamW(b_net.parameters(), lr=1e-2)
    if name is None:
        b, b_opt = fabric.setup(b_net, b_opt)
    else:
        with pytest.raises(RuntimeError, match=r"manages one model and one was set up already.*HINT"):
            fabric.setup(b_net, b_opt)
        b = None
        for p in b_net.parameters():
            assert type(p) is nn.Parameter and not p.is_meta
        assert_states_close(b_net.state_dict(), b_before, what="the refused model", atol=0, rtol=0)
    for x, y in batches[2:]:
        losses.append(step(a, a_opt, x, y))
        if b is not None:
            step(b, b_opt, x, y)
    return {
        "losses": losses,
        "a": {k: v.detach().clone() for k, v in fabric.strategy.get_module_state_dict(a._forward_module).items()},
    }


@pytest.mark.parametrize("name", NAMES)
def test_fabric_second_setup_of_another_model_refused_first_keeps_training(name: str) -> None:
    """A second ``fabric.setup`` of another model in the same Fabric after the first trained is refused, naming the
    fix, leaving the second model as it was; the first trains on exactly as under plain Fabric (where the second
    model trains alongside it on its own parameters)."""
    ref = _two_models(None)
    got = _two_models(name)
    close_lists(got["losses"], ref["losses"], "the first model's losses")
    assert_states_close(got["a"], ref["a"], what=f"{name}: first model", atol=WEIGHT_ATOL)


# ---- evaluation from a checkpoint, mixed precision leaves the weights alone, switching strategies ------------------


class LoggedEvalLM(EvalLM):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def _eval_from_checkpoints(name: str | None, layout: str, tmp_path: Path) -> dict[str, Any]:
    ckpt_dir = tmp_path / f"{name}-{layout}"
    options = {} if name is None else {"checkpoint": layout}
    strat = "auto" if name is None else PatrickStarStrategy(**{**CONFIGS[name], **options})
    module = LoggedEvalLM()
    trainer = make_trainer(
        strategy=strat,
        max_steps=8,
        enable_checkpointing=True,
        val_check_interval=2,
        limit_val_batches=2,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=1, every_n_train_steps=2)],
    )
    trainer.fit(module, train_dataloaders=make_loader(n_seq=32), val_dataloaders=val_loader())
    best = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    out = {
        "best": Path(best).name,
        "val_best": trainer.validate(module, dataloaders=val_loader(), ckpt_path="best", verbose=False)[0],
        "test_best": trainer.test(module, dataloaders=val_loader(), ckpt_path="best", verbose=False)[0],
        "after_best": snapshot(module),
    }
    fresh = LoggedEvalLM()
    other = make_trainer(strategy="auto" if name is None else PatrickStarStrategy(**CONFIGS[name]))
    out["predict_fresh"] = torch.cat(other.predict(fresh, dataloaders=make_loader(n_seq=8), ckpt_path=best))
    return out


@pytest.mark.parametrize("layout", ["consolidated", "sharded"])
@pytest.mark.parametrize("name", ["default", "evicting"])
def test_validate_test_predict_from_the_best_checkpoint(name: str, layout: str, tmp_path: Path) -> None:
    """After a fit that keeps the best checkpoint by ``val_loss``, ``validate``/``test`` with ``ckpt_path="best"``
    on the same Trainer and ``predict`` by a new Trainer with a fresh module and the best checkpoint's path: plain
    Lightning's choice and numbers, and the module left holding the best checkpoint's weights."""
    ref = _eval_from_checkpoints(None, layout, tmp_path)
    got = _eval_from_checkpoints(name, layout, tmp_path)
    assert got["best"] == ref["best"]
    for key in ("val_best", "test_best"):
        for metric, value in ref[key].items():
            close(got[key][metric], value, f"{key}: {metric}", 1e-6)
    assert_states_close(got["after_best"], ref["after_best"], what=f"{name}: module after eval from best")
    torch.testing.assert_close(got["predict_fresh"], ref["predict_fresh"], rtol=1e-5, atol=OUT_ATOL)


def _bf16_eval_then_fit(name: str, evaluate: bool) -> dict[str, Any]:
    rec = LossRecorder()
    module = EvalLM()
    initial = snapshot(module)
    trainer = make_trainer(
        strategy=strategy(name, bf16=True),
        precision="bf16-mixed",
        max_steps=5,
        callbacks=[rec],
        val_check_interval=2,
        limit_val_batches=2,
    )
    out: dict[str, Any] = {}
    if evaluate:
        out["validate"] = trainer.validate(module, dataloaders=val_loader(), verbose=False)[0]
        out["predict"] = torch.cat(trainer.predict(module, dataloaders=make_loader(n_seq=8)))
        out["test"] = trainer.test(module, dataloaders=val_loader(), verbose=False)[0]
        after_eval = snapshot(module)
        for k, v in initial.items():
            assert after_eval[k].dtype == v.dtype and torch.equal(after_eval[k], v), f"evaluation changed {k}"
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24), val_dataloaders=val_loader())
    assert_evicted_if(name, trainer)
    out["losses"] = rec.losses
    out["val"] = module.val_records
    out["state"] = snapshot(module)
    out["recorded"] = rec.final_state
    return out


@pytest.mark.parametrize("name", NAMES)
def test_bf16_evaluation_leaves_fp32_weights_and_the_fit_alone(name: str) -> None:
    """bf16-mixed: ``validate``/``predict``/``test`` before fit leave the module's fp32 weights bit for bit; the fit
    afterwards is bit for bit the fit without them; the module handed back holds the fp32 masters (what a checkpoint
    stores), not their bf16 copies; and every configuration gives the serial step's bits."""
    serial_opts = {"optimizer_placement": "host", "optimizer_overlap": "off"}
    CONFIGS["_serial"] = serial_opts
    try:
        serial = _bf16_eval_then_fit("_serial", False)
    finally:
        del CONFIGS["_serial"]
    got = _bf16_eval_then_fit(name, True)
    assert got["losses"] == serial["losses"], f"{name}: training losses against the serial step without evaluation"
    assert [r[1:] for r in got["val"][-4:]] == [r[1:] for r in serial["val"][-4:]], "validation during fit"
    for k, v in serial["state"].items():
        assert torch.equal(got["state"][k], v), f"{name}: {k} handed back differs from the serial run's"
    for k, v in got["recorded"].items():
        assert torch.equal(got["state"][k], v), f"{name}: {k} handed back is not the fp32 master"
    trained = [v for k, v in got["state"].items() if "weight" in k and v.is_floating_point()]
    assert any(not torch.equal(v, v.bfloat16().float()) for v in trained), "weights handed back rounded to bf16"


def _switch(first: str | None, second: str | None) -> dict[str, Any]:
    module = EvalLM()
    rec1, rec2 = LossRecorder(), LossRecorder()
    make_trainer(strategy=strategy(first), max_steps=3, callbacks=[rec1]).fit(
        module, train_dataloaders=make_loader(n_seq=24)
    )
    make_trainer(strategy=strategy(second), max_steps=3, callbacks=[rec2]).fit(
        module, train_dataloaders=make_loader(n_seq=24, seed=5)
    )
    return {"losses": rec1.losses + rec2.losses, "state": snapshot(module)}


@pytest.mark.parametrize("name", ["next_forward", "evicting"])
@pytest.mark.parametrize("order", ["pstar-then-plain", "plain-then-pstar"])
def test_module_moves_between_patrickstar_and_plain_trainers(name: str, order: str) -> None:
    """The same module fitted by a PatrickStar Trainer and then a plain one (and the other way round): plain
    Lightning's two fits."""
    ref = _switch(None, None)
    got = _switch(name, None) if order == "pstar-then-plain" else _switch(None, name)
    close_lists(got["losses"], ref["losses"], "losses of both fits", 1e-6)
    assert_states_close(got["state"], ref["state"], what=f"{order}: module after both fits", atol=WEIGHT_ATOL)


# ---- tensors that outlive the run ------------------------------------------------------------------------------------

_KEPT_VIEW_SCRIPT = r"""
import sys, torch
from lightning_pstar import PatrickStarStrategy
from tests.helpers.data import make_loader
from tests.helpers.models import TinyGPT
from tests.helpers.runs import LM, make_trainer

fit, options = sys.argv[1] == "fit", eval(sys.argv[2])

class KeepsAView(LM):
    def __init__(self):
        super().__init__(lambda: TinyGPT())
    def predict_step(self, batch, batch_idx):
        pos = self.net.wpe.weight[: batch[0].shape[1]]  # a view of a weight, taken before the forward
        self(batch[0])  # the forward moves chunks (evictions under the budget)
        return pos

def run(strategy):
    module = KeepsAView()
    trainer = make_trainer(strategy=strategy, max_steps=2)
    if fit:
        trainer.fit(module, train_dataloaders=make_loader(n_seq=8))
    preds = trainer.predict(module, dataloaders=make_loader(n_seq=8))
    return [p.clone() for p in preds]  # read after the run

ref = run("auto")
got = run(PatrickStarStrategy(**options))
print("MAXDIFF", max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)), flush=True)
"""


def _kept_view(tmp_path: Path, fit: bool, options: dict[str, Any]) -> tuple[int, str]:
    import subprocess
    import sys

    script = tmp_path / "kept_view.py"
    script.write_text(_KEPT_VIEW_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(script), "fit" if fit else "nofit", repr(options)],
        capture_output=True,
        text=True,
        cwd=root,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("name", ["default", "host"])
def test_prediction_holding_a_weight_view_outlives_the_run(name: str, tmp_path: Path) -> None:
    """``predict_step`` returns a slice of a weight (``wpe.weight[:T]``) taken before its forward: read after
    ``trainer.predict`` it holds plain Lightning's values (no budget: no eviction)."""
    rc, out = _kept_view(tmp_path, True, CONFIGS[name])
    assert rc == 0, f"the process died (rc {rc}):\n{out}"
    assert "MAXDIFF 0.0" in out, out


@pytest.mark.xfail(
    strict=True,
    reason="a view of a weight taken before an eviction dangles: predict's returned tensor segfaults when read",
)
@pytest.mark.parametrize("fit", [True, False], ids=["after-fit", "predict-only"])
def test_prediction_holding_a_weight_view_under_evictions(fit: bool, tmp_path: Path) -> None:
    """The same under a device budget that evicts (``placement="static"``, 48 KiB): the returned view must keep
    plain Lightning's values (or the engine must refuse naming the parameter); the process must not crash."""
    options = {"placement": "static", "chunk_size": 4096, "device_memory_limit": 3 * 4096 * 4}
    rc, out = _kept_view(tmp_path, fit, options)
    assert rc == 0, f"the process died (rc {rc}):\n{out}"
    assert "MAXDIFF 0.0" in out, out


class KeepViews(L.Callback):
    """Keeps ``lm_head.weight.detach()`` (a view, not a copy) after every training and validation batch."""

    def __init__(self) -> None:
        self.views: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.views.append(pl_module.net.lm_head.weight.detach())

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.views.append(pl_module.net.lm_head.weight.detach())


@pytest.mark.parametrize("name", ["default", "host"])
def test_views_kept_during_training_read_the_final_weights(name: str) -> None:
    """Views of a weight kept by a callback during training and validation read, after fit, the final weight (as
    in plain Lightning, where they alias the parameter); no budget, so no eviction frees their chunk."""
    module = EvalLM()
    keep = KeepViews()
    trainer = make_trainer(
        strategy=strategy(name), max_steps=3, callbacks=[keep], val_check_interval=1, limit_val_batches=1
    )
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24), val_dataloaders=val_loader())
    assert len(keep.views) == 6
    for i, view in enumerate(keep.views):
        assert torch.equal(view, module.net.lm_head.weight.detach()), f"view {i} does not read the final weight"


def _other_module_on_the_same_trainer(name: str | None) -> dict[str, Any]:
    trainer = make_trainer(strategy=strategy(name), max_steps=3)
    first = EvalLM()
    trainer.fit(first, train_dataloaders=make_loader(n_seq=24))
    second = EvalLM()
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(0.5)
    out: dict[str, Any] = {
        "val2": trainer.validate(second, dataloaders=val_loader(), verbose=False)[0]["val_loss"],
        "test2": trainer.test(second, dataloaders=val_loader(), verbose=False)[0]["test_loss"],
        "pred2": torch.cat(trainer.predict(second, dataloaders=make_loader(n_seq=8))),
        "val1": trainer.validate(first, dataloaders=val_loader(), verbose=False)[0]["val_loss"],
    }
    rec = LossRecorder()
    trainer.callbacks.append(rec)
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(second, train_dataloaders=make_loader(n_seq=24))
    if name is not None:
        assert_evicted_if(name, trainer)
    out["losses2"] = rec.losses
    out["first"], out["second"] = snapshot(first), snapshot(second)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_another_module_on_a_trainer_that_fitted_one(name: str) -> None:
    """After ``trainer.fit(first)``, the same Trainer validates, tests and predicts with a second module (its weights
    halved), validates the first again, then fits the second: each run uses the module it is given, as in plain
    Lightning, and the first module is left as it was trained."""
    ref = _other_module_on_the_same_trainer(None)
    got = _other_module_on_the_same_trainer(name)
    for key in ("val2", "test2", "val1"):
        close(got[key], ref[key], key, 1e-6)
    torch.testing.assert_close(got["pred2"], ref["pred2"], rtol=1e-5, atol=OUT_ATOL)
    close_lists(got["losses2"], ref["losses2"], "second module's fit", 1e-6)
    assert_states_close(got["first"], ref["first"], what=f"{name}: first module", atol=WEIGHT_ATOL)
    assert_states_close(got["second"], ref["second"], what=f"{name}: second module", atol=WEIGHT_ATOL)


# ---- a backward inside validation ------------------------------------------------------------------------------------


class SaliencyLM(EvalLM):
    """Validation under ``torch.enable_grad()`` (with ``Trainer(inference_mode=False)``): ``kind="input"`` takes the
    gradient of the loss with respect to the input embeddings (``torch.autograd.grad``), ``"backward"`` calls
    ``loss.backward()`` (gradients into ``p.grad`` that the next training step's ``zero_grad`` drops), ``"none"``
    only evaluates."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.enable_grad():
            if self.kind == "input":
                net = self.net
                emb = net.wte(x).detach().requires_grad_(True)
                h = emb + net.wpe(torch.arange(x.shape[1]))
                for block in net.blocks:
                    h = block(h)
                h = net.ln_f(h)
                loss = lm_loss(net.lm_head(h + net.frozen(h)), y)
                (grad,) = torch.autograd.grad(loss, emb)
                value = float(grad.float().abs().sum())
            else:
                loss = lm_loss(self(x), y)
                if self.kind == "backward":
                    loss.backward()
                value = float(loss)
        self.val_records.append((self.trainer.global_step, value, 0.0))
        return loss.detach()


def _saliency(name: str | None, kind: str, precision: str) -> dict[str, Any]:
    rec = LossRecorder()
    module = SaliencyLM(kind)
    trainer = make_trainer(
        strategy=strategy(name, bf16=precision == "bf16-mixed"),
        precision=precision,
        max_steps=4,
        callbacks=[rec],
        val_check_interval=2,
        limit_val_batches=1,
        inference_mode=False,
    )
    trainer.fit(module, train_dataloaders=make_loader(n_seq=24), val_dataloaders=val_loader())
    if name is not None:
        assert_evicted_if(name, trainer)
    return {"losses": rec.losses, "val": module.val_records, "state": snapshot(module)}


@pytest.mark.parametrize("kind", ["input", "backward"])
@pytest.mark.parametrize("name", NAMES)
def test_backward_inside_validation(name: str, kind: str) -> None:
    """A gradient taken inside validation (input saliency, or a full ``loss.backward()``) between training steps:
    32-true gives plain Lightning's validation values and training; in bf16-mixed the training is bit for bit that
    of a run whose validation takes no gradient (validation must not leak into the chunks' gradient slots, which
    bf16-mixed shares with the weights)."""
    ref = _saliency(None, kind, "32-true")
    got = _saliency(name, kind, "32-true")
    close_lists(got["losses"], ref["losses"], "training losses")
    close_lists([r[1] for r in got["val"]], [r[1] for r in ref["val"]], "validation values", 1e-6)
    assert_states_close(got["state"], ref["state"], what=f"{name}: {kind}", atol=WEIGHT_ATOL)
    quiet = _saliency(name, "none", "bf16-mixed")
    loud = _saliency(name, kind, "bf16-mixed")
    assert loud["losses"] == quiet["losses"], "bf16-mixed: a gradient in validation changed the training"
    for k, v in quiet["state"].items():
        assert torch.equal(loud["state"][k], v), f"bf16-mixed: a gradient in validation changed {k}"


# ---- interrupted, then fitted again ------------------------------------------------------------------------------


class InterruptAt(L.Callback):
    """Raises ``KeyboardInterrupt`` (Ctrl-C; Lightning ends the run gracefully) after global step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise KeyboardInterrupt


def _interrupted(name: str | None) -> dict[str, Any]:
    module = EvalLM()
    first = make_trainer(strategy=strategy(name), max_steps=6, callbacks=[InterruptAt(2)])
    with pytest.raises(SystemExit):  # Lightning 2.x: a graceful shutdown, then exit(1)
        first.fit(module, train_dataloaders=make_loader(n_seq=24))
    assert first.interrupted and first.global_step == 2
    after_interrupt = snapshot(module)
    predicted = torch.cat(first.predict(module, dataloaders=make_loader(n_seq=8)))
    rec = LossRecorder()
    second = make_trainer(strategy=strategy(name), max_steps=3, callbacks=[rec])
    second.fit(module, train_dataloaders=make_loader(n_seq=24))
    if name is not None:
        assert_evicted_if(name, second)
    return {"interrupted": after_interrupt, "pred": predicted, "losses": rec.losses, "state": snapshot(module)}


@pytest.mark.parametrize("name", NAMES)
def test_keyboard_interrupt_then_predict_and_fit_again(name: str) -> None:
    """Ctrl-C after step 2 (whatever step was in flight; Lightning shuts down and raises SystemExit): the module
    comes back with step 2's weights, the interrupted Trainer predicts with them, and a new Trainer fits on from
    them: plain Lightning's numbers."""
    ref = _interrupted(None)
    got = _interrupted(name)
    assert_states_close(got["interrupted"], ref["interrupted"], what=f"{name}: after the interrupt", atol=WEIGHT_ATOL)
    torch.testing.assert_close(got["pred"], ref["pred"], rtol=1e-5, atol=OUT_ATOL)
    close_lists(got["losses"], ref["losses"], "fit after the interrupt", 1e-6)
    assert_states_close(got["state"], ref["state"], what=f"{name}: after the second fit", atol=WEIGHT_ATOL)


def _bf16_inference_mode_sanity(name: str) -> list[float]:
    rec = LossRecorder()
    module = EvalLM(inference_in_val=True)  # validation's forward under torch.inference_mode()
    trainer = make_trainer(
        strategy=strategy(name, bf16=True),
        precision="bf16-mixed",
        max_steps=4,
        callbacks=[rec],
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        inference_mode=False,
    )
    with inference_tensor_refusal():
        trainer.fit(module, train_dataloaders=make_loader(n_seq=24), val_dataloaders=val_loader())
    assert_evicted_if(name, trainer)
    return rec.losses


def test_bf16_inference_mode_in_the_sanity_check_without_a_budget() -> None:
    """bf16-mixed, ``Trainer(inference_mode=False)``, a sanity check whose validation_step runs under
    ``torch.inference_mode()``: without a budget, the fit gives the serial step's bits in every configuration."""
    serial = _bf16_inference_mode_sanity("default")
    for name in ("host", "next_forward"):
        assert _bf16_inference_mode_sanity(name) == serial, name


@pytest.mark.parametrize("name", ["evicting", "auto-evicting"])
def test_bf16_inference_mode_in_the_sanity_check_under_evictions(name: str) -> None:
    """The same under an evicting budget: the sanity check's inference-mode forward fetches chunks, and the first
    training step's fetch (``chunk.move_to`` evicting them) fails with torch's inference-tensor error."""
    serial = _bf16_inference_mode_sanity("default")
    assert _bf16_inference_mode_sanity(name) == serial


def _refit_with_accumulation(name: str | None, precision: str) -> dict[str, Any]:
    rec = LossRecorder()
    module = EvalLM()
    trainer = make_trainer(
        strategy=strategy(name, bf16=precision == "bf16-mixed"),
        precision=precision,
        max_steps=2,
        callbacks=[rec],
        accumulate_grad_batches=4,
    )
    trainer.fit(module, train_dataloaders=make_loader(n_seq=28))  # 7 batches an epoch: windows of 4 and 3
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(module, train_dataloaders=make_loader(n_seq=28))
    return {"losses": rec.losses, "state": snapshot(module), "step": trainer.global_step}


@pytest.mark.parametrize("name", NAMES)
def test_same_trainer_fits_again_with_accumulation_across_epochs(name: str) -> None:
    """``accumulate_grad_batches=4`` over 7-batch epochs (a short last window), 2 steps, then the same Trainer fits on
    to 5 steps: 32-true gives plain Lightning's run; bf16-mixed gives the serial step's bits."""
    ref = _refit_with_accumulation(None, "32-true")
    got = _refit_with_accumulation(name, "32-true")
    assert got["step"] == ref["step"] == 5
    close_lists(got["losses"], ref["losses"], "32-true losses")
    assert_states_close(got["state"], ref["state"], what=f"{name}: 32-true", atol=WEIGHT_ATOL)
    CONFIGS["_serial"] = {"optimizer_placement": "host", "optimizer_overlap": "off"}
    try:
        serial = _refit_with_accumulation("_serial", "bf16-mixed")
    finally:
        del CONFIGS["_serial"]
    mixed = _refit_with_accumulation(name, "bf16-mixed")
    assert mixed["losses"] == serial["losses"], f"{name}: bf16-mixed losses against the serial step"
    for k, v in serial["state"].items():
        assert torch.equal(mixed["state"][k], v), f"{name}: bf16-mixed {k} against the serial step"
