"""Lightning features on top of the strategy: evaluation loops, the memory report, registration by
name, deferred (meta-device) initialisation in ``configure_model``, unused and reused parameters."""

from __future__ import annotations

import subprocess
import sys

import lightning as L
import pytest
import torch

import lightning_pstar
from lightning_pstar import PatrickStarStrategy
from tests.helpers import (
    OptimSpec,
    TinyLM,
    build_model,
    fit,
    lm_loss,
    make_loader,
    make_trainer,
    max_rel_diff,
)

SGD = OptimSpec(name="sgd", lr=0.05, momentum=0.9)


def _plain_eval(module: TinyLM, n_seq: int) -> tuple[float, list[torch.Tensor]]:
    """Mean per-batch loss and per-batch logits of ``module`` in plain PyTorch."""
    losses, logits = [], []
    with torch.no_grad():
        for x, y in make_loader(n_seq=n_seq):
            out = module(x)
            logits.append(out)
            losses.append(lm_loss(out, y))
    return float(torch.stack(losses).mean()), logits


def _assert_eval_loops(trainer: L.Trainer, module: TinyLM, reference: TinyLM) -> None:
    """validate/test/predict on ``trainer`` run without grad and agree with ``reference`` (plain PyTorch)."""
    n_seq = 12
    want_loss, want_logits = _plain_eval(reference, n_seq)
    val = trainer.validate(module, dataloaders=make_loader(n_seq=n_seq), verbose=False)
    test = trainer.test(module, dataloaders=make_loader(n_seq=n_seq), verbose=False)
    preds = trainer.predict(module, dataloaders=make_loader(n_seq=n_seq))
    for stage in ("validation", "test", "predict"):
        flags = module.grad_enabled_in[stage]
        assert flags and not any(flags), f"{stage}: grad enabled in {flags}"
    assert val[0]["val_loss"] == pytest.approx(want_loss, rel=1e-6)
    assert test[0]["test_loss"] == pytest.approx(want_loss, rel=1e-6)
    assert len(preds) == len(want_logits)
    for got, want in zip(preds, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_eval_loops_after_fit() -> None:
    run = fit(TinyLM(optim=SGD), strategy=PatrickStarStrategy(), max_steps=4)
    state = run.recorder.final_state
    reference = TinyLM(seed=999)
    reference.load_state_dict(state, strict=True)
    _assert_eval_loops(run.trainer, run.module, reference)
    # evaluation did not move any weight
    after = run.module.state_dict()
    for name, value in state.items():
        assert torch.equal(after[name], value), name


def test_eval_loops_standalone() -> None:
    trainer = make_trainer(strategy=PatrickStarStrategy())
    _assert_eval_loops(trainer, TinyLM(), TinyLM())


@pytest.mark.parametrize("precision, per_param", [("bf16-mixed", 14.0), ("32-true", 16.0)])
def test_memory_report_fields(precision: str, per_param: float) -> None:
    strategy = PatrickStarStrategy()
    fit(TinyLM(frozen=False), strategy=strategy, precision=precision, max_steps=2)
    report = strategy.memory_report()
    n_params = sum(p.numel() for p in build_model(frozen=False).parameters())
    print(report)
    assert report.precision == precision
    assert report.num_params == n_params
    assert report.model_data_bytes_per_param == per_param
    assert 0.0 < report.chunk_utilisation <= 1.0
    assert report.num_chunks >= 1
    assert report.model_data_bytes >= per_param * n_params
    assert report.device_chunk_bytes > 0
    assert report.peak_device_chunk_bytes >= report.device_chunk_bytes
    assert report.evictions == 0
    assert report.device_memory_limit is None
    assert str(report)


@pytest.mark.slow  # a fresh interpreter importing Lightning; the quick test below trains by the registered name
def test_registered_after_importing_twice() -> None:
    code = (
        "import importlib, lightning_pstar\n"
        "importlib.reload(lightning_pstar)\n"
        "import lightning_pstar as again\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'patrickstar' in StrategyRegistry\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_registered_by_name() -> None:
    trainer = make_trainer(strategy="patrickstar", max_steps=2)
    assert isinstance(trainer.strategy, lightning_pstar.PatrickStarStrategy)
    trainer.fit(TinyLM(), make_loader())
    assert trainer.global_step == 2


def test_configure_model_meta_init_matches_eager() -> None:
    eager = fit(TinyLM(optim=SGD), strategy=PatrickStarStrategy(), max_steps=8)
    meta = fit(TinyLM(optim=SGD, meta_init=True), strategy=PatrickStarStrategy(), max_steps=8)
    assert meta.module.configure_model_device == torch.device("meta"), "configure_model did not run on meta"
    initial = {f"model.{k}": v for k, v in build_model().state_dict().items()}
    assert sorted(meta.recorder.initial_state) == sorted(initial)
    differ = [k for k, v in initial.items() if not torch.equal(meta.recorder.initial_state[k], v)]
    assert differ == [], f"materialised values differ from the eager model's for {differ}"
    # same init (reset_parameters in construction order after the same seed): same first loss, same run
    assert meta.recorder.losses == eager.recorder.losses
    got = meta.recorder.final_state
    want = eager.recorder.final_state
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert meta.module.model is not None
    assert meta.module.model.wte.weight is meta.module.model.lm_head.weight, "tie lost in materialisation"


def test_unused_parameter_is_left_alone() -> None:
    spec = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1)
    ref = fit(TinyLM(optim=spec, unused=True), strategy="auto", max_steps=6)
    run = fit(TinyLM(optim=spec, unused=True), strategy=PatrickStarStrategy(), max_steps=6)
    assert run.trainer.global_step == 6
    assert max_rel_diff(run.recorder.losses, ref.recorder.losses) <= 1e-5
    state = run.recorder.final_state
    initial = build_model(unused=True).state_dict()
    for name in ("weight", "bias"):
        assert torch.equal(state[f"model.unused.{name}"], initial[f"unused.{name}"]), f"unused.{name} changed"
    assert not torch.equal(state["model.blocks.0.mlp.fc.weight"], initial["blocks.0.mlp.fc.weight"])


def test_parameter_used_twice_gets_summed_gradient() -> None:
    """blocks[0] runs twice per forward; SGD (not scale invariant) exposes a wrong gradient sum."""
    ref = fit(TinyLM(optim=SGD, reuse_block=True), strategy="auto", max_steps=10)
    run = fit(TinyLM(optim=SGD, reuse_block=True), strategy=PatrickStarStrategy(chunk_size=256), max_steps=10)
    diff = max_rel_diff(run.recorder.losses, ref.recorder.losses)
    print(f"reused block: max relative loss difference {diff:.3e}")
    assert diff <= 1e-5
    state = run.recorder.final_state
    for name, value in ref.module.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
