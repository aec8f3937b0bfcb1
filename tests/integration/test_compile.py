"""``torch.compile`` under the strategy ([Note: hooks under torch.compile] in runtime/hooks.py).

- A LightningModule with a compiled submodule trains under PatrickStar with plain Lightning's losses (the same
  compiled submodule, 32-true), and every graph break dynamo reports is at a call of a disabled engine hook
  (none inside engine code).
- The graph count of a compiled forward with the engine's hooks (``torch._dynamo.explain``) is no more than
  that of the same model with opaque no-op hooks on the same modules: the floor for hooks that must run
  eagerly at every chunk-backed module's boundary.

Compiled with dynamo's ``aot_eager`` backend: dynamo and AOTAutograd are what meet the hooks; inductor would
only change the kernels and costs minutes of C++ compilation on CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import PStarConfig
from lightning_pstar.demos.gpt import GPT, GPTConfig
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager
from tests.helpers.runs import LossRecorder, make_trainer

STEPS = 4
LOSS_RTOL = 1e-5
DISABLED_SKIP = "Skip calling `torch.compiler.disable()`d function"
"""The first line of dynamo's break reason at a call of a ``torch.compiler.disable``d function."""


def _five_linear() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate([(8, 16), (16, 16), (16, 16), (16, 16), (16, 4)]):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < 4 else [])
    return nn.Sequential(*layers)


class _Counting:
    """A dynamo backend that counts the graphs it compiles and hands them to ``aot_eager``."""

    def __init__(self) -> None:
        self.graphs = 0
        self._inner = lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        return self._inner(gm, inputs)


class _Regression(L.LightningModule):
    """Mean-squared error of a compiled five-Linear net, SGD with momentum."""

    def __init__(self, backend: _Counting) -> None:
        super().__init__()
        self.net = torch.compile(_five_linear(), backend=backend)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4 * STEPS, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randn(4 * STEPS, 4, generator=g)), batch_size=4)


def _fit_compiled(strategy: Any) -> tuple[list[float], int, dict[str, int]]:
    """Losses, graphs compiled and dynamo's graph-break reasons (first line: count) of one compiled fit."""
    torch._dynamo.reset()
    counters.clear()
    backend = _Counting()
    recorder = LossRecorder()
    trainer = make_trainer(strategy=strategy, max_steps=STEPS, callbacks=[recorder])
    trainer.fit(_Regression(backend), train_dataloaders=_loader())
    breaks: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        first = reason.splitlines()[0]
        breaks[first] = breaks.get(first, 0) + n
    return recorder.losses, backend.graphs, breaks


def test_compiled_submodule_trains_as_under_plain_lightning() -> None:
    ref_losses, ref_graphs, ref_breaks = _fit_compiled("auto")
    losses, graphs, breaks = _fit_compiled(PatrickStarStrategy())
    assert ref_graphs >= 1 and not ref_breaks  # plain Lightning compiles the net whole
    assert graphs >= 1, "nothing was compiled"
    assert len(losses) == len(ref_losses) == STEPS
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {i}: patrickstar {a!r} vs plain Lightning {b!r}"
    # dynamo never traces into engine code: every break is at a disabled hook's call
    assert breaks, "the engine's hooks must run eagerly (a graph break at each)"
    assert set(breaks) == {DISABLED_SKIP}, breaks


def _explain(model: nn.Module, idx: torch.Tensor, context: Callable[[], Any]) -> Any:
    torch._dynamo.reset()
    with context():
        return torch._dynamo.explain(model)(idx)


@pytest.mark.parametrize("case", ["five-linear", pytest.param("demo-gpt", marks=pytest.mark.slow)])
def test_graph_count_is_that_of_opaque_hooks(case: str) -> None:
    """The engine's hooks cost no more graphs than no-op hooks that dynamo cannot trace, on the same modules."""
    if case == "demo-gpt":
        torch.manual_seed(0)
        model: nn.Module = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32))
        inputs = torch.randint(0, 32, (2, 16))
    else:
        model, inputs = _five_linear(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    config = PStarConfig.from_flat(placement="static")
    holder = nn.ModuleDict({"compiled": torch.compile(model)})  # as a LightningModule holding a compiled net
    manager = ChunkManager(holder, config=config, compute_dtype=torch.float32, device=torch.device("cpu"))
    manager.materialise()
    hooks = ModelHooks(manager)
    hooks.install()
    names = {id(m): name for name, m in model.named_modules()}  # the hooks are on the compiled net's modules
    hooked = {names[id(m)] for m in manager.table.module_records}
    assert hooked, "no module holds chunk parameters"

    def noop(*_: Any) -> None:
        return None

    opaque = torch.compiler.disable(noop)
    for name, module in reference.named_modules():
        if name in hooked:
            module.register_forward_pre_hook(opaque)
            module.register_forward_hook(opaque)

    got = _explain(model, inputs, hooks.saved_tensors)
    floor = _explain(reference, inputs, torch.enable_grad)
    hooks.remove()
    print(f"{case}: {got.graph_count} graphs, {got.graph_break_count} breaks (opaque no-op hooks: {floor.graph_count})")
    assert got.graph_count >= 1
    assert got.graph_count <= floor.graph_count, (got.graph_count, floor.graph_count)
    assert got.graph_break_count <= floor.graph_break_count, (got.break_reasons, floor.break_reasons)
