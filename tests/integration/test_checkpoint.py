"""Checkpoints leave as ordinary Lightning/PyTorch checkpoints and resume exactly.

- ``state_dict`` has the model's own parameter names (both names of the tied weight) with fp32 values
  that load into a fresh plain model with ``strict=True`` and give identical outputs;
- the optimizer state has torch's standard layout (int-keyed ``state``, ``param_groups[*]["params"]``
  index lists) and the same values as plain Lightning's at the same point;
- resuming ``fit`` from a ``ModelCheckpoint`` written at an epoch boundary reproduces the rest of an
  uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarStrategy
from tests.helpers import OptimSpec, TinyLM, fit, make_loader

CLIP = 0.65
SPEC = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1, cosine_t_max=30)
N_SEQ = 32  # 8 batches of 4 per epoch, 4 optimizer steps with accumulate_grad_batches=2
BATCHES_PER_EPOCH = 8


def _load(path: Path | str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_save_checkpoint_loads_into_plain_model(precision: str, tmp_path: Path) -> None:
    run = fit(TinyLM(optim=SPEC), strategy=PatrickStarStrategy(), precision=precision, max_steps=6)
    path = tmp_path / "weights.ckpt"
    run.trainer.save_checkpoint(path, weights_only=True)
    state = _load(path)["state_dict"]
    assert state, "empty state_dict"

    fresh = TinyLM(seed=999)  # a different initialisation, overwritten by the checkpoint
    assert sorted(state) == sorted(fresh.state_dict())
    assert all(v.dtype == torch.float32 for v in state.values()), {k: v.dtype for k, v in state.items()}
    assert torch.equal(state["model.wte.weight"], state["model.lm_head.weight"])
    fresh.load_state_dict(state, strict=True)
    assert fresh.model is not None and fresh.model.wte.weight is fresh.model.lm_head.weight

    x = make_loader(n_seq=8, batch_size=8).dataset.tensors[0]
    with torch.no_grad():
        expected = fresh(x)
    if precision == "32-true":
        (got,) = run.trainer.predict(run.module, dataloaders=DataLoader(list(zip(x, x, strict=True)), batch_size=8))
        assert torch.equal(got, expected), float((got - expected).abs().max())
    # a full checkpoint after fit (optimizer state included) holds the same weights
    full = tmp_path / "full.ckpt"
    run.trainer.save_checkpoint(full)
    checkpoint = _load(full)
    assert len(checkpoint["optimizer_states"]) == 1 and checkpoint["optimizer_states"][0]["state"]
    assert sorted(checkpoint["state_dict"]) == sorted(state)
    for name, value in checkpoint["state_dict"].items():
        assert torch.equal(value, state[name]), name


def _checkpointed_fit(module: TinyLM, strategy: Any, dirpath: Path, max_epochs: int, **kwargs: Any) -> Any:
    ckpt = ModelCheckpoint(dirpath=dirpath, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    return fit(
        module,
        strategy=strategy,
        loader=make_loader(n_seq=N_SEQ),
        max_steps=-1,
        max_epochs=max_epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=CLIP,
        enable_checkpointing=True,
        callbacks=[ckpt],
        **kwargs,
    )


def test_resume_from_epoch_boundary_is_exact(tmp_path: Path) -> None:
    full = _checkpointed_fit(TinyLM(optim=SPEC), PatrickStarStrategy(), tmp_path / "full", max_epochs=3)
    assert len(full.recorder.losses) == 3 * BATCHES_PER_EPOCH
    epoch0 = tmp_path / "full" / "epoch=0.ckpt"
    assert epoch0.exists(), sorted(p.name for p in (tmp_path / "full").iterdir())
    # what ModelCheckpoint wrote loads into a plain model
    TinyLM(seed=999).load_state_dict(_load(epoch0)["state_dict"], strict=True)

    resumed = _checkpointed_fit(
        TinyLM(optim=SPEC, seed=999), PatrickStarStrategy(), tmp_path / "resumed", max_epochs=3, ckpt_path=str(epoch0)
    )
    tail = full.recorder.losses[BATCHES_PER_EPOCH:]
    assert len(resumed.recorder.losses) == len(tail)
    diffs = [abs(a - b) for a, b in zip(resumed.recorder.losses, tail, strict=True)]
    print(f"resume: max abs loss difference {max(diffs):.3e}")
    assert resumed.recorder.losses == tail
    assert resumed.recorder.lrs == full.recorder.lrs[BATCHES_PER_EPOCH:]
    assert resumed.trainer.global_step == full.trainer.global_step
    final_full = _load(tmp_path / "full" / "epoch=2.ckpt")["state_dict"]
    final_resumed = _load(tmp_path / "resumed" / "epoch=2.ckpt")["state_dict"]
    for name, value in final_full.items():
        assert torch.equal(final_resumed[name], value), name


def test_optimizer_state_has_torch_layout(tmp_path: Path) -> None:
    """The epoch-0 optimizer state matches plain Lightning's in layout, order and (closely) values."""
    pstar = _checkpointed_fit(TinyLM(optim=SPEC), PatrickStarStrategy(), tmp_path / "pstar", max_epochs=1)
    ref = _checkpointed_fit(TinyLM(optim=SPEC), "auto", tmp_path / "ref", max_epochs=1, use_distributed_sampler=False)
    got_ckpt = _load(tmp_path / "pstar" / "epoch=0.ckpt")
    ref_ckpt = _load(tmp_path / "ref" / "epoch=0.ckpt")
    assert len(got_ckpt["optimizer_states"]) == 1
    got, want = got_ckpt["optimizer_states"][0], ref_ckpt["optimizer_states"][0]

    trainable = [p for p in ref.module.parameters() if p.requires_grad]
    assert sorted(got["state"]) == list(range(len(trainable)))
    assert [g["params"] for g in got["param_groups"]] == [list(range(len(trainable)))]
    for index, param in enumerate(trainable):
        entry = got["state"][index]
        assert set(entry) >= {"step", "exp_avg", "exp_avg_sq"}, (index, sorted(entry))
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].shape == param.shape, (index, key, entry[key].shape, param.shape)
            assert entry[key].dtype == torch.float32
            torch.testing.assert_close(entry[key], want["state"][index][key], rtol=1e-4, atol=1e-9)
        assert float(entry["step"]) == float(want["state"][index]["step"]) == 4.0
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert got["param_groups"][0][key] == want["param_groups"][0][key], key
    assert got_ckpt["lr_schedulers"] == ref_ckpt["lr_schedulers"]
    assert pstar.recorder.losses == pytest.approx(ref.recorder.losses, rel=1e-5)
