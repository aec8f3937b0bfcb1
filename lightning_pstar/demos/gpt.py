"""A small GPT (decoder-only transformer) used by the examples, benchmarks and tests.

The model follows the nanoGPT layout: token and position embeddings, pre-LayerNorm blocks of causal
self-attention and an MLP, a final LayerNorm and a language-model head whose weight is tied to the token
embedding. The tied weight is deliberate: it is the case a chunk manager must handle (one parameter
reachable from two modules).

Initialisation lives in ``reset_parameters()`` of the modules that own parameters, never in a pass over the
whole model. The PatrickStar strategy (like FSDP) builds a model on the meta device and materialises it by
calling ``reset_parameters()`` on every submodule that has one, so that is the only place an init rule
survives meta-device construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "gpt_num_params"]

_INIT_STD = 0.02


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int
    """Number of token ids the embedding and the head cover (may exceed the corpus vocabulary)."""
    block_size: int
    """Longest sequence the position embedding covers."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"`n_embd` ({self.n_embd}) must be divisible by `n_head` ({self.n_head})."
                " HINT: pick n_embd as a multiple of n_head, e.g. n_embd=128 with n_head=4."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout!r}.")


class InitLinear(nn.Linear):
    """``nn.Linear`` with the GPT-2 init: weight ~ N(0, std), bias = 0."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, std: float = _INIT_STD) -> None:
        # Set before nn.Linear.__init__, which calls reset_parameters() and therefore needs it.
        self.std = std
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        """Draw the weight from N(0, std) and zero the bias."""
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class InitEmbedding(nn.Embedding):
    """``nn.Embedding`` with the GPT-2 init: weight ~ N(0, 0.02) (torch's default is N(0, 1))."""

    def reset_parameters(self) -> None:
        """Draw the weight from N(0, 0.02)."""
        nn.init.normal_(self.weight, mean=0.0, std=_INIT_STD)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only attends to positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = InitLinear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # GPT-2 scales the init of projections that write into the residual stream by 1/sqrt(2 * n_layer)
        # so that the stream's variance does not grow with depth.
        self.c_proj = InitLinear(
            config.n_embd, config.n_embd, bias=config.bias, std=_INIT_STD / math.sqrt(2 * config.n_layer)
        )
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape (B, T, C) and return the same shape."""
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with a 4x expansion."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = InitLinear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = InitLinear(
            4 * config.n_embd, config.n_embd, bias=config.bias, std=_INIT_STD / math.sqrt(2 * config.n_layer)
        )
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, T, C) to (B, T, C)."""
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # nn.LayerNorm's own reset_parameters (weight 1, bias 0) is already the GPT-2 init.
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, T, C) to (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model with a tied embedding and output head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = InitEmbedding(config.vocab_size, config.n_embd)
        self.wpe = InitEmbedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = InitLinear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter reachable as both wte.weight and lm_head.weight. Both owners'
        # reset_parameters() draw from N(0, 0.02), so the init does not depend on which runs last.
        self.lm_head.weight = self.wte.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return logits (B, T, vocab_size) for token ids ``idx`` (B, T), and the mean cross-entropy
        against ``targets`` (B, T) when given."""
        B, T = idx.shape  # (B, T)
        if T > self.config.block_size:
            raise ValueError(
                f"Sequence length {T} exceeds block_size {self.config.block_size}."
                " HINT: crop the input or build the model with a larger block_size."
            )
        # Position ids are recomputed on the input's device rather than stored: a parameter or persistent
        # buffer would be model data the chunk manager has to carry for nothing.
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        if targets is None:
            return logits, None
        # The loss is computed in fp32 even under autocast: cross-entropy over a large vocabulary loses
        # precision in bf16/fp16.
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens and return (B, T + max_new_tokens).

        The context is cropped to the last ``block_size`` tokens. ``temperature`` -> 0 approaches greedy
        decoding; ``top_k`` samples only among the k most likely tokens.
        """
        if temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature!r}.")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # (B, <=block_size)
            logits, _ = self(context)
            logits = logits[:, -1, :].float() / temperature  # (B, vocab_size)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)  # (B, vocab_size)
            next_id = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, next_id], dim=1)  # (B, T + 1)
        return idx


def gpt_num_params(config: GPTConfig) -> int:
    """Number of unique parameter elements of ``GPT(config)``, counting the tied weight once."""
    c, v = config.n_embd, config.vocab_size
    ln = 2 * c if config.bias else c
    linear_bias = 1 if config.bias else 0
    attn = c * 3 * c + 3 * c * linear_bias + c * c + c * linear_bias
    mlp = c * 4 * c + 4 * c * linear_bias + 4 * c * c + c * linear_bias
    per_block = 2 * ln + attn + mlp
    # lm_head.weight is wte.weight, so it adds nothing.
    return v * c + config.block_size * c + config.n_layer * per_block + ln
