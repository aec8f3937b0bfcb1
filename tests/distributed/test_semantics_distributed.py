"""Issue 13, training semantics users rely on, at 2 gloo ranks: PatrickStar against Lightning's ``ddp``.

Manual optimization with two optimizers (one backward, and the GAN pattern with ``toggle_optimizer``), manual
clipping, manual gradient accumulation with a schedule stepped by hand, ``nn.TransformerEncoder`` and a bare
``nn.MultiheadAttention``. Both sides of every case, of every test here, run one after the other in the same two
processes that the test's launcher starts once for the module with a torchrun-style environment (``ddp`` and
``patrickstar`` join them; any rank's failure is re-raised here, and fails every test of the module), on the
same data (Lightning injects the same seeded DistributedSampler for both: rank r gets r, r + 2, ... of the epoch's
permutation).
Every loss on every rank within 1e-5 (relative) of ddp's, and the final weights close to ddp's. Small chunks
spread the chunk families over both ranks, so each rank steps the families it owns and gathers the others.

The modules are those of the one-rank tests (``tests.helpers.semantics``); ddp runs with
``find_unused_parameters=True`` because ``toggle_optimizer`` leaves parameters out of a backward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from launch import run_ranks
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarStrategy
from tests.helpers.asserts import LOSS_RTOL, assert_states_close
from tests.helpers.data import make_dataset
from tests.helpers.runs import LM, LossRecorder, quiet_trainer_options
from tests.helpers.semantics import ATTENTION_MODELS, ManualLM, ManualSpec, max_abs_diff

# two spawned gloo ranks; tests/integration/test_training_semantics.py runs the same modules at one rank
pytestmark = pytest.mark.slow

WORLD = 2
BATCHES = 6
"""Batches per rank: 6 steps, or 2 when accumulating 3."""
BATCH_SIZE = 4
# a collective its peer never joins fails after this long (gloo raises) instead of hanging the run
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
RUN_TIMEOUT_S = 600.0  # the hard limit of the module's pair of ranks (18 runs), far above a normal run


@dataclass(kw_only=True)
class Run:
    """One ``trainer.fit`` at 2 ranks; each rank writes ``<out_dir>/<tag>-rank<r>.json`` and ``.pt``."""

    tag: str
    out_dir: str
    strategy: str
    """"ddp" or "patrickstar"."""
    manual: ManualSpec | None = None
    """Train :class:`ManualLM` with this spec (for one epoch) ..."""
    model: str = ""
    """... or :class:`LM` around ``ATTENTION_MODELS[model]`` for ``BATCHES`` steps."""
    optim: str = "adamw"
    """:class:`LM`'s optimizer ("adamw" or "sgd")."""
    chunk_size: int | None = None

    def path(self, rank: int, suffix: str) -> Path:
        return Path(self.out_dir) / f"{self.tag}-rank{rank}.{suffix}"


def _strategy(run: Run) -> Any:
    if run.strategy == "ddp":
        return DDPStrategy(find_unused_parameters=True, timeout=COLLECTIVE_TIMEOUT)
    if run.chunk_size is None:
        return PatrickStarStrategy(timeout=COLLECTIVE_TIMEOUT)
    return PatrickStarStrategy(timeout=COLLECTIVE_TIMEOUT, chunk_size=run.chunk_size)


