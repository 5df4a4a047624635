"""The model every algorithm trains, and how it is scored.

Owns: the multilayer perceptron (``features -> hidden... -> classes``, ReLU; the command
line's default hidden widths are 128, 64), its seeded construction, loading a flat list of
tensors (a parameter server's center, a rank's final parameters) into it, and accuracy/loss
on a split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["build_model", "evaluate", "load_parameters"]


def build_model(
    num_features: int, num_classes: int, seed: int, hidden: Sequence[int]
) -> nn.Sequential:
    """The MLP ``num_features -> hidden[0] -> ... -> num_classes`` (ReLU between layers),
    initialized from ``torch.manual_seed(seed)`` (same seed -> same weights); the global RNG
    state is restored afterwards."""
    if num_features < 1 or num_classes < 2:
        raise ValueError(
            f"need >= 1 feature and >= 2 classes, got {num_features} and {num_classes}"
        )
    if any(int(h) < 1 for h in hidden):
        raise ValueError(f"hidden widths must be >= 1, got {list(hidden)}")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        layers: list[nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
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
