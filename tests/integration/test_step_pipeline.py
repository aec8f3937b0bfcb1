"""The host-side optimizer step as a pipeline (``optimizer_overlap="pipeline"``, and "auto"'s measured choice)
against the serial step ("off").

Both sides put every optimizer-state family on the host (``optimizer_placement="host"``), as ZeRO-Offload does,
and train the same seed and data; every schedule must give the serial step's losses, weights and optimizer states
bit for bit ([Note: the step pipeline] in ``runtime/pipeline.py``). Where nothing can read gradients between the
backward and the step, families step during the backward ([Note: stepping inside the backward] in
``optim/overlap.py``); the report says how many did, so each test also checks which schedule ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.config import PStarConfig
from lightning_pstar.optim.overlap import SETTLE_STEPS, TRIALS
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.report import MemoryReport
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager
from tests.helpers import TinyLM, assert_states_equal
from tests.helpers.data import make_loader
from tests.helpers.fabric_loop import LoopSpec, train
from tests.helpers.models import N_EMBD, VOCAB, TinyGPT
from tests.helpers.runs import LM, FitResult, OptimSpec, fit_steps
from tests.integration.test_activation_checkpointing import CheckpointedGPT

HOST = {"optimizer_placement": "host", "chunk_size": 4096}
STEPS = 5


class Peek(L.Callback):
    """The memory report at the end of training (while the engine still runs)."""

    report: MemoryReport | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.report = trainer.strategy.memory_report()  # type: ignore[attr-defined]


class TwoGroupLM(LM):
    """:class:`LM` with two param groups (no weight decay on biases and norms) and a cosine schedule per step."""

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in self.named_parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 1e-3}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3, fused=True)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ManualLM(LM):
    """:class:`LM` under manual optimization: ``manual_backward`` then ``opt.step()`` and ``zero_grad``."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        opt.zero_grad()  # type: ignore[union-attr]
        return loss.detach()


def _per_step(report: MemoryReport) -> int:
    """Pipelined family steps per optimizer step (every trainable family, when all of them pipeline)."""
    assert report.host_step_jobs % STEPS == 0, report.host_step_jobs
    return report.host_step_jobs // STEPS


def _gpt() -> LM:
    return LM(lambda: TinyGPT())


