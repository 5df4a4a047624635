"""A small causal transformer (GPT) for character-level language modelling, in plain PyTorch.

Owns: the model's size (:class:`GPTConfig`, checked before anything is built), the bounds the
command line puts on it (:data:`SIZE_LIMITS`, :data:`MAX_PARAMETERS`) and its estimate of a
training step's memory (:meth:`GPTConfig.training_floats`), its layers and its seeded
GPT-2-style initialization (:func:`build_gpt`).

The model maps ``T <= context`` token indices to ``T`` rows of next-token logits::

    h_0 = E[x_t] + P[t]                                  token + learned position embedding
    h_l = h_{l-1} + Attn(LN(h_{l-1}))                    pre-norm block, l = 1..layers
    h_l = h_l + MLP(LN(h_l)),  MLP(z) = W_2 GELU(W_1 z)  (4 x width hidden units)
    logits_t = LN(h_layers)_t E^T                        output head tied to E

``Attn`` is multi-head causal self-attention through
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``: position ``t`` attends to
positions ``<= t`` only, so a logit at ``t`` never depends on a later token (tests check it).
No dropout: the runs are short and the held-out plays measure overfitting directly.

Initialization as GPT-2's: every ``Linear`` and ``Embedding`` weight ~ N(0, 0.02^2), biases
zero, LayerNorms (1, 0); the two projections that write into the residual stream (attention
output, MLP output) ~ N(0, (0.02 / sqrt(2 * layers))^2) so the stream's variance does not grow
with depth. The output head is the token embedding itself (``F.linear(h, E)``), one tensor in
``parameters()``, so every distributed optimizer sees one parameter, not two copies to keep
equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distoptim.checks import check_int

__all__ = ["MAX_PARAMETERS", "SIZE_LIMITS", "GPT", "GPTConfig", "build_gpt"]

_STD = 0.02

SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "layers": (1, 64),
    "width": (1, 4096),
    "heads": (1, 256),
    "context": (1, 4096),
}
"""The range the command line allows each size of its GPT (``--layers`` etc.), inclusive: a
small model that CPU worker processes train (the default is 2 x 128, 4 heads, context 64)."""

MAX_PARAMETERS = 150_000_000
"""The most parameters the command line's GPT may have (GPT-2 small has 124 M): within the
:data:`SIZE_LIMITS`, depth and width together can still make billions."""

_COPIES = 8
"""Float32 copies of the parameters a training worker may hold at once, for the memory
estimate: the parameters, their gradients, Adam's two moments, the DiLoCo family's global copy
and outer momentum, error feedback and a wire buffer."""


@dataclass(frozen=True)
class GPTConfig:
    """The model's size. ``width`` is the residual stream (embedding) size; it must be a
    multiple of ``heads``. Defaults: the command line's default model (docs/cli.md)."""

    vocab_size: int
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, 2)
        check_int("layers", self.layers, 1)
        check_int("width", self.width, 1)
        check_int("heads", self.heads, 1)
        check_int("context", self.context, 1)
        if self.width % self.heads:
            raise ValueError(
                f"width must be a multiple of heads, got width {self.width} and heads "
                f"{self.heads} (allowed: width = heads x head size)"
            )

    def num_parameters(self) -> int:
        """Parameter count: ``V*d + C*d`` embeddings, ``12 d^2 + 13 d`` per block, ``2d``
        final norm (the head is the token embedding)."""
        d = self.width
        return self.vocab_size * d + self.context * d + self.layers * (12 * d * d + 13 * d) + 2 * d

    def training_floats(self, batch: int) -> int:
        """An estimate (float32 values) of what one worker holds during a training step on
        ``batch`` windows of ``context`` tokens: :data:`_COPIES` copies of the
        :meth:`num_parameters`, plus the activations autograd keeps, per token
        ``layers * (20 * width + 2 * heads * context)`` (each block's norms, q/k/v, attention
        and MLP values, and attention weights where they are materialized) and ``3 *
        vocab_size`` (the logits, their softmax and its gradient). An estimate for refusing a
        run that cannot fit, not a measurement."""
        check_int("batch", batch, 1)
        per_token = self.layers * (20 * self.width + 2 * self.heads * self.context)
        per_token += 3 * self.vocab_size
        return _COPIES * self.num_parameters() + batch * self.context * per_token


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.width)
        self.attn = _CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.proj = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.proj(F.gelu(self.fc(self.ln_mlp(x))))


class GPT(nn.Module):
    """The causal transformer of the module doc; ``forward(idx)`` with ``idx`` an integer
    tensor ``(B, T)``, ``T <= context``, returns float logits ``(B, T, vocab_size)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln_out = nn.LayerNorm(cfg.width)
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = _STD / math.sqrt(2 * self.cfg.layers)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.normal_(0.0, _STD)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            for block in self.blocks:
                block.attn.proj.weight.normal_(0.0, residual_std)
                block.proj.weight.normal_(0.0, residual_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.shape[1] > self.cfg.context:
            raise ValueError(
                f"GPT takes token indices of shape (batch, T) with T <= context "
                f"{self.cfg.context}, got shape {tuple(idx.shape)}"
            )
        t = idx.shape[1]
        x = self.tok(idx.long()) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_out(x), self.tok.weight)


def build_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """:class:`GPT` of size ``cfg`` initialized from ``torch.manual_seed(seed)`` (same seed ->
    same weights); the global RNG state is restored afterwards."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    seed = check_int("seed", seed, 0)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return GPT(cfg)
    finally:
        torch.random.set_rng_state(gen_state)
