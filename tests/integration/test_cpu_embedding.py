"""cpu_embedding=True: embedding weights stay fp32 on the host, outside the chunks, with unchanged arithmetic."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import PatrickStarStrategy

VOCAB = 2000  # the embedding (2000 x 16) is the largest tensor of the model


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.l1 = nn.Linear(16, 64)
        self.l2 = nn.Linear(64, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.l2(torch.relu(self.l1(self.emb(x)))))


class _Module(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = _Net()
        self.optimizer_name = optimizer
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(strategy: object, optimizer: str, precision: str = "32-true") -> tuple[list[float], L.Trainer, _Module]:
    L.seed_everything(0)
    module = _Module(optimizer)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (96, 8), generator=g)
    y = torch.randint(0, 50, (96, 8), generator=g)
    trainer = L.Trainer(
        accelerator="cpu",  # the reference runs use CPU kernels (issue 12: the suite on a GPU machine)
        strategy=strategy,  # type: ignore[arg-type]
        precision=precision,  # type: ignore[arg-type]
        max_steps=12,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    return module.losses, trainer, module


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cpu_embedding_matches_plain_lightning(optimizer: str) -> None:
    reference, _, ref_module = _fit("auto", optimizer)
    losses, trainer, module = _fit(PatrickStarStrategy(cpu_embedding=True), optimizer)
    assert len(losses) == len(reference) == 24
    assert losses == reference  # same kernels, same order: bitwise on one machine
    for (name, p), (_, q) in zip(module.named_parameters(), ref_module.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_cpu_embedding_keeps_the_weight_out_of_the_chunks() -> None:
    _, with_chunks, _ = _fit(PatrickStarStrategy(), "adamw")
    _, on_host, module = _fit(PatrickStarStrategy(cpu_embedding=True), "adamw")
    full = with_chunks.strategy.memory_report()  # type: ignore[attr-defined]
    host = on_host.strategy.memory_report()  # type: ignore[attr-defined]
    # the embedding no longer sets the chunk size, and its elements are not in any chunk
    assert host.chunk_size < full.chunk_size
    assert host.num_params == full.num_params - VOCAB * 16
    assert module.net.emb.weight.dtype == torch.float32


def test_cpu_embedding_bf16_trains_and_checkpoints_the_fp32_weight(tmp_path: object) -> None:
    L.seed_everything(0)
    initial = _Net().emb.weight.detach().clone()  # what _fit's module starts from (same seed)
    losses, trainer, module = _fit(PatrickStarStrategy(cpu_embedding=True), "adamw", "bf16-mixed")
    assert all(torch.isfinite(torch.tensor(losses)))
    # the host-side fp32 weight was trained (not frozen, not rounded to bf16)
    assert not torch.equal(module.net.emb.weight.detach(), initial)
    assert not torch.equal(module.net.emb.weight.detach(), module.net.emb.weight.detach().bfloat16().float())
    path = f"{tmp_path}/last.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert state["net.emb.weight"].dtype == torch.float32
    torch.testing.assert_close(state["net.emb.weight"], module.net.emb.weight.detach(), rtol=0, atol=0)


def test_tied_embedding_stays_in_chunks_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Tied(_Net):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(16, VOCAB, bias=False)
            self.head.weight = self.emb.weight

    class TiedModule(_Module):
        def __init__(self) -> None:
            super().__init__("adamw")
            self.net = Tied()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, _ = batch
            return nn.functional.cross_entropy(self.net(x).flatten(0, 1), x.flatten())

    L.seed_everything(0)
    x = torch.randint(0, VOCAB, (16, 8))
    trainer = L.Trainer(
        accelerator="cpu",  # the reference runs use CPU kernels (issue 12: the suite on a GPU machine)
        strategy=PatrickStarStrategy(cpu_embedding=True),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    with caplog.at_level("WARNING", logger="lightning_pstar.runtime.manager"):
        trainer.fit(TiedModule(), DataLoader(TensorDataset(x, x), batch_size=4))
    assert "stays in the chunks" in caplog.text
    report = trainer.strategy.memory_report()  # type: ignore[attr-defined]
    assert report.num_params == sum(p.numel() for p in Tied().parameters())
