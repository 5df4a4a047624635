"""Error feedback: the one mechanism every lossy wire format shares, on or off.

Error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "EF-SGD") adds what an
encoding dropped to the next buffer encoded at the same place. With ``Q`` a codec's encoding
and ``D`` its decoding, a rank keeps one residual ``e`` per place it encodes (zero at first)::

    x'  = x + e              what is encoded instead of x
    e  ← x' - D(Q(x'))       what this encoding dropped, sent next time

so over ``K`` encodings ``Σ D(Q(x'_k)) = Σ x_k - e_K``: what travelled sums to what was meant
minus only the *current* residual, and the error stays bounded instead of accumulating. This
holds for any codec whose ``D(Q(·))`` error is bounded (casts, absmax integers, top-k: what a
top-k leaves out stays in ``e`` until it is large enough to be picked). Residuals are per rank
(every rank encodes different values) and live in the buffers of the averaging scheme that
encodes (:mod:`distoptim.comm.averaging`), which names them for checkpoints.

:class:`ErrorFeedback` and :class:`NoFeedback` are the two strategies; :func:`feedback_for`
picks one from a bool.
"""

from __future__ import annotations

import abc

import torch

from distoptim.comm.codecs import Codec, LayoutT

__all__ = ["ErrorFeedback", "Feedback", "NoFeedback", "feedback_for"]


class Feedback(abc.ABC):
    """How values reach a codec: with or without a residual."""

    keeps_residuals: bool

    @abc.abstractmethod
    def combine(self, values: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """The buffer to encode, ``into`` (at least ``values.numel()`` values, 1-D).

        With error feedback ``into`` is the residual ``e`` and becomes ``x + e`` over its first
        ``values.numel()`` values; without it ``into`` is a scratch buffer (zero past them) that
        receives a copy of ``values``, or ``values`` itself (then nothing is copied).
        """

    @abc.abstractmethod
    def encode(
        self, codec: Codec[LayoutT], x: torch.Tensor, out: torch.Tensor, layout: LayoutT
    ) -> None:
        """Write ``Q(x)`` into ``out``; with error feedback ``x`` then holds ``x - D(Q(x))``."""


class ErrorFeedback(Feedback):
    """``x' = x + e`` is encoded and ``e ← x' - D(Q(x'))`` is kept (see module)."""

    keeps_residuals = True

    def combine(self, values: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        into[: values.numel()].add_(values)
        return into

    def encode(
        self, codec: Codec[LayoutT], x: torch.Tensor, out: torch.Tensor, layout: LayoutT
    ) -> None:
        codec.encode(x, out, layout)
        codec.subtract_decoded(x, out, layout)


class NoFeedback(Feedback):
    """``x`` is encoded as it is; what ``Q`` drops is lost."""

    keeps_residuals = False

    def combine(self, values: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        if into is not values:
            into[: values.numel()].copy_(values)
        return into

    def encode(
        self, codec: Codec[LayoutT], x: torch.Tensor, out: torch.Tensor, layout: LayoutT
    ) -> None:
        codec.encode(x, out, layout)


def feedback_for(error_feedback: bool) -> Feedback:
    """:class:`ErrorFeedback` for ``True``, :class:`NoFeedback` for ``False``."""
    return ErrorFeedback() if error_feedback else NoFeedback()