def _pair(
    make: Any, precision: str, mode: str = "pipeline", **kwargs: Any
) -> tuple[list[FitResult], list[MemoryReport]]:
    """The serial step's run and ``mode``'s, on the same seed and data: same losses, same final weights."""
    results, reports = [], []
    options = {**HOST, **kwargs.pop("options", {})}
    extra = list(kwargs.pop("callbacks", []))
    for overlap in ("off", mode):
        peek = Peek()
        strategy = PatrickStarStrategy(optimizer_overlap=overlap, **options)
        if precision == "16-mixed":  # on a CPU Lightning rewrites precision="16-mixed": pass the plugin
            kwargs["plugins"] = [PatrickStarPrecision("16-mixed")]
        results.append(
            fit_steps(make(), strategy, precision=precision, steps=STEPS, callbacks=[peek, *extra], **kwargs)
        )
        assert peek.report is not None
        reports.append(peek.report)
    serial, pipelined = results
    assert pipelined.losses == serial.losses
    assert_states_equal(pipelined.final, serial.final, what=f"optimizer_overlap={mode!r} against 'off'")
    return results, reports


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_pipelined_step_is_the_serial_step(precision: str, mode: str) -> None:
    _, (serial, pipelined) = _pair(_gpt, precision, mode)
    assert serial.host_step_jobs == 0 and serial.optimizer_tier == "host"
    families = _per_step(pipelined)
    assert families >= pipelined.num_chunks - 1  # all but the frozen Linear's chunk
    if precision == "16-mixed":  # the overflow check needs every gradient before any family steps
        assert pipelined.host_steps_in_backward == 0
    else:  # every step after the warm-up's started its families inside the backward
        assert pipelined.host_steps_in_backward == (STEPS - 1) * families
        # and copied them back there: nothing autograd saved still read them ([Note: copies back inside the
        # backward]; the tied embedding's family included, its second use ran before its gradient was final)
        assert pipelined.host_copies_back_in_backward == pipelined.host_steps_in_backward
    assert pipelined.step_d2h_bytes > 0 and pipelined.step_h2d_bytes > 0


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_steps_after_the_backward(algorithm: str, mode: str) -> None:
    _, (_, pipelined) = _pair(_gpt, "bf16-mixed", mode, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    assert _per_step(pipelined) >= pipelined.num_chunks - 1
    assert pipelined.host_steps_in_backward == 0
    assert pipelined.host_norms_in_backward == 0  # bf16 gradients stay on the device: their norm is taken there


class LanePeek(L.Callback):
    """Stages that ran in a lane lent by a waiting caller, at the end of training."""

    lent_runs = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.lent_runs = trainer.strategy._manager.pipeline.lent_runs  # type: ignore[attr-defined]


@pytest.mark.parametrize(("precision", "clip"), [("32-true", True), ("bf16-mixed", True), ("bf16-mixed", False)])
def test_lent_lanes_keep_the_bits(precision: str, clip: bool) -> None:
    """With one intra-op thread a caller waiting for the pipeline lends its core: two families' Adams (or an Adam
    and a copy) run at once ([Note: host lanes] in runtime/lanes.py), with the serial step's bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    peek = LanePeek()
    try:
        _pair(_gpt, precision, "pipeline", gradient_clip_val=0.05 if clip else None, callbacks=[peek])
    finally:
        torch.set_num_threads(threads)
    if clip:  # every family steps after the backward, while step() waits
        assert peek.lent_runs > 0


class GradReader(L.Callback):
    """A hook before the step that the engine cannot see through (it could read or change gradients; reading
    ``p.grad`` there is refused: [Note: gradients user code cannot see]); this one counts the gradients."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.total = sum(p.grad is not None for p in pl_module.parameters())


@pytest.mark.parametrize(
    ("mode", "kwargs", "in_backward"),
    [
        ("pipeline", {}, True),
        ("next_forward", {}, True),
        ("pipeline", {"accumulate_grad_batches": 2}, True),  # the last micro-batch's backward only
        ("pipeline", {"gradient_clip_algorithm": "value"}, False),  # no norm needed
        ("pipeline", {"callbacks": [GradReader()]}, False),  # something may read or change gradients first
    ],
)
def test_clipping_norms_inside_the_backward(mode: str, kwargs: dict[str, Any], in_backward: bool) -> None:
    """32-true, clipping by norm: each host family's gradients land on the host during the backward, and their
    norms are computed there on a host lane ([Note: gradient norms inside the backward] in optim/overlap.py); the
    global norm, the clipping and the step stay the serial step's bits."""
    callbacks = kwargs.pop("callbacks", [])
    results, (serial, pipelined) = _pair(_gpt, "32-true", mode, gradient_clip_val=0.05, callbacks=callbacks, **kwargs)
    families = _per_step(pipelined)
    assert families >= pipelined.num_chunks - 1
    assert serial.host_norms_in_backward == 0 and pipelined.host_steps_in_backward == 0
    assert pipelined.host_norms_in_backward == ((STEPS - 1) * families if in_backward else 0)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_accumulation_groups_and_schedule(precision: str) -> None:
    (serial, pipelined), (_, report) = _pair(
        lambda: TwoGroupLM(lambda: TinyGPT()), precision, accumulate_grad_batches=2
    )
    assert pipelined.recorder.lrs == serial.recorder.lrs and len(set(serial.recorder.lrs)) > 2
    # after the warm-up every family's accumulated gradients were summed on a host lane (the loader's 5 batches make
    # windows of 2, 2 and 1 micro-batches: 3 of the 4 steps after the warm-up accumulate)
    assert report.host_sums_in_backward == 3 * _per_step(report) > 0
    if precision == "32-true":  # the fp32 GRAD chunk holds the sum: the whole-family step applies
        assert report.host_steps_in_backward == (STEPS - 1) * _per_step(report) > 0


def test_sgd_and_hooks_take_the_serial_path() -> None:
    """SGD has no pipelined kernel, and a LightningModule overriding ``on_before_optimizer_step`` may read
    gradients: both still give the serial step's bits."""
    _, (_, sgd) = _pair(lambda: LM(lambda: TinyGPT(), optim="sgd"), "bf16-mixed")
    assert sgd.host_step_jobs == 0
    _, (_, hooked) = _pair(lambda: TinyLM(optim=OptimSpec(name="adamw", weight_decay=0.1)), "bf16-mixed")
    assert _per_step(hooked) > 0 and hooked.host_steps_in_backward == 0


def test_manual_optimization() -> None:
    _, (_, report) = _pair(ManualLM, "bf16-mixed")
    assert _per_step(report) > 0 and report.host_steps_in_backward == 0


def test_tight_device_budget() -> None:
    """Param chunks evicted and fetched around a pipelined step started inside the backward: a family whose room the
    budgeted backward needs ends its step without the copy back; the serial step's bits."""
    _, (serial, pipelined) = _pair(_gpt, "bf16-mixed", options={"device_memory_limit": "400KiB"})
    assert serial.evictions > 0 and pipelined.evictions > 0
    assert pipelined.host_step_jobs > 0 and pipelined.host_steps_in_backward > 0
    assert pipelined.host_copies_back_in_backward > 0  # copies back inside the budgeted backward too


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_checkpoints_taken_at_every_step_match(tmp_path: Path, mode: str) -> None:
    paths = {}
    for overlap in ("off", mode):
        ckpt = ModelCheckpoint(dirpath=tmp_path / overlap, every_n_train_steps=1, save_top_k=-1)
        strategy = PatrickStarStrategy(optimizer_overlap=overlap, **HOST)
        fit_steps(_gpt(), strategy, precision="bf16-mixed", steps=3, callbacks=[ckpt], enable_checkpointing=True)
        paths[overlap] = sorted((tmp_path / overlap).glob("*.ckpt"))
    assert [p.name for p in paths["off"]] == [p.name for p in paths[mode]] and len(paths["off"]) == 3
    for off, other in zip(paths["off"], paths[mode], strict=True):
        a, b = torch.load(off, weights_only=True), torch.load(other, weights_only=True)
        assert_states_equal(b["state_dict"], a["state_dict"], what=f"{other.name} weights")
        for index, state in a["optimizer_states"][0]["state"].items():
            got = b["optimizer_states"][0]["state"][index]
            for key, value in state.items():
                assert torch.equal(got[key], value), (other.name, index, key)


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
@pytest.mark.parametrize(("clip", "accumulate"), [(False, 1), (True, 1), (False, 3)])
def test_fabric(clip: bool, accumulate: int, mode: str) -> None:
    runs, reports = [], []
    for overlap in ("off", mode):
        strategy = PatrickStarFabricStrategy(optimizer_overlap=overlap, **HOST)
        spec = LoopSpec(
            strategy=strategy,
            precision="bf16-mixed",
            steps=4,
            two_groups=True,
            scheduler=True,
            eval_between=True,
            accumulate=accumulate,
        )
        if clip:
            spec.clip_norm = 0.5
        runs.append(train(spec))
        reports.append(strategy.memory_report())
    assert reports[0].host_step_jobs == 0 and reports[1].host_step_jobs > 0, reports[1]
    assert reports[0].host_sums_in_backward == 0  # "off": every sum on the calling thread
    assert (reports[1].host_sums_in_backward > 0) == (accumulate > 1), reports[1]  # fabric.no_backward_sync
    assert runs[1].losses == runs[0].losses
    assert runs[1].eval_losses == runs[0].eval_losses
    assert_states_equal(runs[1].state, runs[0].state, what=f"Fabric, optimizer_overlap={mode!r} against 'off'")


class ReadsWeightAtBatchEnd(LM):
    """Reads a weight directly (outside every module's forward) at the end of each batch."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.norms: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.norms.append(float(next(self.net.parameters()).norm()))


def test_next_forward_leaves_no_weight_to_read_half_updated() -> None:
    """Under "next_forward" a weight read outside its module's forward before the module runs again waits for its
    family's step (its parameter is parked meanwhile: [Note: a read that waits] in runtime/parked.py); under
    "pipeline" the step is over already. Both read the stepped weight, as after the serial step."""
    (serial, piped), _ = _pair(ReadsWeightAtBatchEnd, "bf16-mixed")
    assert piped.module.norms == serial.module.norms and len(piped.module.norms) == STEPS
    strategy = PatrickStarStrategy(optimizer_overlap="next_forward", **HOST)
    tail = fit_steps(ReadsWeightAtBatchEnd(), strategy, precision="bf16-mixed", steps=STEPS)
    assert tail.module.norms == serial.module.norms
    assert tail.losses == serial.losses


class DetachedRead(nn.Module):
    """``mid.weight`` is read detached by a branch whose backward runs after ``mid``'s gradient is final: the
    bytes autograd saved must still be the old weight then, though ``mid``'s family could step already."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = nn.Linear(N_EMBD, N_EMBD)  # first: its own family with chunk_size 1100
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx)
        side = h @ self.mid.weight.detach().t()  # saved: an alias of the param chunk, not a view of the parameter
        return self.head(self.mid(h) + side)


