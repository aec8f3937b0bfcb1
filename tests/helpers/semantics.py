"""What the training-semantics tests (issue 13) train, at one rank and at two: manual optimization with one or two
optimizers, manual clipping and manual gradient accumulation, and torch's own attention modules.

Both sides of every comparison (plain Lightning and PatrickStar) build the same module from the same
:class:`ManualSpec`, so they differ only in the strategy. The modules record every loss they compute in
``losses``; the :class:`~tests.helpers.runs.LossRecorder` of :func:`~tests.helpers.runs.fit` records the final
consolidated state. Everything is importable by a fresh ``spawn`` process (the distributed tests pickle specs
and modules by reference).

- :class:`EncDec`: an encoder (embedding and an MLP) and a decoder (LayerNorm, an MLP and the head) whose
  parameters two optimizers split between them;
- :class:`ManualLM`: manual optimization over :class:`EncDec` as a :class:`ManualSpec` says;
- :class:`TransformerLM` (``nn.TransformerEncoder``) and :class:`AttentionLM` (a bare ``nn.MultiheadAttention``,
  whose ``out_proj`` weights are read by the attention's own forward), wrapped by :class:`~tests.helpers.runs.LM`;
- :func:`assert_within_bf16_noise`: the bf16-mixed criterion (no farther from plain 32-true than plain bf16 is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from tests.helpers.models import BLOCK, N_EMBD, N_HEAD, SEED, VOCAB, lm_loss
from tests.helpers.runs import OptimSpec, make_optimizer, make_scheduler

ADAM = OptimSpec(name="adam", lr=3e-3)
ADAMW = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1)
SGD = OptimSpec(name="sgd", lr=0.05, momentum=0.9)
OPTIMS = {"adam": ADAM, "adamw": ADAMW, "sgd": SGD}
"""The optimizers a :class:`ManualSpec` names (torch's fused kernels, as the strategy uses)."""

# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


class EncDec(nn.Module):
    """Token ids (B, T) -> logits (B, T, VOCAB) through ``encoder`` then ``decoder``: two disjoint parameter sets."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Embedding(VOCAB, N_EMBD), nn.Linear(N_EMBD, 2 * N_EMBD), nn.GELU(), nn.Linear(2 * N_EMBD, N_EMBD)
        )
        self.decoder = nn.Sequential(
            nn.LayerNorm(N_EMBD), nn.Linear(N_EMBD, 2 * N_EMBD), nn.GELU(), nn.Linear(2 * N_EMBD, VOCAB)
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(idx))  # (B, T, VOCAB)


def causal_mask(t: int, device: torch.device) -> torch.Tensor:
    """A float (T, T) mask with -inf above the diagonal (what ``nn.Transformer`` builds)."""
    return nn.Transformer.generate_square_subsequent_mask(t, device=device)


class TransformerLM(nn.Module):
    """Embeddings, torch's ``nn.TransformerEncoder`` of two post-norm ``nn.TransformerEncoderLayer`` (batch_first,
    no dropout, causal) and a head. The encoder deep-copies its layer, so both layers start from equal weights."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        layer = nn.TransformerEncoderLayer(N_EMBD, N_HEAD, dim_feedforward=2 * N_EMBD, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))  # (B, T, C)
        x = self.encoder(x, mask=causal_mask(t, idx.device), is_causal=True)
        return self.head(x)  # (B, T, VOCAB)


class AttentionLM(nn.Module):
    """An embedding, one bare causal ``nn.MultiheadAttention`` (its forward reads ``out_proj``'s weights; the
    ``out_proj`` module never runs) with a residual, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.attn = nn.MultiheadAttention(N_EMBD, N_HEAD, dropout=0.0, batch_first=True)
        self.head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)  # (B, T, C)
        y, _ = self.attn(x, x, x, attn_mask=causal_mask(idx.shape[1], idx.device), need_weights=False)
        return self.head(x + y)  # (B, T, VOCAB)


ATTENTION_MODELS: dict[str, type[nn.Module]] = {
    "transformer_encoder": TransformerLM,
    "multihead_attention": AttentionLM,
}

# --------------------------------------------------------------------------------------------------
# Manual optimization
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class ManualSpec:
    """How :class:`ManualLM` optimizes (``automatic_optimization = False`` in every pattern)."""

    pattern: str = "one_backward"
    """"one_backward": two optimizers (encoder's, decoder's), one ``manual_backward`` per batch, then both step
    and both zero; "gan": two losses and two backwards per batch, each optimizer toggled, stepped after its own
    backward, zeroed and untoggled; "single": one optimizer over every parameter."""
    optims: tuple[str, ...] = ("adam", "sgd")
    """Names in :data:`OPTIMS`: the encoder's and the decoder's ("single": the first, for the whole model)."""
    decoder_first: bool = False
    """"one_backward": step and zero the decoder's optimizer before the encoder's."""
    clip_val: float | None = None
    """``self.clip_gradients(opt, gradient_clip_val=clip_val, ...)`` before every ``opt.step()``."""
    clip_algorithm: str = "norm"
    accumulate: int = 1
    """``manual_backward(loss / accumulate)`` every batch; step and zero every ``accumulate`` batches."""
    cosine_t_max: int | None = None
    """A cosine schedule on every optimizer, stepped by hand after each optimizer step."""
    shared_param: bool = False
    """Give the decoder's parameters to both optimizers (the strategy must refuse it)."""
    automatic: bool = False
    """Leave automatic optimization on (with two optimizers Lightning itself refuses that)."""


