"""Shared pieces of the integration tests.

Self-contained on purpose (no import of ``lightning_pstar.demos``): a tiny GPT with tied weights and a
frozen layer, deterministic token data, a LightningModule factory, a loss-recording callback, trainer
factories and a plain-PyTorch reference loop that implements the mixed-precision semantics of
README.md's "Precision" section without any Lightning or chunk machinery.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 32
N_EMBD = 32
N_HEAD = 2
BLOCK = 16
N_LAYER = 2
SEED = 1234
DATA_SEED = 4321


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(N_EMBD, dim=2)  # 3 x (B, T, C)
        q = q.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2)
        v = v.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    """Two-layer GELU MLP with a 4x hidden width."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(N_EMBD)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A nanoGPT-shaped model small enough for 2 CPU cores.

    ``wte.weight`` is tied to ``lm_head.weight`` the nanoGPT way (the embedding takes the head's
    parameter). Submodules are registered in construction order and all of them have
    ``reset_parameters``, so materialising a meta-device copy module by module in ``modules()`` order
    after the same seed reproduces an eagerly built model exactly.

    Args:
        frozen: add ``frozen``, a Linear with ``requires_grad=False`` used in the forward pass.
        unused: add ``unused``, a trainable Linear that forward never calls (it never gets a gradient).
        reuse_block: call ``blocks[0]`` a second time after the last block, so its parameters are used
            twice and must receive the sum of both gradients.
    """

    def __init__(self, *, frozen: bool = True, unused: bool = False, reuse_block: bool = False) -> None:
        super().__init__()
        self.reuse_block = reuse_block
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.frozen: nn.Linear | None = None
        if frozen:
            self.frozen = nn.Linear(N_EMBD, N_EMBD)
            self.frozen.requires_grad_(False)
        self.unused: nn.Linear | None = nn.Linear(N_EMBD, N_EMBD) if unused else None
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied: one Parameter, two names in state_dict

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (B, T, VOCAB) for token ids of shape (B, T)."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if self.reuse_block:
            x = self.blocks[0](x)
        x = self.ln_f(x)
        if self.frozen is not None:
            x = x + self.frozen(x)
        return self.lm_head(x)  # (B, T, VOCAB)


def build_model(seed: int = SEED, **model_kwargs: Any) -> TinyGPT:
    """Build a :class:`TinyGPT` on CPU right after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return TinyGPT(**model_kwargs)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def make_dataset(n_seq: int, seed: int = DATA_SEED) -> TensorDataset:
    """Arithmetic token sequences (start + k * stride mod VOCAB) with 10% random tokens.

    Learnable but not trivial, fully determined by ``seed``. Inputs and targets are shifted by one.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n_seq, 1), generator=g)
    stride = torch.randint(1, 4, (n_seq, 1), generator=g)
    seq = (start + stride * torch.arange(BLOCK + 1)) % VOCAB  # (N, BLOCK + 1)
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def make_loader(n_seq: int = 48, batch_size: int = 4, seed: int = DATA_SEED) -> DataLoader:
    """An unshuffled loader over :func:`make_dataset`."""
    return DataLoader(make_dataset(n_seq, seed), batch_size=batch_size, shuffle=False)


# --------------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class OptimSpec:
    """Which optimizer ``configure_optimizers`` returns (and the reference loops build)."""

    name: str = "adamw"
    """One of "adamw", "adam", "sgd", "rmsprop", "adagrad" (the last two are unsupported by the strategy)."""
    lr: float = 3e-3
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    cosine_t_max: int | None = None
    """If set, a CosineAnnealingLR with this T_max stepped every optimizer step (interval "step")."""
    trainable_only: bool = True
    """Pass only ``requires_grad`` parameters to the optimizer (else all parameters)."""


def make_optimizer(spec: OptimSpec, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """Build the optimizer of ``spec``; Adam, AdamW and SGD use torch's fused kernels."""
    if spec.name == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
    if spec.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            nesterov=spec.nesterov,
            weight_decay=spec.weight_decay,
            fused=True,
        )
    if spec.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=spec.lr)
    if spec.name == "adagrad":
        return torch.optim.Adagrad(params, lr=spec.lr)
    raise ValueError(f"unknown optimizer {spec.name!r}")