def test_a_family_read_later_in_the_backward_copies_back_after_it() -> None:
    """[Note: copies back inside the backward]: a family whose weight autograd still holds (a detached alias) keeps
    its copy back until the backward ends; the others copy back inside it; the bits are the serial step's."""
    _, (_, piped) = _pair(lambda: LM(DetachedRead), "32-true", options={"chunk_size": 1100})
    assert piped.host_steps_in_backward == (STEPS - 1) * _per_step(piped) > 0
    assert 0 < piped.host_copies_back_in_backward < piped.host_steps_in_backward


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_recomputation_keeps_copies_back_for_the_backward_end(use_reentrant: bool) -> None:
    """Activation checkpointing runs forwards inside the backward (seen in the warm-up): no copy back runs inside
    one, and the bits are the serial step's."""
    _, (_, piped) = _pair(lambda: LM(lambda: CheckpointedGPT(use_reentrant)), "32-true")
    assert piped.host_steps_in_backward > 0 and piped.host_copies_back_in_backward == 0


def test_a_gradient_after_the_family_started_its_step_raises() -> None:
    """A family that started its step inside the backward takes no further gradient (it would be lost): the
    gradient store offers each family once its final gradients all landed, and refuses a later one by name."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    config = PStarConfig.from_flat(chunk_size=160, placement="static")
    manager = ChunkManager(model, config=config, compute_dtype=torch.bfloat16, device=torch.device("cpu"))
    manager.materialise()
    hooks = ModelHooks(manager)
    hooks.install()
    offered: list[int] = []
    manager.grads.on_final = lambda family: (offered.append(family.family_id), True)[1]
    with hooks.saved_tensors():
        out = model(torch.randn(4, 8).bfloat16())
    out.float().pow(2).mean().backward()
    families = sorted({r.family.family_id for r in manager.records})
    assert sorted(offered) == families and manager.grads.stepped == set(families)
    record = manager.records[0]
    with pytest.raises(RuntimeError, match=f"parameter '{record.slot.name}'.*received another gradient"):
        manager.grad_ready(record, torch.ones_like(record.param, dtype=torch.bfloat16))
    hooks.remove()


def test_saved_reads_of_a_family_are_counted_until_autograd_drops_them() -> None:
    """The proof behind a copy back inside the backward: every tensor autograd saves from a trainable param chunk
    (the parameter in its module, a view, a detached alias) counts on its family until autograd drops it; a
    module that needs a trainable parameter whose family already copied back raises, naming it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    config = PStarConfig.from_flat(chunk_size=80, placement="static")  # a family per layer
    manager = ChunkManager(model, config=config, compute_dtype=torch.float32, device=torch.device("cpu"))
    manager.materialise()
    hooks = ModelHooks(manager)
    hooks.install()
    first, second = (manager.table.by_id[id(m.weight)].family for m in model)
    assert first is not second
    with hooks.saved_tensors():
        x = torch.randn(4, 8, requires_grad=True)
        out = model(x) + x @ model[1].weight.detach().t()  # the alias is saved by a node outside any module
    assert first.saved_params - first.dropped_params >= 1  # the weight its linear saved
    assert second.saved_params - second.dropped_params >= 2  # ... and the detached alias
    out.pow(2).mean().backward()
    for family in (first, second):
        assert family.saved_params == family.dropped_params > 0
    manager.pipeline.early.add(second.family_id)
    name = manager.table.by_id[id(model[1].weight)].names[0]
    with pytest.raises(RuntimeError, match=f"parameter '{name}' inside the backward.*optimizer_overlap='off'"):
        manager.pre_backward(list(second.records), 1)
    manager.pipeline.early.clear()
    hooks.remove()


