"""The one-time warnings every rank gives when some rank's round words marked a habit.

Owns :class:`Notices`. A round's verdict (:class:`~distoptim.comm.guard.Verdict`) names the
ranks whose words carried an informative mark; every rank of the group reads the same verdict,
so every rank warns alike -- once per optimizer and mark -- also the ranks that did nothing:

* **local edit** -- ``.grad`` changed between the end of ``backward()`` and the round (clipping,
  ``GradScaler.unscale_``, zeroing, assigning). The edit acted on that replica's *local*
  gradient, before the reduction: under DDP the same line would have edited the averaged one.
  The warning says how to do that here (``synchronize()``, or ``max_grad_norm``).
* **foreign** -- ``.grad`` was rewritten during ``backward()``, after autograd accumulated it:
  a ``DistributedDataParallel`` reducer averaged it already, and this optimizer reduces it a
  second time (the same update, twice the communication).

Each warning points at the user's line: the first frame outside distoptim and torch (their
``opt.step()``, or their ``scaler.step(opt)``).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

import distoptim
from distoptim.comm.guard import Verdict

__all__ = ["Notices"]

_INTERNAL = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (distoptim, torch) if m.__file__ is not None
)


def _warn_at_user(message: str) -> None:
    """``UserWarning`` pointing at the first frame outside distoptim and torch."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    warnings.warn(message, UserWarning, stacklevel=level)


class Notices:
    """Which one-time warnings this optimizer has given (each at most once)."""

    def __init__(self) -> None:
        self.warned_local_edit = False
        self.warned_foreign = False

    def inform(self, verdict: Verdict) -> None:
        """Warn about the marks ``verdict`` names, each the first time it names one."""
        if verdict.local_edits and not self.warned_local_edit:
            self.warned_local_edit = True
            _warn_at_user(
                f"CrossShardOptimizer: .grad was changed after backward() on rank(s) "
                f"{list(verdict.local_edits)} (clipping, unscaling, zeroing or assigning "
                "gradients before step()). Such an edit acts on each replica's LOCAL gradient, "
                "before the reduction -- not on the averaged gradient as under DDP (and a "
                "GradScaler's inf check is then per replica). To edit the averaged gradient, "
                "call opt.synchronize() after backward() and edit .grad before opt.step() "
                "(which then does not reduce again), or pass max_grad_norm= to clip it by its "
                "global norm. This warning is shown once."
            )
        if verdict.foreign and not self.warned_foreign:
            self.warned_foreign = True
            _warn_at_user(
                f"CrossShardOptimizer: on rank(s) {list(verdict.foreign)} .grad was rewritten "
                "during backward(), after autograd had accumulated it: the model looks wrapped "
                "in torch.nn.parallel.DistributedDataParallel, whose reducer already averages "
                "every gradient in backward. CrossShardOptimizer then reduces it a second time "
                "(the same update, twice the communication). Use one or the other: give "
                "CrossShardOptimizer the parameters of the plain module (ddp_model.module), or "
                "keep DDP with a plain torch optimizer; or run backward() under "
                "ddp_model.no_sync(). (Another hook that rewrites .grad in backward shows the "
                "same way.) This warning is shown once."
            )
