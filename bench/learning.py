"""Does the default arithmetic scenario learn as well asynchronously as synchronously? (issue 30)

Runs ``python -m vime.scenario`` (the default scenario, its defaults) over a matrix: ``--max-staleness``
0, 1 and 2, with 1 and 3 rollout workers, for each of ``--seeds`` (5; ``--quick``: 2), one run after
another (``--parallel N`` runs N at once: on a small machine they slow each other down, and asynchronous
runs are timed, so their course changes with the load). Per run, from its ``metrics.jsonl``:

* ``reward_first10`` and ``reward_final20``: mean ``raw_reward`` of the first 10 and the last 20 steps;
* ``steps_to_0_9``: the first step at which the mean of the last 10 steps reaches 0.9 (null: never);
* ``entropy_final20``: mean entropy over the last 20 steps (near 0: the policy has collapsed);
* ``async_minus_sync``: ``reward_final20`` less that of the run with ``--max-staleness 0``, the same
  workers and the same seed;
* ``diff_mean`` / ``diff_max``: ``train_rollout_logprob_abs_diff`` on tokens the trained weights sampled
  (synchronous steps), and ``diff_stale_mean`` on older tokens (the policy's movement since they were
  sampled; asynchronous steps);
* ``staleness_mean`` and the run's wall time.

Prints a table and writes ``--json`` (rows and per-step curves of reward, entropy and the two gaps) and,
with ``--png``, reward and log-prob gap against step, one line per run (matplotlib). Arguments after
``--`` go to every run (``-- --stale-ratio proximal`` runs the algorithm as it was before issue 30).

``--controlled`` runs the same matrix without actors and without timing (``tests/test_learning.py``'s
``train_with_delay``: the real trainer engine, each step sampled by the weights of exactly ``--max-staleness``
versions before, as the pipeline runs when rollouts outrun the trainer; seeded, so a run is repeatable;
the number of workers does not apply). Its rows have the reward and entropy columns, and
``all_wrong_final20``: the share of groups whose responses were all wrong (advantage 0) over the last 20 steps.

Usage::

    python bench/learning.py --quick --json /tmp/learning.json
    python bench/learning.py --json bench/results/learning-cpu.json --png bench/results/learning-cpu.png
    python bench/learning.py --controlled --seeds 11 --staleness 0 2 --json /tmp/controlled.json -- stale_ratio=proximal

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent


def command_of(staleness: int, workers: int, seed: int, steps: int, out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "vime.scenario", "--max-staleness", str(staleness), "--rollout-workers",
            str(workers), "--steps", str(steps), "--seed", str(seed), "--out", str(out), *extra]


def steps_to(rewards: list[float], level: float, window: int = 10) -> int | None:
    """The first step whose trailing ``window``-step mean reward reaches ``level``; None if none does."""
    for step in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[step - window + 1:step + 1]) >= level:
            return step
    return None


def _mean(values: list[float | None]) -> float | None:
    kept = [value for value in values if value is not None]
    return round(statistics.fmean(kept), 6) if kept else None


def summarize(run_dir: Path) -> tuple[dict[str, Any], dict[str, list]]:
    """One row's figures and the run's curves, from RUN_DIR/metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [row["raw_reward"] for row in rows]
    diffs = [row.get("train_rollout_logprob_abs_diff") for row in rows]
    stale = [row.get("train_rollout_logprob_abs_diff_stale") for row in rows]
    figures = {
        "steps_done": len(rows),
        "reward_first10": _mean(rewards[:10]),
        "reward_final20": _mean(rewards[-20:]),
        "steps_to_0_9": steps_to(rewards, 0.9),
        "entropy_final20": _mean([row["entropy"] for row in rows[-20:]]),
        "diff_mean": _mean(diffs),
        "diff_max": max((value for value in diffs if value is not None), default=None),
        "diff_stale_mean": _mean(stale),
        "staleness_mean": _mean([row.get("staleness_mean") for row in rows]),
    }
    curves = {"raw_reward": rewards, "entropy": [row["entropy"] for row in rows],
              "step_time_s": [row["step_time_s"] for row in rows],
              "train_rollout_logprob_abs_diff": diffs, "train_rollout_logprob_abs_diff_stale": stale}
    return figures, curves


