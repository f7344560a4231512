"""RUN_DIR/report.png: reward, log-prob difference and step time against step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PANELS = [("raw_reward", "raw reward"), ("train_rollout_logprob_abs_diff", "|logp train - logp rollout|"),
          ("step_time_s", "step time (s)")]


def write_report(run_dir: str | Path, rows: list[dict[str, Any]], title: str = "") -> Path:
    """Draw the three panels from the metrics rows and save them as RUN_DIR/report.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6), constrained_layout=True)
    steps = [row["step"] for row in rows]
    for axis, (key, label) in zip(axes, PANELS):
        axis.plot(steps, [row.get(key) for row in rows], linewidth=1.2)
        axis.set_xlabel("step")
        axis.set_title(label)
        axis.grid(alpha=0.3)
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if title:
        figure.suptitle(title)
    path = Path(run_dir) / "report.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
