"""Pipeline benchmark: how fast the default scenario learns, and where a step's time goes.

Runs ``python -m vime.scenario arithmetic`` once per algorithm and seed, one
after another (each run alone on the machine), or reads run folders that
already exist, and prints one row per run:

* the first step at which the reward's 10-step trailing mean reaches 0.9,
  and the wall time to it, actor start-up included;
* the final reward (trailing mean of the last 10 steps) and the largest
  ``train_rollout_logprob_abs_diff`` of the run;
* the median over steps of the step time and its parts: waiting for the
  batch (``time_wait_s``, which contains generation, reward and the messages
  between the actors), generation (slowest group), reward (all groups),
  training, weight sync;
* throughput and asynchrony, over the steps after the first: samples per
  second, the trainer's idle fraction (time waiting for batches over step
  time), the staleness histogram (share of trained samples 0, 1, 2 ...
  versions old), and the ratio of samples/s to the first run's.

Usage::

    python bench/pipeline.py --runs grpo:0 ppo:0 grpo:1 --steps 300 --out runs/bench --json bench/pipeline.json
    python bench/pipeline.py --runs grpo:0 --max-staleness 0 1 2 4 --rollout-workers 3 --steps 100
    python bench/pipeline.py --runs grpo:0 --max-staleness 0 1 --tag t1 --train-threads 1  # others: to the scenario
    python bench/pipeline.py --from runs/bench/grpo-s0 runs/bench/ppo-s0

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from vime.metrics import MetricsFollower, trained_ages

PARTS = ("step_time_s", "time_wait_s", "time_generate_s", "time_reward_s", "time_train_s", "time_weight_sync_s")


def run(algo: str, seed: int, steps: int, out: Path, staleness: int | None, workers: int | None,
        extra: list[str], tag: str) -> Path:
    name = f"{algo}-s{seed}" + ("" if staleness is None else f"-k{staleness}") + (f"-{tag}" if tag else "")
    run_dir = out / name
    command = [sys.executable, "-m", "vime.scenario", "arithmetic", "--algo", algo, "--seed", str(seed),
               "--steps", str(steps), "--out", str(run_dir), *extra]
    if staleness is not None:
        command += ["--max-staleness", str(staleness)]
    if workers is not None:
        command += ["--rollout-workers", str(workers)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def figures(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    rows = MetricsFollower(run_dir).new_rows()
    steady = rows[1:] or rows  # the first step waits for the actors to warm up
    ages = trained_ages(steady)
    total = sum(ages.values()) or 1.0
    return {
        "run": run_dir.name,
        "algo": summary["algo"],
        "seed": summary["seed"],
        "steps": summary["steps"],
        "step_to_0.9": summary["first_step_reward_0.9"],
        "seconds_to_0.9": summary["seconds_to_reward_0.9"],
        "raw_reward_last10_mean": summary["raw_reward_last10_mean"],
        "max_logprob_diff": summary["max_train_rollout_logprob_abs_diff"],
        "startup_s": summary["startup_s"],
        "total_s": summary["total_s"],
        "max_staleness": config["data"]["max_staleness"],
        "rollout_workers": config["rollout"]["rollout_workers"],
        "samples_per_s": sum(row["samples"] for row in steady) / sum(row["step_time_s"] for row in steady),
        "trainer_idle": sum(row["time_wait_s"] for row in steady) / sum(row["step_time_s"] for row in steady),
        "staleness_share": {age: ages[age] / total for age in sorted(ages)},
        **{f"median_{part}": statistics.median(row[part] for row in rows) for part in PARTS},
    }


def table(results: list[dict]) -> str:
    head = (f"{'run':<10} {'to 0.9':>7} {'s to 0.9':>8} {'last10':>6} {'max |dlogp|':>11} {'total s':>7} "
            f"{'step':>6} {'wait':>6} {'gen':>6} {'reward':>6} {'train':>6} {'sync':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        to = "-" if r["step_to_0.9"] is None else str(r["step_to_0.9"])
        seconds = "-" if r["seconds_to_0.9"] is None else f"{r['seconds_to_0.9']:.0f}"
        parts = " ".join(f"{r['median_' + p]:6.3f}" for p in PARTS)
        gap = "-" if r["max_logprob_diff"] is None else f"{r['max_logprob_diff']:.1e}"
        lines.append(f"{r['run']:<10} {to:>7} {seconds:>8} {r['raw_reward_last10_mean']:6.3f} {gap:>11} "
                     f"{r['total_s']:7.0f} {parts}")
    head = (f"{'run':<18} {'k':>2} {'workers':>7} {'samples/s':>9} {'vs first':>8} {'idle':>5}"
            "  staleness share (age:share)")
    lines += ["", head, "-" * len(head)]
    for r in results:
        shares = " ".join(f"{age}:{share:.2f}" for age, share in r["staleness_share"].items())
        lines.append(f"{r['run']:<18} {r['max_staleness']:>2} {r['rollout_workers']:>7} {r['samples_per_s']:9.0f} "
                     f"{r['samples_per_s'] / results[0]['samples_per_s']:7.2f}x {r['trainer_idle']:5.2f}  {shares}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", default=[], metavar="ALGO:SEED", help="e.g. grpo:0 ppo:0")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-staleness", nargs="*", type=int, default=[None], metavar="K",
                        help="run each ALGO:SEED once per bound (default: the scenario's)")
    parser.add_argument("--rollout-workers", type=int, default=None)
    parser.add_argument("--tag", default="", help="suffix of the run folders' names")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--from", dest="existing", nargs="*", type=Path, default=[], help="summarise these run folders")
    parser.add_argument("--json", type=Path, default=None)
    args, extra = parser.parse_known_args()
    folders = list(args.existing)
    for spec in args.runs:
        algo, _, seed = spec.partition(":")
        for staleness in args.max_staleness:
            folders.append(run(algo, int(seed or 0), args.steps, args.out, staleness, args.rollout_workers, extra,
                               args.tag))
    results = [figures(folder) for folder in folders]
    print("median seconds per step; 'to 0.9': first step whose 10-step trailing mean reward >= 0.9;")
    print("samples/s, idle (trainer waiting / step time) and staleness over the steps after the first")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