def run_one(staleness: int, workers: int, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out = root / f"k{staleness}-w{workers}-s{seed}"
    shutil.rmtree(out, ignore_errors=True)  # the scenario refuses a folder holding an earlier run
    command = command_of(staleness, workers, seed, args.steps, out, args.extra)
    started = time.monotonic()
    with open(root / f"{out.name}.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    row: dict[str, Any] = {"max_staleness": staleness, "rollout_workers": workers, "seed": seed,
                           "steps": args.steps, "exit_code": code, "wall_s": round(time.monotonic() - started, 1),
                           "command": " ".join(command[1:]).replace(str(out), "RUN_DIR")}
    if (out / "metrics.jsonl").exists():
        figures, curves = summarize(out)
        curves.pop("step_time_s")
        row.update(figures, curves=curves)
    print(f"  done: --max-staleness {staleness} --rollout-workers {workers} --seed {seed}: "
          f"final20 {row.get('reward_final20')} ({row['wall_s']} s)", flush=True)
    return row


def tabulate_one(run_dir: Path) -> dict[str, Any]:
    """A row for a run made before (by this script or by hand with the same flags), from its folder."""
    config = json.loads((run_dir / "config.json").read_text())
    row: dict[str, Any] = {"max_staleness": config["data"]["max_staleness"],
                           "rollout_workers": config["rollout"]["rollout_workers"], "seed": config["job"]["seed"],
                           "steps": config["job"]["steps"], "exit_code": None, "run_dir": str(run_dir)}
    figures, curves = summarize(run_dir)
    wall = sum(value for value in curves.pop("step_time_s"))
    row.update(figures, wall_s=round(wall, 1), curves=curves)
    return row


def controlled_one(staleness: int, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """A run of ``train_with_delay`` (``--controlled``); ``args.extra`` holds ``name=value`` settings."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_learning import train_with_delay

    settings = {name: _setting(value) for name, value in (flag.split("=", 1) for flag in args.extra)}
    started = time.monotonic()
    history = train_with_delay(root / f"controlled-k{staleness}-s{seed}", delay=staleness, steps=args.steps,
                               seed=seed, **settings)
    rewards = [row["raw_reward"] for row in history]
    row = {"max_staleness": staleness, "rollout_workers": None, "seed": seed, "steps": args.steps,
           "settings": settings, "wall_s": round(time.monotonic() - started, 1), "steps_done": len(history),
           "reward_first10": _mean(rewards[:10]), "reward_final20": _mean(rewards[-20:]),
           "steps_to_0_9": steps_to(rewards, 0.9),
           "entropy_final20": _mean([row["entropy"] for row in history[-20:]]),
           "all_wrong_final20": _mean([row["all_wrong_groups"] for row in history[-20:]]),
           "curves": {key: [row[key] for row in history] for key in ("raw_reward", "entropy", "all_wrong_groups")}}
    print(f"  done: controlled, staleness {staleness}, seed {seed}: final20 {row['reward_final20']} "
          f"({row['wall_s']} s)", flush=True)
    return row


def _setting(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def add_async_gaps(rows: list[dict[str, Any]]) -> None:
    sync = {(row["rollout_workers"], row["seed"]): row.get("reward_final20")
            for row in rows if row["max_staleness"] == 0}
    for row in rows:
        base = sync.get((row["rollout_workers"], row["seed"]))
        final = row.get("reward_final20")
        row["async_minus_sync"] = None if base is None or final is None else round(final - base, 6)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'staleness':>9} {'workers':>7} {'seed':>4} {'first10':>7} {'final20':>7} {'async-sync':>10} "
             f"{'to 0.9':>6} {'entropy20':>9} {'diff max':>9} {'stale diff':>10} {'wall s':>7}"
             + (f" {'allwrong20':>10}" if any("all_wrong_final20" in row for row in rows) else "")]

    def show(value: Any, digits: int = 3) -> str:
        if value is None:
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    for row in rows:
        lines.append(f"{row['max_staleness']:>9} {show(row['rollout_workers']):>7} {row['seed']:>4} "
                     f"{show(row.get('reward_first10')):>7} {show(row.get('reward_final20')):>7} "
                     f"{show(row.get('async_minus_sync')):>10} {show(row.get('steps_to_0_9')):>6} "
                     f"{show(row.get('entropy_final20')):>9} {show(row.get('diff_max'), 7):>9} "
                     f"{show(row.get('diff_stale_mean')):>10} {row['wall_s']:>7}"
                     + (f" {show(row['all_wrong_final20']):>10}" if "all_wrong_final20" in row else ""))
    return "\n".join(lines)


def matrix_label(row: dict[str, Any]) -> str:
    """A matrix run's name in the plot's legend: its staleness bound, workers, seed and settings."""
    label = f"k={row['max_staleness']} w={row['rollout_workers']} seed={row['seed']}"
    if "run_dir" in row:
        label += f" ({Path(row['run_dir']).name})"
    if row.get("settings"):
        label += " " + " ".join(f"{name}={value}" for name, value in row["settings"].items())
    return label


def plot(rows: list[dict[str, Any]], path: Path, label: Callable[[dict[str, Any]], str] = matrix_label) -> None:
    """Reward and train-rollout log-prob gap against step, one line per row (``label`` names it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward_axis, gap_axis) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    for row in rows:
        curves = row.get("curves")
        if not curves:
            continue
        name = label(row)
        reward_axis.plot(curves["raw_reward"], label=name, linewidth=0.8)
        if "train_rollout_logprob_abs_diff" not in curves:  # a --controlled run: no engine on the other side
            continue
        # the gap on the step's tokens: fresh ones where there are (synchronous), else stale ones
        gaps = [fresh if fresh is not None else stale for fresh, stale in
                zip(curves["train_rollout_logprob_abs_diff"], curves["train_rollout_logprob_abs_diff_stale"])]
        gap_axis.plot([float("nan") if gap is None else gap for gap in gaps], label=name, linewidth=0.8)
    reward_axis.set_ylabel("raw_reward")
    reward_axis.legend(fontsize=6, ncol=3)
    gap_axis.set_yscale("log")
    gap_axis.set_ylabel("train-rollout |log-prob gap|\n(fresh tokens; stale where none)")
    gap_axis.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds instead of 5")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 1 2 3 4 5 (--quick: 1 2)")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=1, help="runs at once")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--controlled", action="store_true",
                        help="without actors or timing (see above); flags after -- are name=value settings")
    parser.add_argument("--tabulate", type=Path, nargs="+", default=None,
                        help="run nothing: the rows of these run folders (made with this script's flags)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then flags for every run")
    args = parser.parse_args()
    args.extra = [flag for flag in args.extra if flag != "--"]
    seeds = args.seeds or ([1, 2] if args.quick else [1, 2, 3, 4, 5])
    matrix = [(staleness, workers, seed) for seed in seeds for staleness in args.staleness for workers in args.workers]
    root = args.out or Path(tempfile.mkdtemp(prefix="learning-"))
    if not args.tabulate:
        root.mkdir(parents=True, exist_ok=True)
        count = len({(staleness, seed) for staleness, _, seed in matrix}) if args.controlled else len(matrix)
        print(f"{count} runs of {args.steps} steps under {root}", flush=True)
    started = time.monotonic()
    if args.tabulate:
        rows = [tabulate_one(folder) for folder in args.tabulate]
    elif args.controlled:
        cells = sorted({(staleness, seed) for staleness, _, seed in matrix})
        with ProcessPoolExecutor(max_workers=args.parallel) as pool:  # each seeds torch's global generator
            rows = list(pool.map(controlled_one, *zip(*cells), itertools.repeat(args), itertools.repeat(root)))
    else:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            rows = list(pool.map(lambda cell: run_one(*cell, args, root), matrix))
    add_async_gaps(rows)
    rows.sort(key=lambda row: (row["max_staleness"], row["rollout_workers"], row["seed"]))
    print(table(rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "parallel": args.parallel,
              "extra_flags": args.extra, "wall_s": round(time.monotonic() - started, 1),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
