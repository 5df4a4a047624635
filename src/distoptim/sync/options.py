"""The options of ``CrossShardOptimizer``: the ``Reduction`` enum, validation, and what they imply.

Owns the constructor's arguments as one validated, immutable record (:class:`SyncOptions`),
checked through :mod:`distoptim.checks` before anything is created (subgroup creation is a
collective), and the two numbers the options fix for a group of ``n`` replicas:

* the *divisor* a ``.grad`` round divides the summed gradients by:
  ``n N`` for :attr:`Reduction.MEAN` (``N = backward_passes_per_step``), ``1`` for SUM;
* the *fingerprint* the parameter-list agreement digests
  (:func:`distoptim.comm.fingerprint.digest`): every option that changes the buckets or the
  rounds, so ranks built with different options refuse to reduce together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from distoptim import checks
from distoptim.comm.compression import WireFormat
from distoptim.comm.groups import check_group_assignment
from distoptim.sync.sharding import check_elementwise

__all__ = [
    "MAX_BUCKET_CAP_MB",
    "MIB",
    "Reduction",
    "SyncOptions",
    "check_saved_hyperparameters",
]

MIB = 1 << 20
"""Bytes in a MiB (``bucket_cap_mb`` counts them)."""

MAX_BUCKET_CAP_MB = checks.MAX_BUCKET_CAP_MB
"""The largest ``bucket_cap_mb`` accepted: 1 TiB (:func:`distoptim.checks.check_bucket_cap_mb`)."""


class Reduction(str, enum.Enum):
    """How replica gradients combine: ``MEAN`` (average over replicas) or ``SUM``."""

    MEAN = "mean"
    SUM = "sum"

    @classmethod
    def parse(cls, value: object) -> Reduction:
        """A :class:`Reduction`, or the strings ``"mean"`` / ``"sum"`` (any case)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.lower() in ("mean", "sum"):
            return cls(value.lower())
        raise ValueError(
            f"unknown reduction {value!r}: allowed values are Reduction.MEAN, Reduction.SUM, "
            "'mean', 'sum'"
        )


@dataclass(frozen=True)
class SyncOptions:
    """The validated options of one ``CrossShardOptimizer`` (see its docstring for each)."""

    reduction: Reduction
    name: str
    group_assignment: list[list[int]] | None
    bucket_cap_mb: float
    overlap: bool
    wire: WireFormat
    backward_passes_per_step: int
    sequence_guard: bool
    gradient_as_bucket_view: bool
    shard_optimizer_state: bool
    max_grad_norm: float | None = None

    @classmethod
    def check(
        cls,
        opt: object,
        reduction: object,
        name: object,
        group_assignment: object,
        world_size: int | None,
        *,
        bucket_cap_mb: object,
        overlap: object,
        compression: object,
        backward_passes_per_step: object,
        sequence_guard: object,
        gradient_as_bucket_view: object,
        shard_optimizer_state: object,
        max_grad_norm: object = None,
    ) -> SyncOptions:
        """Every argument checked, nothing changed; ``TypeError`` / ``ValueError`` otherwise.

        ``world_size``: the default group's size, or None outside a process group (then
        ``group_assignment`` is checked for its form only).
        """
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"CrossShardOptimizer wraps a torch.optim.Optimizer, got {checks.type_name(opt)}"
            )
        red = Reduction.parse(reduction)
        checks.check_str("name", name)
        cap = checks.check_bucket_cap_mb(bucket_cap_mb)
        clip = None
        if max_grad_norm is not None:
            clip = checks.check_positive("max_grad_norm", max_grad_norm)
        flags = {
            "overlap": overlap,
            "sequence_guard": sequence_guard,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "shard_optimizer_state": shard_optimizer_state,
        }
        for key, value in flags.items():
            checks.check_bool(key, value)
        passes = checks.check_int("backward_passes_per_step", backward_passes_per_step, 1)
        wire = WireFormat.parse(compression)
        checks.check_finite_hyperparameters(opt, "CrossShardOptimizer")
        if shard_optimizer_state:
            check_elementwise(opt)  # only element-wise updates may run on a slice
        groups = check_group_assignment(group_assignment, world_size)
        return cls(
            reduction=red,
            name=name,  # type: ignore[arg-type]  # checked above
            group_assignment=groups,
            bucket_cap_mb=cap,
            overlap=overlap,  # type: ignore[arg-type]
            wire=wire,
            backward_passes_per_step=passes,
            sequence_guard=sequence_guard,  # type: ignore[arg-type]
            gradient_as_bucket_view=gradient_as_bucket_view,  # type: ignore[arg-type]
            shard_optimizer_state=shard_optimizer_state,  # type: ignore[arg-type]
            max_grad_norm=clip,
        )

    @property
    def cap_bytes(self) -> int:
        """One bucket's payload cap in bytes."""
        return int(self.bucket_cap_mb * MIB)

    def divisor(self, num_shards: int) -> int:
        """What a ``.grad`` round divides the replicas' sum by: ``n N`` (MEAN) or 1 (SUM)."""
        if self.reduction is Reduction.MEAN:
            return num_shards * self.backward_passes_per_step
        return 1

    def fingerprint(self, num_shards: int) -> dict[str, object]:
        """The options every rank of a group must share, as the agreement digests them."""
        return {
            "reduction": self.reduction.value,
            "cap": (self.cap_bytes, self.overlap),
            "compression": self.wire.name,
            "backward_passes_per_step": self.backward_passes_per_step,
            "num_shards": num_shards,
            "sequence_guard": self.sequence_guard,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "shard_optimizer_state": self.shard_optimizer_state,
            "max_grad_norm": self.max_grad_norm,
        }


def check_saved_hyperparameters(opt: torch.optim.Optimizer, groups: object) -> None:
    """Raise ``ValueError`` if a saved param group holds a NaN/Inf hyperparameter.

    The same rule as at construction (:func:`distoptim.checks.check_finite_hyperparameters`),
    applied to the param groups of a state dict before anything is loaded; groups that are not
    dicts are left to the structural checks.
    """
    if not isinstance(groups, list):
        return
    saved = type(type(opt).__name__, (), {})()  # reads like the wrapped optimizer in messages
    saved.param_groups = [g if isinstance(g, dict) else {} for g in groups]
    checks.check_finite_hyperparameters(saved, "CrossShardOptimizer.load_state_dict")  # type: ignore[arg-type]