def test_auto_keeps_the_faster_schedule_it_timed() -> None:
    """``"auto"`` times both schedules after the warm-up and keeps the faster; the run's bits are the serial step's
    whichever it keeps, and steps of both schedules ran: after the warm-up, untimed pipelined steps (the first
    ends the warm-up's cycle, then ``SETTLE_STEPS``), ``TRIALS`` pairs of each schedule alternating, then the kept
    one ([Note: choosing the schedule] in optim/overlap.py)."""
    steps = 1 + 1 + SETTLE_STEPS + 6 * TRIALS + 1
    runs, reports = [], []
    for overlap in ("off", "pipeline", "auto"):
        peek = Peek()
        strategy = PatrickStarStrategy(optimizer_overlap=overlap, **HOST)
        runs.append(fit_steps(_gpt(), strategy, precision="32-true", steps=steps, callbacks=[peek]))
        assert peek.report is not None
        reports.append(peek.report)
    for run, name in zip(runs[1:], ("pipeline", "auto"), strict=True):
        assert run.losses == runs[0].losses
        assert_states_equal(run.final, runs[0].final, what=f"optimizer_overlap={name!r} against 'off'")
    serial, piped, auto = reports
    assert serial.optimizer_schedule == "serial" and serial.schedule_trial_ms == {}
    assert piped.optimizer_schedule == "pipeline" and piped.schedule_trial_ms == {}
    assert set(auto.schedule_trial_ms) == {"pipeline", "serial", "next_forward"}  # one rank: the tail too
    faster = min(auto.schedule_trial_ms, key=auto.schedule_trial_ms.__getitem__)
    assert auto.optimizer_schedule == faster
    families = piped.host_steps_in_backward // (steps - 1)
    assert families > 0 and piped.host_steps_in_backward == families * (steps - 1)
    pipelined = 1 + SETTLE_STEPS + 4 * TRIALS + (1 if faster != "serial" else 0)  # the tail steps are pipelined
    assert auto.host_steps_in_backward == families * pipelined


