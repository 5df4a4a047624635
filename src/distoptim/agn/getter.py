"""AGNCustomGetter: which parameter-server shard holds the center variable of each parameter.

Owns: the placement of center variables over the ``num_ps`` shards. Placement is a pure,
deterministic function of the parameters' order, shapes and dtypes, so every worker computes the
same one without talking to anybody, and the server checks it (a worker whose model differs
from the chief's gets a clear error).

Placement strategies
--------------------
* ``"round_robin"`` (default) — parameter ``i`` goes to shard ``i mod num_ps``, in the wrapped
  optimizer's parameter order (param groups in order, parameters in order within a group). This
  is what TF's ``replica_device_setter`` does with its default round-robin strategy: with two
  shards and two parameters, each shard holds one.
* ``"size_balanced"`` — parameters, in the same order, each go to the shard holding the fewest
  bytes so far (ties: lowest shard index); TF's ``GreedyLoadBalancingStrategy`` with a byte-size
  load function. Use it when one layer dominates the model.

Local copies: in TF the getter also created each worker's "local center" variables. Here the
local copy of a parameter *is* the worker's own parameter (on whatever device the model lives);
the worker-side accumulator and last-pulled copy are allocated next to it by the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distoptim.checks import check_choice, check_optional_int

__all__ = ["STRATEGIES", "AGNCustomGetter"]

STRATEGIES = ("round_robin", "size_balanced")


class AGNCustomGetter:
    """Places center variables on parameter-server shards (see the module docstring).

    ``num_ps=None`` means "the number of shards of the cluster this process belongs to",
    resolved when the optimizer connects (``make_session_run_hook(...).begin()``).
    """

    def __init__(self, num_ps: int | None = None, strategy: str = "round_robin") -> None:
        self.num_ps = check_optional_int("num_ps", num_ps, 1)
        self.strategy = check_choice("strategy", strategy, STRATEGIES, fold_case=False)

    def __repr__(self) -> str:
        return f"AGNCustomGetter(num_ps={self.num_ps!r}, strategy={self.strategy!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AGNCustomGetter)
            and other.num_ps == self.num_ps
            and other.strategy == self.strategy
        )

    def __hash__(self) -> int:
        return hash((self.num_ps, self.strategy))

    def placement(self, params: Sequence[torch.Tensor], num_ps: int | None = None) -> list[int]:
        """The shard index of each parameter, in order.

        ``num_ps`` overrides an unset ``self.num_ps``; one of the two must be given.
        """
        n = self.num_ps if self.num_ps is not None else num_ps
        if n is None:
            raise ValueError(
                "AGNCustomGetter has no num_ps: give AGNCustomGetter(num_ps=...) or use it "
                "inside a cluster (distoptim.agn.spawn / Cluster.from_env)"
            )
        if self.strategy == "round_robin":
            return [i % n for i in range(len(params))]
        load = [0] * n
        out = []
        for p in params:
            shard = min(range(n), key=lambda s: (load[s], s))
            load[shard] += p.numel() * p.element_size()
            out.append(shard)
        return out
