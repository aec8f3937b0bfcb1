"""lightning_pstar.hardware: bf16 units from /proc/cpuinfo (a fake one here), the auto precision, the warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from lightning_pstar import hardware
from lightning_pstar.hardware import (
    SlowPrecisionWarning,
    choose_precision,
    cpu_has_bf16,
    read_cpu_flags,
    warn_if_slow_bf16,
)

# the flags line of an AVX512 CPU without AVX512-BF16 or AMX (the machine), shortened
NO_BF16 = "fpu vme sse sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bitalg"
SAPPHIRE_RAPIDS = NO_BF16 + " avx512_bf16 amx_bf16 amx_tile amx_int8"


def fake_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str | None, *, key: str = "flags") -> None:
    """Point the module at a /proc/cpuinfo of two processors with ``flags`` (None: no such file)."""
    path = tmp_path / "cpuinfo"
    if flags is not None:
        block = f"processor\t: {{n}}\nvendor_id\t: GenuineIntel\nmodel name\t: a CPU\n{key}\t\t: {flags}\n\n"
        path.write_text(block.format(n=0) + block.format(n=1))
    monkeypatch.setattr(hardware, "CPUINFO", path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_flags_are_read_from_the_first_processor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpuinfo(tmp_path, monkeypatch, NO_BF16)
    flags = read_cpu_flags()
    assert flags is not None and "avx512f" in flags and "avx512_bf16" not in flags
    assert cpu_has_bf16() is False
    assert cpu_has_bf16(frozenset({"amx_bf16"})) is True


def test_arm_features_line_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpuinfo(tmp_path, monkeypatch, "fp asimd sve bf16 i8mm", key="Features")
    assert cpu_has_bf16() is True


def test_no_cpuinfo_means_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpuinfo(tmp_path, monkeypatch, None)
    assert read_cpu_flags() is None and cpu_has_bf16() is None
    choice = choose_precision("auto", "cpu")
    assert choice.precision == "32-true" and "no " in choice.reason


@pytest.mark.parametrize(
    ("flags", "expected", "why"),
    [
        (NO_BF16, "32-true", "no bf16 units"),
        (NO_BF16 + " avx512_bf16", "bf16-mixed", "bf16 units"),
        (NO_BF16 + " amx_bf16", "bf16-mixed", "bf16 units"),
        (SAPPHIRE_RAPIDS, "bf16-mixed", "bf16 units"),
    ],
)
def test_auto_follows_the_cpu_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str, expected: str, why: str
) -> None:
    fake_cpuinfo(tmp_path, monkeypatch, flags)
    for accelerator in ("auto", "cpu"):
        choice = choose_precision("auto", accelerator)
        assert choice.precision == expected, choice
        assert why in choice.reason and "avx512_bf16" in choice.reason
        # the one line the examples print says what was chosen and why
        assert str(choice) == f"precision: {expected} ({choice.reason})"
        assert "\n" not in str(choice)


def test_an_explicit_precision_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpuinfo(tmp_path, monkeypatch, NO_BF16)
    for precision in ("bf16-mixed", "32-true", "16-mixed"):
        choice = choose_precision(precision, "cpu")
        assert choice.precision == precision and choice.reason == "as configured"


def test_auto_on_a_cuda_device_asks_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpuinfo(tmp_path, monkeypatch, NO_BF16)  # the CPU must not matter when the GPU trains
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert choose_precision("auto", "auto").precision == "bf16-mixed"
    assert "Fake GPU" in choose_precision("auto", "gpu").reason
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert choose_precision("auto", "cuda").precision == "32-true"
    # a CPU run on a machine that has a GPU still asks the CPU
    assert choose_precision("auto", "cpu").precision == "32-true"


def test_warning_only_for_bf16_on_a_cpu_without_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpuinfo(tmp_path, monkeypatch, NO_BF16)
    with pytest.warns(SlowPrecisionWarning, match=r"bf16-mixed on a CPU without bf16 units.*HINT: .*32-true"):
        warn_if_slow_bf16("bf16-mixed", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_slow_bf16("32-true", "cpu")
        warn_if_slow_bf16("bf16-mixed", "cuda")
        fake_cpuinfo(tmp_path, monkeypatch, SAPPHIRE_RAPIDS)
        warn_if_slow_bf16("bf16-mixed", "cpu")
        fake_cpuinfo(tmp_path, monkeypatch, None)  # unknown: no warning on a guess
        warn_if_slow_bf16("bf16-mixed", "cpu")


def test_the_strategy_warns_once_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fit and then validate set the strategy up twice: one warning, on rank 0, from setup."""
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pstar import PatrickStarStrategy

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).float().pow(2).mean()

        def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
            self.log("val", self.layer(batch[0]).float().mean())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    fake_cpuinfo(tmp_path, monkeypatch, NO_BF16)
    loader = DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=PatrickStarStrategy(),
        precision="bf16-mixed",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Tiny(), loader, loader)
        trainer.validate(trainer.lightning_module, loader, verbose=False)
    slow = [w for w in caught if issubclass(w.category, SlowPrecisionWarning)]
    assert len(slow) == 1, [str(w.message) for w in slow]
    assert slow[0].filename.endswith("strategy.py")