@pytest.mark.parametrize(
    ("precision", "kwargs", "options"),
    [
        ("bf16-mixed", {"gradient_clip_val": 0.05}, {}),
        ("16-mixed", {}, {}),
        ("32-true", {"accumulate_grad_batches": 2}, {}),
        ("bf16-mixed", {"accumulate_grad_batches": 2}, {}),  # sums aside only before the pipelined steps
        ("bf16-mixed", {}, {"device_memory_limit": "400KiB"}),
    ],
)
def test_auto_switching_schedules_mid_run_keeps_the_bits(
    precision: str, kwargs: dict[str, Any], options: dict[str, Any]
) -> None:
    """While "auto" times both schedules it switches between them every second step (the param chunks move from
    the host back to the device and the other way): the serial step's bits all along."""
    steps = 1 + 1 + SETTLE_STEPS + 6 * TRIALS + 1
    runs = []
    for overlap in ("off", "auto"):
        strategy = PatrickStarStrategy(optimizer_overlap=overlap, **HOST, **options)
        if precision == "16-mixed":
            kwargs["plugins"] = [PatrickStarPrecision("16-mixed")]
        runs.append(fit_steps(_gpt(), strategy, precision=precision, steps=steps, **kwargs))
    assert runs[1].losses == runs[0].losses
    assert_states_equal(runs[1].final, runs[0].final, what=f"auto against off, {precision}, {kwargs}")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_accumulation_steps_through_the_pipeline(precision: str) -> None:
    """With gradient accumulation (what the GPU check and fine-tuning run), every host family's step is a job of
    the step pipeline, as without accumulation: in mixed precision the job adds the param slot's gradient to the
    fp32 sums of the earlier micro-batches ([Note: gradient parts] in optim/host_step.py). The first GPU run found
    every family stepping serially here."""
    strategy = PatrickStarStrategy(optimizer_overlap="pipeline", **HOST)
    fit_steps(_gpt(), strategy, steps=4, precision=precision, accumulate_grad_batches=4)
    report = strategy.memory_report()
    assert report.host_step_jobs >= 4 * (report.num_chunks - 1), report


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
@pytest.mark.parametrize(
    ("precision", "clip"),
    [("bf16-mixed", None), ("bf16-mixed", "norm"), ("bf16-mixed", "value"), ("16-mixed", None), ("16-mixed", "norm")],
)
def test_mixed_accumulation_is_the_serial_step(precision: str, clip: str | None, mode: str) -> None:
    """Mixed precision with accumulation: each record's gradient is its slot's plus the fp32 sum of the earlier
    micro-batches; the pipelined jobs (inside the backward where nothing needs every gradient first) give the serial
    step's bits."""
    kwargs: dict[str, Any] = {"accumulate_grad_batches": 3}
    if clip is not None:
        kwargs |= {"gradient_clip_val": 0.05, "gradient_clip_algorithm": clip}
    _, (serial, pipelined) = _pair(_gpt, precision, mode, **kwargs)
    families = _per_step(pipelined)
    assert families >= pipelined.num_chunks - 1 and serial.host_step_jobs == 0
    in_backward = precision == "bf16-mixed" and clip is None  # 16-mixed and clipping need every gradient first
    assert pipelined.host_steps_in_backward == ((STEPS - 1) * families if in_backward else 0)
    # the earlier micro-batches' gradients were summed on a host lane ([Note: sums beside the backward])
    assert serial.host_sums_in_backward == 0 and pipelined.host_sums_in_backward >= families


