"""The model every algorithm trains, and how it is scored.

Owns: the multilayer perceptron (``features -> 128 -> 64 -> classes``, ReLU), its seeded
construction, loading a flat list of tensors (a parameter server's center, a rank's final
parameters) into it, and accuracy/loss on a split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["HIDDEN", "build_model", "evaluate", "load_parameters"]

HIDDEN = (128, 64)
"""Hidden layer widths: small enough that 4 workers share 2 cores, big enough for >95 %."""


def build_model(num_features: int, num_classes: int, seed: int) -> nn.Sequential:
    """The MLP, initialized from ``torch.manual_seed(seed)`` (same seed -> same weights)."""
    if num_features < 1 or num_classes < 2:
        raise ValueError(
            f"need >= 1 feature and >= 2 classes, got {num_features} and {num_classes}"
        )
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        layers: list[nn.Module] = []
        width = num_features
        for hidden in HIDDEN:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        return nn.Sequential(*layers)
    finally:
        torch.random.set_rng_state(gen_state)


def load_parameters(model: nn.Module, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` (in ``model.parameters()`` order) into the model's parameters."""
    params = list(model.parameters())
    if len(params) != len(tensors):
        raise ValueError(f"model has {len(params)} parameters, got {len(tensors)} tensors")
    with torch.no_grad():
        for p, t in zip(params, tensors):
            if p.shape != t.shape:
                raise ValueError(f"parameter of shape {tuple(p.shape)} got {tuple(t.shape)}")
            p.copy_(t)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on ``(x, y)``, in one forward pass."""
    was_training = model.training
    model.eval()
    try:
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        acc = (logits.argmax(dim=1) == y).float().mean().item()
    finally:
        model.train(was_training)
    return acc, loss
