"""RUN_DIR/report.png: reward, log-prob difference and step time against step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Each panel: its title and the curves it draws (metric key, legend label; a lone curve has no legend).
PANELS = [("raw reward", [("raw_reward", "")]),
          ("|logp train - logp rollout|", [("train_rollout_logprob_abs_diff", "same version"),
                                           ("train_rollout_logprob_abs_diff_stale", "older versions")]),
          ("step time (s)", [("step_time_s", "")])]


def write_report(run_dir: str | Path, rows: list[dict[str, Any]], title: str = "") -> Path:
    """Draw the three panels from the metrics rows and save them as RUN_DIR/report.png."""
    import matplotlib.pyplot as plt

    figure = draw(rows, title)
    path = Path(run_dir) / "report.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def draw(rows: list[dict[str, Any]], title: str = "") -> Any:
    """The report's figure: one panel per entry of PANELS, against the step, under ``title``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6), constrained_layout=True)
    steps = [row["step"] for row in rows]
    for axis, (heading, curves) in zip(axes, PANELS):
        drawn = [(key, label) for key, label in curves if any(row.get(key) is not None for row in rows)]
        for key, label in drawn:
            axis.plot(steps, [row.get(key) for row in rows], linewidth=1.2, label=label or None)
        if len(drawn) > 1:
            axis.legend(fontsize=8)
        axis.set_xlabel("step")
        axis.set_title(heading)
        axis.grid(alpha=0.3)
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if title:
        figure.suptitle(title)
    return figure