def make_scheduler(spec: OptimSpec, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The cosine schedule of ``spec``, or None."""
    if spec.cosine_t_max is None:
        return None
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=spec.cosine_t_max)


# --------------------------------------------------------------------------------------------------
# LightningModule, callback, trainers
# --------------------------------------------------------------------------------------------------


class TinyLM(L.LightningModule):
    """LightningModule around :class:`TinyGPT`.

    Args:
        optim: the optimizer (and optional cosine schedule) ``configure_optimizers`` returns.
        seed: ``torch.manual_seed`` applied right before the model is built.
        meta_init: build the model in ``configure_model`` (under the strategy's init context)
            instead of in ``__init__``.
        record_grad_norms: in ``on_before_optimizer_step``, record the global 2-norm of ``p.grad``
            (before clipping). Only meaningful with plain Lightning, where ``p.grad`` is populated.
        model_kwargs: forwarded to :class:`TinyGPT`.
    """

    def __init__(
        self,
        *,
        optim: OptimSpec | None = None,
        seed: int = SEED,
        meta_init: bool = False,
        record_grad_norms: bool = False,
        **model_kwargs: Any,
    ) -> None:
        super().__init__()
        self.optim = optim if optim is not None else OptimSpec()
        self.seed = seed
        self.model_kwargs = model_kwargs
        self.record_grad_norms = record_grad_norms
        self.grad_norms: list[float] = []
        self.grad_enabled_in: dict[str, list[bool]] = {"validation": [], "test": [], "predict": []}
        self.training_steps_run = 0
        self.configure_model_device: torch.device | None = None
        self.model: TinyGPT | None = None if meta_init else build_model(seed, **model_kwargs)

    def configure_model(self) -> None:
        """Build the model here when ``meta_init`` (idempotent: Lightning may call this twice).

        Records the device the parameters were created on (``meta`` under a deferred-init context).
        """
        if self.model is None:
            self.model = build_model(self.seed, **self.model_kwargs)
            self.configure_model_device = next(self.model.parameters()).device

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.training_steps_run += 1
        x, y = batch
        return lm_loss(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.grad_enabled_in["validation"].append(torch.is_grad_enabled())
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.grad_enabled_in["test"].append(torch.is_grad_enabled())
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.grad_enabled_in["predict"].append(torch.is_grad_enabled())
        return self(batch[0])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.record_grad_norms:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad or not self.optim.trainable_only]
        optimizer = make_optimizer(self.optim, params)
        scheduler = make_scheduler(self.optim, optimizer)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LossRecorder(L.Callback):
    """Records the (accumulation-normalised) training loss of every micro-batch, the learning rate,
    the consolidated model state at the start and end of training and, optionally, after every
    optimizer step.

    States come from ``trainer.strategy.lightning_module_state_dict()`` (what a checkpoint stores),
    cloned to fp32 on CPU.

    Args:
        snapshot_state: after each batch that completed an optimizer step, append the state to ``states``.
    """

    def __init__(self, snapshot_state: bool = False) -> None:
        self.losses: list[float] = []
        self.global_steps: list[int] = []
        self.lrs: list[float] = []
        self.snapshot_state = snapshot_state
        self.states: list[dict[str, torch.Tensor]] = []
        self.initial_state: dict[str, torch.Tensor] = {}
        self.final_state: dict[str, torch.Tensor] = {}
        self._last_step = 0

    @staticmethod
    def _state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
        state = trainer.strategy.lightning_module_state_dict()
        return {k: v.detach().float().cpu().clone() for k, v in state.items()}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step
        self.initial_state = self._state(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        step = trainer.global_step
        if self.snapshot_state and step != self._last_step:
            self.states.append(self._state(trainer))
        self._last_step = step
        self.global_steps.append(step)
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.final_state = self._state(trainer)


def make_trainer(
    *,
    strategy: Any,
    precision: str | None = "32-true",
    max_steps: int = 20,
    max_epochs: int = -1,
    callbacks: Sequence[L.Callback] = (),
    plugins: Sequence[Any] | None = None,
    **kwargs: Any,
) -> L.Trainer:
    """A quiet single-process CPU Trainer; both parity sides must be built by this function.

    ``use_distributed_sampler=False`` because the strategy subclasses DDPStrategy and Lightning
    would otherwise inject a DistributedSampler that changes the data order against "auto".
    When ``plugins`` are given, ``precision`` is not passed (Lightning refuses both).
    """
    defaults: dict[str, Any] = {
        "enable_progress_bar": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "use_distributed_sampler": False,
    }
    defaults.update(kwargs)
    if plugins:
        defaults["plugins"] = list(plugins)
    else:
        defaults["precision"] = precision
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        **defaults,
    )


@dataclass
class FitResult:
    """What one ``fit`` produced."""

    module: TinyLM
    trainer: L.Trainer
    recorder: LossRecorder


def fit(
    module: TinyLM,
    *,
    strategy: Any,
    loader: DataLoader | None = None,
    snapshot_state: bool = False,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> FitResult:
    """Fit ``module`` with :func:`make_trainer` and a :class:`LossRecorder` (resuming from ``ckpt_path``)."""
    recorder = LossRecorder(snapshot_state=snapshot_state)
    extra = list(trainer_kwargs.pop("callbacks", ()))
    trainer = make_trainer(strategy=strategy, callbacks=[recorder, *extra], **trainer_kwargs)
    trainer.fit(module, train_dataloaders=loader if loader is not None else make_loader(), ckpt_path=ckpt_path)
    return FitResult(module=module, trainer=trainer, recorder=recorder)


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest ``|a_i - b_i| / |b_i|`` (lengths must match)."""
    assert len(a) == len(b), f"length mismatch: {len(a)} vs {len(b)}"
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------------
# Plain-PyTorch reference of the mixed-precision contract
# --------------------------------------------------------------------------------------------------


@dataclass
class ReferenceRun:
    """What :func:`reference_mixed_precision` produced."""

    losses: list[float]
    """Accumulation-normalised loss of every micro-batch (what Lightning reports)."""
    skipped_steps: list[int]
    """0-based optimizer step indices that overflowed and were skipped."""
    scales: list[float]
    """Loss scale in effect at each optimizer step (before its update)."""
    final_scale: float
    masters: dict[str, torch.Tensor]
    """Final fp32 master weights of the trainable parameters, by ``named_parameters`` name."""
    master_history: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Master weights after every optimizer step."""


def _cycle(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for _ in itertools.count():
        yield from loader


def reference_mixed_precision(
    *,
    dtype: torch.dtype,
    optim: OptimSpec,
    loader: DataLoader,
    max_steps: int,
    accumulate: int = 1,
    clip_val: float | None = None,
    initial_scale: float = 2.0**16,
    backoff_factor: float = 0.5,
    growth_factor: float = 2.0,
    growth_interval: int = 2000,
    seed: int = SEED,
    **model_kwargs: Any,
) -> ReferenceRun:
    """Train :class:`TinyGPT` with the exact mixed-precision semantics described in README.md (Precision).

    fp32 masters hold the truth; the model holds ``master.to(dtype)``; forward runs under autocast;
    (fp16 only) the loss is scaled by S before backward; per-micro-batch gradients are summed in fp32;
    at each step they are divided by S, checked for inf/nan (skip + back off on overflow), clipped by
    global norm with ``clip_grad_norm_`` and stepped with the fused optimizer on the masters.
    """
    use_scaler = dtype == torch.float16
    model = build_model(seed, **model_kwargs)
    named = list(model.named_parameters())  # dedups the tied weight
    trainable = [(n, p) for n, p in named if p.requires_grad]
    masters = [nn.Parameter(p.detach().clone().float()) for _, p in trainable]
    model.to(dtype)
    optimizer = make_optimizer(optim, masters)
    scheduler = make_scheduler(optim, optimizer)
    acc: list[torch.Tensor | None] = [None] * len(masters)
    scale = initial_scale if use_scaler else 1.0
    good_steps = 0
    run = ReferenceRun(losses=[], skipped_steps=[], scales=[], final_scale=scale, masters={})
    micro = 0
    step = 0
    for x, y in _cycle(loader):
        if step == max_steps:
            break
        with torch.autocast("cpu", dtype=dtype):
            loss = lm_loss(model(x), y)
        loss = loss / accumulate
        run.losses.append(float(loss.detach()))
        (loss * scale if use_scaler else loss).backward()
        for i, (_, p) in enumerate(trainable):
            if p.grad is not None:
                g = p.grad.float()
                acc[i] = g if acc[i] is None else acc[i] + g  # type: ignore[operator]
                p.grad = None
        micro += 1
        if micro % accumulate:
            continue
        run.scales.append(scale)
        grads = [None if a is None else a / scale for a in acc]
        finite = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        if not finite:
            run.skipped_steps.append(step)
            scale *= backoff_factor
            good_steps = 0
        else:
            for m, g in zip(masters, grads, strict=True):
                m.grad = g
            if clip_val is not None:
                torch.nn.utils.clip_grad_norm_(masters, clip_val)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for (_, p), m in zip(trainable, masters, strict=True):
                    p.copy_(m.to(dtype))
            if use_scaler:
                good_steps += 1
                if good_steps == growth_interval:
                    scale *= growth_factor
                    good_steps = 0
        if scheduler is not None:
            scheduler.step()
        acc = [None] * len(masters)
        run.master_history.append({n: m.detach().clone() for (n, _), m in zip(trainable, masters, strict=True)})
        step += 1
    run.final_scale = scale
    run.masters = {n: m.detach().clone() for (n, _), m in zip(trainable, masters, strict=True)}
    assert all(math.isfinite(v) for v in run.losses)
    return run