class Switchy(nn.Module):
    """:class:`TinyGPT` with two residual Linears used on some micro-batches only (of an accumulation of 3):
    ``early`` on the first, ``late`` on the last; and a Linear that never gets a gradient. Their families hold
    records whose gradient is only a sum of earlier micro-batches, only this micro-batch's, or none."""

    def __init__(self) -> None:
        super().__init__()
        self.early = nn.Linear(N_EMBD, N_EMBD)  # first: in one family with the embeddings
        self.late = nn.Linear(N_EMBD, N_EMBD)
        self.gpt = TinyGPT(unused=True)
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        gpt, turn = self.gpt, self.calls % 3
        self.calls += 1
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1], device=idx.device))
        if turn == 0:
            x = x + self.early(x)
        for block in gpt.blocks:
            x = block(x)
        if turn == 2:
            x = x + self.late(x)
        return gpt.lm_head(gpt.ln_f(x))


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_gradients_from_some_micro_batches_only(mode: str) -> None:
    """Records of one family whose gradients have different parts (slot and sum, the sum only, the slot only): the
    job builds each record's gradient as the serial step does; a family with a record that got no gradient steps
    serially (that record's step count stays)."""
    _, (serial, pipelined) = _pair(
        lambda: LM(Switchy), "bf16-mixed", mode, accumulate_grad_batches=3, options={"chunk_size": 4096}
    )
    assert 0 < pipelined.host_step_jobs < STEPS * pipelined.num_chunks