def fit_run(run: Run, rank: int) -> None:
    """Train once as ``run`` says (in a rank the launcher started) and write this rank's record."""
    recorder = LossRecorder()
    module: L.LightningModule = (
        ManualLM(run.manual) if run.manual is not None else LM(ATTENTION_MODELS[run.model], optim=run.optim)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=_strategy(run),
        precision="32-true",
        max_steps=-1 if run.manual is not None else BATCHES,
        max_epochs=1,
        callbacks=[recorder],
        limit_val_batches=0,
        **quiet_trainer_options(),
    )
    loader = DataLoader(make_dataset(WORLD * BATCH_SIZE * BATCHES), batch_size=BATCH_SIZE, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    losses = module.losses if isinstance(module, ManualLM) else recorder.losses
    record = {"rank": rank, "world_size": trainer.world_size, "global_step": trainer.global_step, "losses": losses}
    record["lrs"] = recorder.lrs
    if isinstance(trainer.strategy, PatrickStarStrategy):
        record["num_chunks"] = trainer.strategy.memory_report().num_chunks
    run.path(rank, "json").write_text(json.dumps(record))
    torch.save({"initial": recorder.initial_state, "final": recorder.final_state}, run.path(rank, "pt"))


def fit_in_rank(rank: int, world_size: int, runs: list[Run]) -> None:
    """For ``launch.run_ranks``: the environment names this rank, so each Trainer joins it."""
    assert world_size == WORLD
    for run in runs:
        fit_run(run, rank)


@dataclass
class Outcome:
    """What both ranks of one :class:`Run` wrote."""

    records: list[dict[str, Any]]
    states: list[dict[str, dict[str, torch.Tensor]]]


def read(run: Run) -> Outcome:
    missing = [r for r in range(WORLD) if not run.path(r, "json").exists()]
    assert not missing, f"{run.tag}: ranks {missing} wrote no record"
    records = [json.loads(run.path(r, "json").read_text()) for r in range(WORLD)]
    states = [torch.load(run.path(r, "pt"), weights_only=True) for r in range(WORLD)]
    return Outcome(records, states)


def run_pairs(
    tmp_path: Path, cases: dict[str, dict[str, Any]], ddp_only: dict[str, dict[str, Any]] | None = None
) -> tuple[dict[str, tuple[Outcome, Outcome]], dict[str, Outcome]]:
    """For each case a ddp run and a PatrickStar run (the same keywords), and for each of ``ddp_only`` a ddp run,
    all in one pair of ranks. Returns (ddp, patrickstar) per case, and the ddp-only outcomes."""
    runs: list[Run] = []
    for name, case in cases.items():
        kwargs = dict(case)
        chunk_size = kwargs.pop("chunk_size", None)
        runs.append(Run(tag=f"{name}-ddp", out_dir=str(tmp_path), strategy="ddp", **kwargs))
        runs.append(
            Run(tag=f"{name}-pstar", out_dir=str(tmp_path), strategy="patrickstar", chunk_size=chunk_size, **kwargs)
        )
    refs = [
        Run(tag=f"{name}-ddp", out_dir=str(tmp_path), strategy="ddp", **kw) for name, kw in (ddp_only or {}).items()
    ]
    run_ranks(fit_in_rank, WORLD, runs + refs, timeout=RUN_TIMEOUT_S)
    pairs = {name: (read(runs[2 * i]), read(runs[2 * i + 1])) for i, name in enumerate(cases)}
    return pairs, {name: read(run) for name, run in zip(ddp_only or {}, refs, strict=True)}


def assert_ddp_parity(ref: Outcome, got: Outcome, *, what: str) -> None:
    """Every loss on every rank within LOSS_RTOL of ddp's, the same step count and learning rates, the ranks saw
    different data, and the final weights (rank 0's consolidated state) close to ddp's."""
    for rank in range(WORLD):
        r, g = ref.records[rank], got.records[rank]
        assert g["rank"] == rank and g["world_size"] == WORLD, g
        assert g["global_step"] == r["global_step"] > 0, (
            f"{what}: rank {rank}: {g['global_step']} vs {r['global_step']}"
        )
        assert len(g["losses"]) == len(r["losses"]) > 0, (
            f"{what}: rank {rank}: {len(g['losses'])} vs {len(r['losses'])}"
        )
        diff = max(abs(a - b) / abs(b) for a, b in zip(g["losses"], r["losses"], strict=True))
        print(f"{what} rank {rank}: max relative loss difference {diff:.3e}")
        for i, (a, b) in enumerate(zip(g["losses"], r["losses"], strict=True)):
            assert abs(a - b) <= LOSS_RTOL * abs(b), f"{what}: rank {rank} loss {i}: patrickstar {a!r} vs ddp {b!r}"
        assert g["lrs"] == pytest.approx(r["lrs"], rel=1e-12), f"{what}: rank {rank}: learning rates differ"
    # the consolidated state is gathered on rank 0 (what a checkpoint stores); ddp's ranks hold equal copies
    want, have = ref.states[0]["final"], got.states[0]["final"]
    print(f"{what}: max abs weight difference {max_abs_diff(have, want):.3e}")
    assert_states_close(have, want, what=what, rtol=1e-4)
    assert got.records[0]["losses"] != got.records[1]["losses"], f"{what}: both ranks saw the same data"
    assert got.records[0]["num_chunks"] >= 2 * WORLD, f"{what}: too few chunks to spread over the ranks"


def assert_changed(outcome: Outcome, prefix: str, *, what: str) -> None:
    state = outcome.states[0]
    moved = [
        k for k in state["final"] if k.startswith(prefix) and not torch.equal(state["final"][k], state["initial"][k])
    ]
    assert moved, f"{what}: no parameter under {prefix!r} changed"


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


# the cases of every test below; the module's fixture trains them all in one launch
TWO_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "one-backward": {"manual": ManualSpec(pattern="one_backward", decoder_first=True), "chunk_size": 2200},
    "gan": {"manual": ManualSpec(pattern="gan"), "chunk_size": 2200},
}
CLIPPING: dict[str, dict[str, Any]] = {
    "norm": {
        "manual": ManualSpec(pattern="single", optims=("sgd",), clip_val=0.5, clip_algorithm="norm"),
        "chunk_size": 2200,
    },
    "value": {
        "manual": ManualSpec(pattern="single", optims=("adamw",), clip_val=0.02, clip_algorithm="value"),
        "chunk_size": 2200,
    },
}
UNCLIPPED: dict[str, dict[str, Any]] = {  # ddp only
    "unclipped-sgd": {"manual": ManualSpec(pattern="single", optims=("sgd",))},
    "unclipped-adamw": {"manual": ManualSpec(pattern="single", optims=("adamw",))},
}
ACCUMULATION: dict[str, dict[str, Any]] = {
    "accumulate-3-sgd": {
        "manual": ManualSpec(pattern="single", optims=("sgd",), accumulate=3, cosine_t_max=BATCHES // 3),
        "chunk_size": 2200,
    },
    "accumulate-2-adam": {
        "manual": ManualSpec(pattern="single", optims=("adam",), accumulate=2, cosine_t_max=BATCHES // 2),
        "chunk_size": 2200,
    },
}
ATTENTION: dict[str, dict[str, Any]] = {
    "transformer_encoder": {"model": "transformer_encoder", "optim": "adamw", "chunk_size": 4096},
    "multihead_attention": {"model": "multihead_attention", "optim": "sgd", "chunk_size": 1100},
}

Pairs = dict[str, tuple[Outcome, Outcome]]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pairs, dict[str, Outcome]]:
    """Every case of the module in one launch of two ranks: the ranks' start-up is paid once, not per test."""
    cases = {**TWO_OPTIMIZERS, **CLIPPING, **ACCUMULATION, **ATTENTION}
    return run_pairs(tmp_path_factory.mktemp("semantics"), cases, ddp_only=UNCLIPPED)


def _pairs(outcomes: tuple[Pairs, dict[str, Outcome]], cases: dict[str, dict[str, Any]]) -> Pairs:
    return {name: outcomes[0][name] for name in cases}


def test_two_optimizers_distributed(outcomes: tuple[Pairs, dict[str, Outcome]]) -> None:
    """Adam on the encoder, SGD with momentum on the decoder: one backward and both steps (decoder first), and
    the GAN pattern (two losses, two backwards, toggled optimizers), with 2200-element chunks (each Linear in a
    chunk of its own, owned by alternating ranks)."""
    for name, (ref, got) in _pairs(outcomes, TWO_OPTIMIZERS).items():
        assert ref.records[0]["global_step"] == 2 * BATCHES, name
        assert_ddp_parity(ref, got, what=name)
        assert_changed(got, "net.encoder.", what=name)
        assert_changed(got, "net.decoder.", what=name)


def test_manual_clipping_distributed(outcomes: tuple[Pairs, dict[str, Outcome]]) -> None:
    """``self.clip_gradients`` by norm (SGD with momentum: the norm is global over both ranks' shards) and by value
    (AdamW) before ``opt.step()``; a plain ddp run without clipping shows that both clip."""
    references = outcomes[1]
    for name, plain in (("norm", "unclipped-sgd"), ("value", "unclipped-adamw")):
        ref, got = outcomes[0][name]
        assert ref.records[0]["losses"] != references[plain].records[0]["losses"], f"{name}: clipping changes nothing"
        assert_ddp_parity(ref, got, what=f"clip {name}")


def test_manual_accumulation_distributed(outcomes: tuple[Pairs, dict[str, Outcome]]) -> None:
    """``manual_backward(loss / 3)`` every batch, a step, ``zero_grad`` and a cosine schedule's ``step()`` every 3
    batches (SGD with momentum, and Adam accumulating 2)."""
    for name, (ref, got) in _pairs(outcomes, ACCUMULATION).items():
        n = 3 if "3" in name else 2
        assert ref.records[0]["global_step"] == BATCHES // n, name
        assert len(set(ref.records[0]["lrs"])) > 1, f"{name}: the schedule did not move the learning rate"
        assert_ddp_parity(ref, got, what=name)


def test_attention_models_distributed(outcomes: tuple[Pairs, dict[str, Outcome]]) -> None:
    """``nn.TransformerEncoder`` (AdamW) and a bare ``nn.MultiheadAttention`` (SGD with momentum, its
    ``out_proj`` weights read by the attention's own forward, on every rank in the same collective order)."""
    for name, (ref, got) in _pairs(outcomes, ATTENTION).items():
        assert ref.records[0]["global_step"] == BATCHES, name
        assert_ddp_parity(ref, got, what=name)