class ManualLM(L.LightningModule):
    """Manual optimization of :class:`EncDec` (built right after ``torch.manual_seed(SEED)``) as ``spec`` says."""

    def __init__(self, spec: ManualSpec) -> None:
        super().__init__()
        self.spec = spec
        self.automatic_optimization = spec.automatic
        torch.manual_seed(SEED)
        self.net = EncDec()
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:
            torch.set_num_threads(1)  # two ranks share two cores

    def _optimizers(self) -> list[LightningOptimizer]:
        opts = self.optimizers()
        if isinstance(opts, list):
            return list(opts)
        return [opts]

    def _schedulers(self) -> list[Any]:
        schedulers = self.lr_schedulers()
        if schedulers is None:
            return []
        return list(schedulers) if isinstance(schedulers, list) else [schedulers]

    def _step(self, opt: Any) -> None:
        # a LightningOptimizer, as ``self.optimizers()`` hands it out (Lightning's own examples clip it)
        spec = self.spec
        if spec.clip_val is not None:
            self.clip_gradients(opt, gradient_clip_val=spec.clip_val, gradient_clip_algorithm=spec.clip_algorithm)
        opt.step()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        if self.spec.pattern == "gan":
            return self._gan_step(x, y)
        loss = lm_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        self.manual_backward(loss / self.spec.accumulate)
        if (batch_idx + 1) % self.spec.accumulate == 0:
            opts = self._optimizers()
            if self.spec.decoder_first:
                opts.reverse()
            for opt in opts:
                self._step(opt)
            for opt in opts:
                opt.zero_grad()
            for scheduler in self._schedulers():
                scheduler.step()
        return loss

    def _gan_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """First the encoder's loss (next token) with the decoder's parameters toggled off, then the decoder's own
        loss (reconstruct the input tokens) with the encoder's toggled off, after the encoder has stepped."""
        enc_opt, dec_opt = self._optimizers()
        self.toggle_optimizer(enc_opt)
        loss_enc = lm_loss(self.net(x), y)
        self.manual_backward(loss_enc)
        self._step(enc_opt)
        enc_opt.zero_grad()
        self.untoggle_optimizer(enc_opt)

        self.toggle_optimizer(dec_opt)
        loss_dec = lm_loss(self.net(x), x)
        self.manual_backward(loss_dec)
        self._step(dec_opt)
        dec_opt.zero_grad()
        self.untoggle_optimizer(dec_opt)
        for scheduler in self._schedulers():
            scheduler.step()
        self.losses += [float(loss_enc.detach()), float(loss_dec.detach())]
        return loss_enc

    def configure_optimizers(self) -> Any:
        spec = self.spec
        if spec.pattern == "single":
            optimizers = [make_optimizer(OPTIMS[spec.optims[0]], list(self.net.parameters()))]
        else:
            enc = list(self.net.encoder.parameters())
            dec = list(self.net.decoder.parameters())
            optimizers = [
                make_optimizer(OPTIMS[spec.optims[0]], enc + dec if spec.shared_param else enc),
                make_optimizer(OPTIMS[spec.optims[1]], dec),
            ]
        if spec.cosine_t_max is None:
            return optimizers
        schedulers = [make_scheduler(OptimSpec(cosine_t_max=spec.cosine_t_max), opt) for opt in optimizers]
        return optimizers, schedulers


# --------------------------------------------------------------------------------------------------
# The bf16-mixed criterion
# --------------------------------------------------------------------------------------------------

BF16_FACTOR = 2.0
"""How many times plain bf16's own distance from plain 32-true a PatrickStar bf16-mixed run may be from plain
32-true. PatrickStar runs the model on bf16 copies of fp32 masters, plain Lightning on fp32 weights under
autocast: both round differently from 32-true, neither is the other's reference."""


def rel_gaps(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``|a_i - b_i| / |b_i|`` per step (lengths must match)."""
    assert len(a) == len(b), f"length mismatch: {len(a)} vs {len(b)}"
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def assert_within_bf16_noise(
    got: Sequence[float], plain_bf16: Sequence[float], plain_32: Sequence[float], *, what: str
) -> tuple[float, float]:
    """Every loss of ``got`` within ``BF16_FACTOR`` times the largest relative distance of plain bf16 from plain
    32-true over the run (per step the rounding noise is random: either side may happen to be closer at one
    step). A real error (a gradient off by a factor, a wrong rounding) moves the loss by 1e-3 or more, far above
    bf16's 1e-4. Returns the largest distances (PatrickStar's, plain bf16's) for the test to print."""
    ours, theirs = rel_gaps(got, plain_32), rel_gaps(plain_bf16, plain_32)
    noise = max(theirs)
    assert noise > 0, f"{what}: plain bf16 equals plain 32-true: the run is not in bf16"
    for i, gap in enumerate(ours):
        assert gap <= BF16_FACTOR * noise, (
            f"{what}: step {i}: patrickstar bf16 loss {got[i]!r} is {gap:.3e} (relative) from plain 32-true"
            f" {plain_32[i]!r}; plain bf16 is at most {noise:.3e} away (bound {BF16_FACTOR * noise:.3e})"
        )
    return max(ours), noise


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest element difference over the tensors of ``b`` (the same keys in ``a``)."""
    return max(float((a[k].float() - v.float()).abs().max()) for k, v in b.items())