class TwiceCheckpointed(nn.Module):
    """One block run twice, each time under reentrant activation checkpointing, on the first two micro-batches of
    each window of 3 (once on the last, which steps): its parameters get two gradients in one accumulating backward
    (one per recomputed segment)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        gpt, twice = self.gpt, self.calls % 3 != 2
        self.calls += 1
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1], device=idx.device))
        for _ in range(2 if twice else 1):
            x = torch.utils.checkpoint.checkpoint(gpt.blocks[0], x, use_reentrant=True)
        return gpt.lm_head(gpt.ln_f(x))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_sums_beside_the_backward_take_two_gradients_of_one_parameter(precision: str) -> None:
    """A parameter's two gradients in one accumulating backward are summed aside in the order they came
    ([Note: sums beside the backward] in runtime/grad_sums.py): the serial step's bits."""
    _, (serial, pipelined) = _pair(
        lambda: LM(TwiceCheckpointed), precision, accumulate_grad_batches=3, loader=make_loader(n_seq=4 * 3 * STEPS)
    )
    assert serial.host_sums_in_backward == 0 and pipelined.host_sums_in_backward > 0


def test_a_sum_that_fails_beside_the_backward_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of a sum on the host lane is the run's ([Note: sums beside the backward]): raised when the backward
    ends, not lost."""
    real = ChunkManager._run_sum_aside

    def failing(self: ChunkManager, task: Any) -> Any:
        def run() -> None:
            raise MemoryError("host out of memory while summing")

        return real(self, run)

    monkeypatch.setattr(ChunkManager, "_run_sum_aside", failing)
    strategy = PatrickStarStrategy(optimizer_overlap="pipeline", **HOST)
    with pytest.raises(MemoryError, match="while summing"):
        fit_steps(_gpt(), strategy, steps=3, precision="bf16-mixed", accumulate_grad_batches=2)


def test_next_forward_ranks_the_tail_in_the_order_the_next_forward_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under "next_forward" a step that returns with jobs in flight (a backward started them last-layer first) ranks
    them in the order the next forward uses their families, for the stages to take ([Note: host lanes] in
    runtime/lanes.py; tests/unit/test_pipeline.py checks the stages follow the ranks): the layout packs TinyGPT's
    parameters in module order, which is its forward's, so the ranks follow the family ids. The bits stay the
    serial step's (``_pair``)."""
    from lightning_pstar.runtime.pipeline import StepPipeline

    ranked: list[dict[int, int]] = []
    prefer = StepPipeline.prefer

    def record_prefer(self: StepPipeline, ranks: dict[int, int]) -> None:
        ranked.append(dict(ranks))
        prefer(self, ranks)

    monkeypatch.setattr(StepPipeline, "prefer", record_prefer)
    _pair(_gpt, "32-true", "next_forward")
    assert len(ranked) == STEPS - 1, ranked  # every step after the warm-up's
    for ranks in ranked:  # several families of one module share a rank (the next forward needs them together)
        assert len(ranks) > 1 and [ranks[f] for f in sorted(ranks)] == sorted(ranks.values()), ranks
        assert len(set(ranks.values())) > 1, ranks
