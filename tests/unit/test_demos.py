"""CPU unit tests of lightning_pstar.demos: the GPT, the standard-library corpus and the LightningModule."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Any, cast

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_pstar.config import LossScaleConfig, PStarConfig
from lightning_pstar.demos.corpus import (
    UNKNOWN,
    VOCAB,
    CharDataset,
    StdlibCharDataModule,
    decode,
    encode,
    stdlib_source_files,
    stdlib_text,
)
from lightning_pstar.demos.gpt import GPT, Block, GPTConfig, gpt_num_params
from lightning_pstar.demos.module import GPTLightningModule, WarmupCosineSchedule, param_groups

TINY: dict[str, Any] = {"vocab_size": 128, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def _blocks(model: GPT) -> list[Block]:
    return cast(list[Block], list(model.h))


def _unique_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------------------------- GPT


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_forward_shapes_and_loss(bias: bool) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, bias=bias))
    idx = torch.randint(0, 97, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, TINY["vocab_size"])
    assert loss is None
    logits, loss = model(idx, idx.roll(-1, dims=1))
    assert loss is not None and loss.dim() == 0
    # An untrained model predicts close to uniformly: the loss is near log(vocab_size).
    assert abs(loss.item() - math.log(TINY["vocab_size"])) < 0.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gpt_rejects_sequence_longer_than_block_size() -> None:
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_is_causal() -> None:
    # Changing a later token must not change the logits of earlier positions.
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    idx = torch.randint(0, 97, (1, 8))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 97
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("bias", [True, False])
def test_tied_weight_is_one_parameter(bias: bool) -> None:
    config = GPTConfig(**TINY, bias=bias)
    model = GPT(config)
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.bias is None
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # yielded once, under its first name
    assert _unique_numel(model) == gpt_num_params(config)
    # The state_dict still carries both names, as plain PyTorch does for tied weights.
    assert {"wte.weight", "lm_head.weight"} <= set(model.state_dict())


def test_gpt_has_no_position_parameter_or_persistent_buffer() -> None:
    model = GPT(GPTConfig(**TINY))
    assert not list(model.buffers())
    assert all("pos" not in name for name, _ in model.named_parameters())


def test_gpt_init_follows_gpt2() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128)
    model = GPT(config)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert _blocks(model)[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert _blocks(model)[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert torch.count_nonzero(_blocks(model)[0].attn.c_attn.bias) == 0
    assert torch.equal(model.ln_f.weight, torch.ones(128))


def test_meta_construction_then_reset_parameters_gives_finite_gpt2_init() -> None:
    # What the PatrickStar engine (and FSDP) does: build on meta, allocate, call every reset_parameters().
    config = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128)
    with torch.device("meta"):
        model = GPT(config)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight
    model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight  # to_empty does not keep ties; the engine stores them once
    torch.manual_seed(0)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert _blocks(model)[1].attn.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert torch.equal(_blocks(model)[0].ln_1.weight, torch.ones(128))
    assert torch.count_nonzero(_blocks(model)[0].ln_1.bias) == 0
    _, loss = model(torch.randint(0, 97, (2, 8)), torch.randint(0, 97, (2, 8)))
    assert loss is not None and torch.isfinite(loss)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"n_embd": 30, "n_head": 4}, "divisible by `n_head`"),
        ({"n_layer": 0}, "`n_layer` must be a positive int"),
        ({"dropout": 1.0}, "`dropout` must be in"),
    ],
)
def test_gpt_config_rejects_bad_values(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **overrides})


# ------------------------------------------------------------------------------------------ corpus


def test_vocab_is_fixed_printable_ascii() -> None:
    # The vocabulary is a constant, not derived from the text, so ids mean the same on every Python.
    assert VOCAB[:2] == (UNKNOWN, "\n")
    assert VOCAB[2:] == tuple(chr(c) for c in range(32, 127))
    assert len(VOCAB) == 97 == StdlibCharDataModule.vocab_size


def test_encode_decode_round_trip_and_unknown_symbols() -> None:
    text = "def f(x):\n    return x ~ 1\n"
    ids = encode(text)
    assert ids.dtype == torch.long and ids.shape == (len(text),)
    assert decode(ids) == text
    ids = encode("a\tb\u00e9\U0001f600")  # tab, Latin-1 and astral characters are all unknown
    assert ids.tolist() == [VOCAB.index("a"), 0, VOCAB.index("b"), 0, 0]
    assert decode(ids) == f"a{UNKNOWN}b{UNKNOWN}{UNKNOWN}"
    assert decode([VOCAB.index("x"), len(VOCAB), 127]) == f"x{UNKNOWN}{UNKNOWN}"  # padded ids past the vocab


def test_stdlib_text_is_deterministic_and_capped() -> None:
    files = stdlib_source_files()
    assert len(files) > 100
    assert not any("site-packages" in p.parts for p in files)
    assert files == sorted(files, key=lambda p: p.as_posix())
    text = stdlib_text(50_000)
    assert len(text) == 50_000
    assert text == stdlib_text(50_000)
    assert text.startswith(files[0].read_text(encoding="utf-8", errors="replace")[:1000])


def test_stdlib_text_order_cut_and_skipped_dirs(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text("BBBB")
    (tmp_path / "a.py").write_text("AAAA")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "c.py").write_text("CCCC")
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "d.py").write_text("DDDD")
    assert [p.relative_to(tmp_path).as_posix() for p in stdlib_source_files(tmp_path)] == ["a.py", "b.py", "pkg/c.py"]
    assert stdlib_text(10, root=tmp_path) == "AAAABBBBCC"
    assert stdlib_text(100, root=tmp_path) == "AAAABBBBCCCC"
    with pytest.raises(RuntimeError, match="Found no Python sources"):
        stdlib_text(10, root=tmp_path / "pkg" / "missing")


def test_char_dataset_windows() -> None:
    data = torch.arange(20)
    ds = CharDataset(data, block_size=4)
    assert len(ds) == 4  # starts 0, 4, 8, 12; a window at 16 would need targets up to index 20
    x, y = ds[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    x, y = ds[len(ds) - 1]
    assert y[-1].item() <= 19
    strided = CharDataset(data, block_size=4, stride=1)
    assert len(strided) == 16 and strided[15][1].tolist() == [16, 17, 18, 19]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="at least block_size"):
        CharDataset(torch.arange(4), block_size=4)


def test_datamodule_split_and_batches() -> None:
    dm = StdlibCharDataModule(block_size=16, batch_size=4, max_chars=10_000, val_fraction=0.1)
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    n_val = 1_000
    assert dm.val_set.data.numel() == n_val and dm.train_set.data.numel() == 10_000 - n_val
    assert len(dm.train_set) == (9_000 - 16 - 1) // 16 + 1
    assert len(dm.val_set) == (1_000 - 16 - 1) // 16 + 1
    assert len(dm.train_dataloader()) == len(dm.train_set) // 4  # drop_last
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == y.shape == (4, 16)
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    # The validation text is the corpus tail, so it continues where training text stops.
    assert torch.equal(torch.cat([dm.train_set.data, dm.val_set.data]), encode(stdlib_text(10_000)))


# ------------------------------------------------------------------------------------ LightningModule


def test_meta_init_defers_model_to_configure_model() -> None:
    module = GPTLightningModule(**TINY, meta_init=True)
    assert module.model is None
    with pytest.raises(RuntimeError, match="configure_model"):
        module(torch.zeros(1, 4, dtype=torch.long))
    module.configure_model()
    model = module.model
    module.configure_model()  # idempotent: Lightning calls it on every fit/validate
    assert module.model is model
    assert module(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, TINY["vocab_size"])


def test_param_groups_put_tied_weight_once_and_only_matrices_in_decay() -> None:
    model = GPT(GPTConfig(**TINY))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(p.dim() == 2 for p in decay["params"])
    assert any(p is model.wte.weight for p in no_decay["params"])
    assert any(p is model.wpe.weight for p in no_decay["params"])
    assert sum(p.numel() for p in decay["params"] + no_decay["params"]) == gpt_num_params(model.config)


def test_warmup_cosine_schedule() -> None:
    schedule = WarmupCosineSchedule(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert 0 < schedule(0) < schedule(5) < schedule(9) < 1
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)


def test_module_trains_and_logs_validation_metrics_with_plain_lightning() -> None:
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(**TINY, lr=3e-3, warmup_steps=1, meta_init=True)
    dm = StdlibCharDataModule(block_size=16, batch_size=8, max_chars=20_000)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=8,
        limit_val_batches=2,
        val_check_interval=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_ppl"} <= set(metrics)
    assert metrics["val_ppl"].item() == pytest.approx(math.exp(metrics["val_loss"].item()), rel=1e-5)
    assert metrics["val_loss"].item() < math.log(TINY["vocab_size"])
    assert isinstance(trainer.lr_scheduler_configs[0].scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert trainer.optimizers[0].defaults["fused"] is True


# ------------------------------------------------------------------------------ Hydra config tree

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train_gpt", overrides=list(overrides))


def test_patrickstar_yaml_lists_every_option_with_the_dataclass_defaults() -> None:
    cfg = _compose()
    node = OmegaConf.to_container(cfg.strategy, resolve=True)
    assert isinstance(node, dict)
    assert node.pop("_target_") == "lightning_pstar.PatrickStarStrategy"
    assert set(node) == {f.name for f in fields(PStarConfig)}, "configs/strategy/patrickstar.yaml is out of date"
    assert set(node["mixed_precision"]["loss_scale"]) == {f.name for f in fields(LossScaleConfig)}
    assert PStarConfig.from_mapping(cfg.strategy) == PStarConfig()


@pytest.mark.parametrize("experiment", ["tiny", "offload"])
def test_experiments_compose(experiment: str) -> None:
    cfg = _compose(f"+experiment={experiment}")
    assert cfg.data.block_size == cfg.model.block_size
    assert cfg.model.vocab_size >= len(VOCAB)
    if experiment == "offload":
        assert PStarConfig.from_mapping(cfg.strategy).memory.device_limit_bytes == 150 * 2**20
    else:
        assert cfg.trainer.max_steps <= 10


def test_alternative_strategies_compose() -> None:
    assert _compose("strategy=auto").strategy.name == "auto"
    assert _compose("strategy=ddp").strategy._target_ == "lightning.pytorch.strategies.DDPStrategy"


def test_generate_extends_and_crops_context() -> None:
    model = GPT(GPTConfig(**TINY)).eval()
    start = torch.randint(0, 97, (2, 20))  # longer than block_size 16: generate crops the context
    out = model.generate(start, 5, temperature=0.5, top_k=3, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 25) and torch.equal(out[:, :20], start)
    again = model.generate(start, 5, temperature=0.5, top_k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(start, 1, temperature=0.0)
