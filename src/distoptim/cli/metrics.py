"""What a comparison judges its runs by: validation accuracy, or validation loss.

Owns: the :class:`Metric` of each kind of run -- the MLP's (classification: digits, mnist5k, an
.npz) are judged by validation accuracy, higher is better; the GPT's (the Shakespeare language
model) by validation loss in nats per character, lower is better -- with what follows from the
direction: the default target of "time / bytes to target", when a run has reached it, which of
two runs is the better one, and how temporal efficiency compares two curves.

Targets. The default target is ``share x`` the final value of a reference run (sync with the
same workers; without one, the grid's best run): accuracy ``0.95 x`` the reference's final
validation accuracy (a run has reached it at its first evaluation ``>=`` it), loss ``1.04 x``
the reference's final validation loss (reached at the first evaluation ``<=`` it). For the
language model 1.04 is the share that separates the algorithms on the default run: within 4 %
of sync's final loss is where the communication-efficient ones differ by how much they lag
(docs/cli.md, "The language model in the comparison"). ``--target-acc`` / ``--target-loss``
give a fixed value instead.

Temporal efficiency (Hermans et al., *Accumulated Gradient Normalization*, 2017) compares the
area under two curves of the metric against wall time over the same window: for accuracy
``E = area(run) / area(reference)``; for loss, where lower is better, the inverse,
``E = area(reference) / area(run)``. Either way ``E > 1`` means the run was ahead of the
reference on average over the window.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACCURACY", "LOSS", "Metric", "metric_of"]


@dataclass(frozen=True)
class Metric:
    """How runs are judged: ``key`` names the value in a record and its history points
    (``val_acc`` / ``val_loss``); ``higher_is_better`` its direction; ``default_share`` the
    default target as a share of the reference's final value; ``option`` the command-line
    option that sets a fixed target; ``label`` its name in the table and the plots."""

    name: str
    key: str
    higher_is_better: bool
    default_share: float
    option: str
    label: str

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` is at the target or better."""
        return value >= target if self.higher_is_better else value <= target

    def rank(self, value: float | None) -> float:
        """A number that is larger for a better ``value`` (None: the worst)."""
        if value is None:
            return float("-inf")
        return value if self.higher_is_better else -value

    def efficiency(self, area_run: float, area_reference: float) -> float | None:
        """Temporal efficiency from the two areas (module doc); None when undefined."""
        num, den = (
            (area_run, area_reference) if self.higher_is_better else (area_reference, area_run)
        )
        return None if den <= 0 else num / den

    def format(self, value: float | None) -> str:
        """``85.5%`` for accuracy, ``2.134`` (nats) for loss; ``-`` for None."""
        if value is None:
            return "-"
        return f"{100 * value:.1f}%" if self.name == "accuracy" else f"{value:.3f}"


ACCURACY = Metric("accuracy", "val_acc", True, 0.95, "--target-acc", "val acc")
LOSS = Metric("loss", "val_loss", False, 1.04, "--target-loss", "val loss")


def metric_of(model: str) -> Metric:
    """The metric runs of ``model`` (``RunConfig.model``) are judged by."""
    return LOSS if model == "gpt" else ACCURACY
