"""The reliability diagram `semif-serve calibrate --plot` writes: accuracy per confidence bin
before and after the fitted temperature, drawn with matplotlib (the `plot` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semif_serve.domain.numerics import ConfidenceBin

BAR = "#466ebe"
DIAGONAL = "#c83c3c"
INSTALL_HINT = (
    "the reliability diagram needs matplotlib: uv sync --extra plot (or pip install 'semif-serve[plot]')"
)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


@dataclass(frozen=True)
class Panel:
    """One diagram: a title and its confidence bins (empty bins are left out)."""

    title: str
    bins: Sequence[ConfidenceBin]


def reliability_figure(heading: str, *panels: Panel) -> Any:
    """A matplotlib figure with one axes per panel: a bar per non-empty bin at its accuracy, and
    the diagonal a calibrated model would follow."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None
    figure = Figure(figsize=(4.2 * len(panels), 4.6), layout="constrained")
    figure.suptitle(heading)
    for axes, panel in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        filled = [b for b in panel.bins if b.count]
        axes.bar(
            [b.lower for b in filled],
            [b.accuracy for b in filled],
            width=[b.upper - b.lower for b in filled],
            align="edge",
            color=BAR,
            edgecolor="white",
            label="accuracy",
        )
        axes.plot([0, 1], [0, 1], color=DIAGONAL, linestyle="--", label="calibrated")
        axes.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy", title=panel.title)
        axes.legend(loc="upper left")
    return figure


def write_reliability_png(path: Path, heading: str, *panels: Panel) -> None:
    """Write the diagram as a PNG whose `Title` text chunk holds the heading and panel titles."""
    title = " | ".join([heading, *(p.title for p in panels)])
    reliability_figure(heading, *panels).savefig(path, format="png", dpi=100, metadata={"Title": title})
