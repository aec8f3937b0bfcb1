"""Test models: small enough for 2 CPU cores, shaped like what users train, each with a known hard case.

- :class:`TinyGPT`: nanoGPT-shaped (attention and MLP submodules), tied ``wte``/``lm_head``, optionally a frozen,
  an unused and a reused block (the integration parity tests);
- :class:`FlatGPT`: the same layer sizes with flat blocks and no key bias, for weights compared across
  strategies (the distributed tests);
- :class:`MultiUse`: parameters used several times in one forward, or outside their module;
- :class:`MoE`: a mixture of experts routed by token id, where experts (and a branch) are skipped.

Every model is built by the caller right after a ``torch.manual_seed``; submodules are created in the order
their parameters appear, so the same seed gives the same weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 32
N_EMBD = 32
N_HEAD = 2
BLOCK = 16
N_LAYER = 2
SEED = 1234
N_EXPERTS = 4


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of logits (B, T, V) against targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------------------------------
# TinyGPT
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
    """Pre-LayerNorm transformer block of width ``N_EMBD``."""

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


# --------------------------------------------------------------------------------------------------
# FlatGPT
# --------------------------------------------------------------------------------------------------


class FlatBlock(nn.Module):
    """Pre-LayerNorm transformer block with causal self-attention, its Linears direct children."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.n_embd = n_embd
        self.ln1 = nn.LayerNorm(n_embd)
        # no bias: a key bias has a zero gradient in exact arithmetic (softmax ignores a shift), so Adam would
        # turn rounding noise into lr-sized steps and final weights could not be compared across strategies
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class FlatGPT(nn.Module):
    """A nanoGPT-shaped model: ``wte.weight`` is tied to ``lm_head.weight``; ``frozen`` is a Linear with
    ``requires_grad=False`` that forward uses; ``checkpoint_blocks`` recomputes each block in backward
    (``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, n_embd: int = N_EMBD) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(BLOCK, n_embd)
        self.blocks = nn.ModuleList([FlatBlock(n_embd) for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.frozen = nn.Linear(n_embd, n_embd)
        self.frozen.requires_grad_(False)
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied: one Parameter, two names
        self.checkpoint_blocks = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, VOCAB) for token ids (B, T)."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        x = self.ln_f(x)
        return self.lm_head(x + self.frozen(x))  # (B, T, VOCAB)


# --------------------------------------------------------------------------------------------------
# Parameters used several times; conditional parameters
# --------------------------------------------------------------------------------------------------


class MultiUse(nn.Module):
    """Embedding, a body that uses parameters several times, and a head. ``kind``:

    - ``loop``: one Linear applied four times in a row;
    - ``rnn``: an ``nn.RNNCell`` stepped over the sequence (its module called T times);
    - ``twice``: one Linear called, then another, then the first again;
    - ``functional``: the embedding weight read with ``F.linear`` outside the embedding's forward (an output
      projection tied by hand), after other modules ran, and the embedding module called again afterwards.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, N_EMBD)
        self.lin = nn.Linear(N_EMBD, N_EMBD)
        self.mid = nn.Linear(N_EMBD, N_EMBD)
        self.cell = nn.RNNCell(N_EMBD, N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, C)
        if self.kind == "loop":
            for _ in range(4):
                x = torch.tanh(self.lin(x))
        elif self.kind == "rnn":
            h = torch.zeros(x.shape[0], N_EMBD, device=x.device, dtype=x.dtype)
            steps = []
            for t in range(x.shape[1]):
                h = self.cell(x[:, t], h)  # (B, C)
                steps.append(h)
            x = torch.stack(steps, dim=1)
        elif self.kind == "twice":
            x = torch.tanh(self.lin(torch.tanh(self.mid(torch.tanh(self.lin(x))))))
        elif self.kind == "functional":
            x = torch.tanh(self.mid(torch.tanh(self.lin(x))))
            tied = F.linear(x, self.emb.weight)  # (B, T, V): the embedding weight, outside its module
            return tied + self.head(torch.tanh(self.emb(idx)))
        else:
            raise ValueError(self.kind)
        return self.head(x)


class MoE(nn.Module):
    """Top-1 mixture of experts routed deterministically by token id (expert = token % N_EXPERTS); an expert
    that receives no token is not called.

    Args:
        width: the embedding width (each expert is width -> 2 width -> width).
        extra: add ``extra``, a Linear run only while ``use_extra`` is set (a branch taken on some steps).
    """

    def __init__(self, width: int = N_EMBD, *, extra: bool = True) -> None:
        super().__init__()
        self.width = width
        self.emb = nn.Embedding(VOCAB, width)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(N_EXPERTS)
        )
        self.extra: nn.Linear | None = nn.Linear(width, width) if extra else None
        self.head = nn.Linear(width, VOCAB)
        self.use_extra = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, C)
        flat = x.reshape(-1, self.width)  # (B*T, C)
        route = (idx % N_EXPERTS).reshape(-1)  # (B*T,)
        mixed = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().squeeze(1)
            if rows.numel():
                mixed = mixed.index_add(0, rows, expert(flat[rows]))
        x = x + mixed.view_as(x)
        if self.use_extra:
            assert self.extra is not None, "use_extra needs MoE(extra=True)"
            x = x + torch.tanh(self.extra(x))
        return self.head(x)
