"""Bad configurations fail early with a clear message, before any training step, and lose nothing."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_pstar import MemoryBudgetError, PatrickStarStrategy
from tests.helpers import OptimSpec, TinyLM, make_loader, make_trainer


def _snapshot(module: TinyLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_untouched(module: TinyLM, before: dict[str, torch.Tensor]) -> None:
    """No training step ran and every parameter still holds its value, dtype and shape."""
    assert module.training_steps_run == 0
    after = module.state_dict()
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        got = after[name]
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert torch.equal(got.detach().cpu(), value), f"{name} changed after a failed setup"
    assert module.model is not None
    assert module.model.wte.weight is module.model.lm_head.weight, "tie lost after a failed setup"


def test_device_budget_smaller_than_largest_chunk() -> None:
    module = TinyLM()
    before = _snapshot(module)
    # fp32: the 4096-element fc weight gets its own chunk of 16384 bytes; 1000 bytes cannot hold it
    trainer = make_trainer(strategy=PatrickStarStrategy(chunk_size=1024, device_memory_limit=1000), max_steps=2)
    with pytest.raises(MemoryBudgetError, match=r"device_memory_limit.*\b1,?000 bytes") as info:
        trainer.fit(module, make_loader())
    # the message states what is needed, in bytes: at least the largest chunk
    figures = [int(n.replace(",", "")) for n in re.findall(r"\b\d[\d,]*\b", str(info.value))]
    assert max(figures) >= 16384, str(info.value)
    _assert_untouched(module, before)


def test_unknown_option_from_config() -> None:
    with pytest.raises(ValueError, match="chunk_sise"):
        PatrickStarStrategy.from_config({"chunk_sise": 1})


def test_misspelled_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="chunk_sise"):
        PatrickStarStrategy(chunk_sise=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("size", [0, -5])
def test_non_positive_chunk_size(size: int) -> None:
    with pytest.raises(ValueError, match=rf"`chunk_size`.*{size}"):
        PatrickStarStrategy(chunk_size=size)
    with pytest.raises(ValueError, match=rf"chunk_size.*{size}"):
        PatrickStarStrategy.from_config({"chunk_size": size})


def test_double_precision_is_refused() -> None:
    module = TinyLM()
    before = _snapshot(module)
    with pytest.raises(ValueError, match="64-true"):
        trainer = make_trainer(strategy=PatrickStarStrategy(), precision="64-true", max_steps=2)
        trainer.fit(module, make_loader())
    _assert_untouched(module, before)


@pytest.mark.parametrize("name, cls_name", [("rmsprop", "RMSprop"), ("adagrad", "Adagrad")])
def test_unsupported_optimizer(name: str, cls_name: str) -> None:
    module = TinyLM(optim=OptimSpec(name=name))
    before = _snapshot(module)
    trainer = make_trainer(strategy=PatrickStarStrategy(), max_steps=2)
    pattern = rf"(?s)(?=.*{cls_name})(?=.*\bAdamW\b)(?=.*\bAdam\b)(?=.*\bSGD\b)"
    with pytest.raises(TypeError, match=pattern):
        trainer.fit(module, make_loader())
    _assert_untouched(module, before)
