"""Hugging Face ``transformers`` models under PatrickStar, built from tiny configs (nothing is downloaded).

GPT-2 (tied input/output embeddings, Conv1D layers, ``GPT2LMHeadModel``), Llama (rotary position buffers,
grouped-query attention, RMSNorm, untied head), BERT (masked LM, prediction head tied to the word embeddings) and
T5 (encoder-decoder, one ``shared`` embedding used by the encoder, the decoder and the head) train for 8 steps:

- in 32-true every loss equals plain Lightning's within 1e-5 (relative; on one machine they are bitwise equal),
  and so do the final weights; tied weights stay tied;
- in bf16-mixed the strategy computes with bf16 parameters and fp32 masters, while plain Lightning's bf16-mixed
  keeps fp32 weights under autocast: the losses agree within 1e-2 relative (observed: at most 1.3e-3) and fall.

Plus Hugging Face's own activation checkpointing (``gradient_checkpointing_enable``) on GPT-2, with and without
evictions, and the example script ``examples/train_hf.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import PatrickStarStrategy
from tests.helpers import LossRecorder, make_trainer

VOCAB = 128
SEQ = 32
STEPS = 8
BATCH = 4
SEED = 1234
LOSS_RTOL_32 = 1e-5
LOSS_RTOL_BF16 = 1e-2
REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------
# Models from tiny configs (dropout 0 everywhere, so the runs are deterministic)
# --------------------------------------------------------------------------------------------------


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_dropout=0.0,
    )
    return transformers.LlamaForCausalLM(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        vocab_size=VOCAB,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


BUILDERS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5}
# names of one Parameter, shared by several modules
TIED: dict[str, list[str]] = {
    "gpt2": ["model.transformer.wte.weight", "model.lm_head.weight"],
    "llama": [],
    "bert": ["model.bert.embeddings.word_embeddings.weight", "model.cls.predictions.decoder.weight"],
    "t5": [
        "model.shared.weight",
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
        "model.lm_head.weight",
    ],
}
MASK_ID = 1


def token_data(steps: int, seed: int = 4321) -> TensorDataset:
    """Arithmetic sequences ``start + stride * k (mod VOCAB)`` over ids 2..VOCAB-1 (0 and 1 are pad and mask):
    ``2 * BATCH`` of them, alternating batches, so that 8 steps show a falling loss for every model."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB - 2, (2 * BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (2 * BATCH, 1), generator=g)
    seq = 2 + (start + stride * torch.arange(SEQ)) % (VOCAB - 2)  # (2 * BATCH, SEQ)
    return TensorDataset(seq.repeat((steps + 1) // 2, 1))


class HFLM(L.LightningModule):
    """Trains one of :data:`BUILDERS` on :func:`token_data`.

    Causal models predict the next token (the model shifts the labels), BERT restores every third token from a
    mask, T5 maps a sequence to its reverse. ``checkpointing`` turns on Hugging Face's activation checkpointing
    with these ``gradient_checkpointing_kwargs`` (None: off).
    """

    def __init__(self, kind: str, checkpointing: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.kind = kind
        torch.manual_seed(SEED)
        self.model = BUILDERS[kind]()
        if checkpointing is not None:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch  # (B, T)
        if self.kind == "t5":
            return self.model(input_ids=ids, labels=ids.flip(1)).loss
        if self.kind == "bert":
            masked = ids.clone()
            masked[:, ::3] = MASK_ID
            labels = torch.full_like(ids, -100)
            labels[:, ::3] = ids[:, ::3]
            return self.model(input_ids=masked, labels=labels).loss
        logits = self.model(input_ids=ids).logits  # (B, T, V)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01, fused=True)


def fit(module: HFLM, strategy: Any, precision: str = "32-true", steps: int = STEPS) -> LossRecorder:
    recorder = LossRecorder()
    trainer = make_trainer(strategy=strategy, precision=precision, max_steps=steps, callbacks=[recorder])
    trainer.fit(module, DataLoader(token_data(steps), batch_size=BATCH, shuffle=False))
    return recorder


def assert_losses_close(got: list[float], ref: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(ref), what
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {i}: patrickstar {a!r} vs plain Lightning {b!r}"


# --------------------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.slow
def test_hf_model_32_true_parity(kind: str) -> None:
    ref_module = HFLM(kind)
    ref = fit(ref_module, "auto")
    module = HFLM(kind)
    got = fit(module, PatrickStarStrategy())
    print(f"{kind}: losses {got.losses[0]:.4f} -> {got.losses[-1]:.4f}")
    assert_losses_close(got.losses, ref.losses, LOSS_RTOL_32, kind)
    assert got.losses[-1] < got.losses[0], f"{kind}: no learning: {got.losses}"

    want = ref_module.state_dict()
    # the consolidated state (what a checkpoint stores) has the model's own names, one entry per tied name
    assert sorted(got.final_state) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got.final_state[name], value.float(), rtol=1e-5, atol=1e-6, msg=name)
    tied = TIED[kind]
    for name in tied[1:]:
        assert torch.equal(got.final_state[name], got.final_state[tied[0]]), f"{name} is no longer tied"
    # after fit the module holds ordinary parameters, still tied
    params = dict(module.named_parameters(remove_duplicate=False))
    for name in tied[1:]:
        assert params[name] is params[tied[0]], f"{name} is no longer the same Parameter as {tied[0]}"


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.slow
def test_hf_model_bf16_mixed(kind: str) -> None:
    ref = fit(HFLM(kind), "auto", precision="bf16-mixed")
    got = fit(HFLM(kind), PatrickStarStrategy(), precision="bf16-mixed")
    diff = max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses, strict=True))
    print(f"{kind} bf16: max relative loss difference {diff:.2e}")
    assert_losses_close(got.losses, ref.losses, LOSS_RTOL_BF16, f"{kind} bf16")
    assert got.losses[-1] < got.losses[0], f"{kind} bf16: no learning: {got.losses}"


# --------------------------------------------------------------------------------------------------
# Hugging Face activation checkpointing
# --------------------------------------------------------------------------------------------------


class CallCounter:
    """Counts the calls of one module through a forward hook (checkpointing calls it again in backward)."""

    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.calls += 1


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gpt2_gradient_checkpointing(use_reentrant: bool) -> None:
    """``gradient_checkpointing_enable()`` recomputes every block in backward: the losses and final weights equal
    plain Lightning's with the same checkpointing, also when chunks are evicted to HOST in the iteration."""
    steps = 6
    kwargs = {"use_reentrant": use_reentrant}
    ref_module = HFLM("gpt2", kwargs)
    counter = CallCounter(ref_module.model.transformer.h[0].attn.c_attn)
    ref = fit(ref_module, "auto", steps=steps)
    assert counter.calls == 2 * steps, f"no recomputation: {counter.calls} calls in {steps} steps"
    want = ref_module.state_dict()

    # 16384-element chunks (the largest weight); 4 of them: a block in backward plus its recomputation
    limit = 4 * 16384 * 4
    for strategy in (
        PatrickStarStrategy(),
        PatrickStarStrategy(chunk_size=16384, placement="static", device_memory_limit=limit),
    ):
        module = HFLM("gpt2", kwargs)
        counter = CallCounter(module.model.transformer.h[0].attn.c_attn)
        got = fit(module, strategy, steps=steps)
        assert counter.calls == 2 * steps
        assert_losses_close(got.losses, ref.losses, LOSS_RTOL_32, f"checkpointing, {strategy.config.placement.policy}")
        for name, value in want.items():
            torch.testing.assert_close(got.final_state[name], value.float(), rtol=1e-5, atol=1e-6, msg=name)
        if strategy.config.memory.device_limit is not None:
            report = strategy.memory_report()
            assert report.evictions > 0 and report.peak_device_chunk_bytes <= limit, report


# --------------------------------------------------------------------------------------------------
# The example
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_example_train_hf(tmp_path: Path) -> None:
    """``python examples/train_hf.py`` (a Hydra app) trains a GPT-2 from a config with PatrickStar and writes an
    ordinary checkpoint with the Hugging Face model's own parameter names."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("HYDRA_FULL_ERROR", None)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "examples" / "train_hf.py"),
        f"hydra.run.dir={run_dir}",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
        "data.max_chars=20000",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    explain = f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, explain
    assert "memory report" in proc.stdout.lower(), explain
    assert "train_loss:" in proc.stdout, explain
    checkpoints = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert checkpoints, explain
    state = torch.load(checkpoints[-1], map_location="cpu", weights_only=False)["state_dict"]
    assert "model.transformer.wte.weight" in state and "model.lm_head.weight" in state
    assert torch.equal(state["model.transformer.wte.weight"], state["model.lm_head.weight"])
