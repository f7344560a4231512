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
  training, weight sync.

Usage::

    python bench/pipeline.py --runs grpo:0 ppo:0 grpo:1 --steps 300 --out runs/bench --json bench/pipeline.json
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

PARTS = ("step_time_s", "time_wait_s", "time_generate_s", "time_reward_s", "time_train_s", "time_weight_sync_s")


def run(algo: str, seed: int, steps: int, out: Path) -> Path:
    run_dir = out / f"{algo}-s{seed}"
    subprocess.run([sys.executable, "-m", "vime.scenario", "arithmetic", "--algo", algo, "--seed", str(seed),
                    "--steps", str(steps), "--out", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
    return run_dir


def figures(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "run": run_dir.name,
        "algo": summary["algo"],
        "seed": summary["seed"],
        "steps": summary["steps"],
        "step_to_0.9": summary["first_step_reward_0.9"],
        "seconds_to_0.9": summary["seconds_to_reward_0.9"],
        "final_reward": summary["final_raw_reward"],
        "max_logprob_diff": summary["max_train_rollout_logprob_abs_diff"],
        "startup_s": summary["startup_s"],
        "total_s": summary["total_s"],
        **{f"median_{part}": statistics.median(row[part] for row in rows) for part in PARTS},
    }


def table(results: list[dict]) -> str:
    head = (f"{'run':<10} {'to 0.9':>7} {'s to 0.9':>8} {'final':>6} {'max |dlogp|':>11} {'total s':>7} "
            f"{'step':>6} {'wait':>6} {'gen':>6} {'reward':>6} {'train':>6} {'sync':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        to = "-" if r["step_to_0.9"] is None else str(r["step_to_0.9"])
        seconds = "-" if r["seconds_to_0.9"] is None else f"{r['seconds_to_0.9']:.0f}"
        parts = " ".join(f"{r['median_' + p]:6.3f}" for p in PARTS)
        lines.append(f"{r['run']:<10} {to:>7} {seconds:>8} {r['final_reward']:6.3f} {r['max_logprob_diff']:11.1e} "
                     f"{r['total_s']:7.0f} {parts}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", default=[], metavar="ALGO:SEED", help="e.g. grpo:0 ppo:0")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--from", dest="existing", nargs="*", type=Path, default=[], help="summarise these run folders")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    folders = list(args.existing)
    for spec in args.runs:
        algo, _, seed = spec.partition(":")
        folders.append(run(algo, int(seed or 0), args.steps, args.out))
    results = [figures(folder) for folder in folders]
    print("median seconds per step; 'to 0.9': first step whose 10-step trailing mean reward >= 0.9")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
