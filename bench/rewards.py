r"""Reward throughput: rewards/s of the reward workers, with and without pathological answers.

Scores ``--samples`` GSM8K-style answers (``\boxed{N}``, half of them right) with a built-in reward
(``--reward``, default ``math``: math-verify) through ``vime.reward_workers`` as the reward actor does (every
sample of a group of ``--group`` at once, and ``GROUPS_IN_FLIGHT`` groups at once; beside it one group at a
time, as the actor scored before), for each ``--workers`` count and each share of pathological
answers in ``--bad-share``: a power tower of nines (``\boxed{9^{9^{9^{9}}}}``) that sympy tries to evaluate.
Beside them, the old way (the function called in the actor's own thread, no limit) on good answers only,
as the cost of the process hop. Per case, the median over ``--repeats`` runs of rewards/s, and the timeouts
counted.

Usage::

    python bench/rewards.py --samples 400 --workers 2 8 --bad-share 0 0.01 --timeout 10 \
        --json bench/results/rewards-cpu.json

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from vime import rewards
from vime.actors.reward import GROUPS_IN_FLIGHT
from vime.reward_workers import RewardWorkers

BAD = r"The answer is \boxed{9^{9^{9^{9}}}}"


def answers(count: int, bad_share: float, seed: int) -> list[tuple[str, str]]:
    """(response, label) pairs: right or wrong boxed numbers, a ``bad_share`` of them pathological."""
    draw = random.Random(seed)
    pairs = []
    for index in range(count):
        label = str(draw.randrange(1, 10_000))
        answer = label if index % 2 else str(int(label) + 1)
        pairs.append((f"So the total is {answer}.\n\nThe answer is \\boxed{{{answer}}}", label))
    for index in draw.sample(range(count), round(count * bad_share)):
        pairs[index] = (BAD, pairs[index][1])
    return pairs


async def pooled(reward: str, pairs: list[tuple[str, str]], workers: int, timeout: float,
                 group: int, in_flight: int) -> dict[str, float]:
    """Score ``pairs`` in groups of ``group``, ``in_flight`` groups at once, as the reward actor does."""
    pool = RewardWorkers(reward, "", workers, timeout)
    pool.start()
    slots = trio.Semaphore(in_flight)

    async def score_group(first: int) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for response, label in pairs[first:first + group]:
                    nursery.start_soon(pool.score, response, label, {})
        finally:
            slots.release()

    try:
        async with trio.open_nursery() as nursery:  # every process is up: time the scoring alone
            for _ in range(workers):
                nursery.start_soon(pool.score, "\\boxed{1}", "1", {})
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for first in range(0, len(pairs), group):
                await slots.acquire()
                nursery.start_soon(score_group, first)
        seconds = time.perf_counter() - started
    finally:
        pool.close()
    return {"rewards_per_s": len(pairs) / seconds, "timeouts": float(pool.timeouts)}


def inline(reward: str, pairs: list[tuple[str, str]]) -> dict[str, float]:
    fn = rewards.resolve(reward)
    fn("\\boxed{1}", "1")
    started = time.perf_counter()
    for response, label in pairs:
        fn(response, label)
    return {"rewards_per_s": len(pairs) / (time.perf_counter() - started), "timeouts": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reward", default="math")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--group", type=int, default=16, help="samples scored at once (a group)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--bad-share", type=float, nargs="+", default=[0.0, 0.01])
    parser.add_argument("--timeout", type=float, default=10.0, help="--reward-timeout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    cases: list[dict[str, Any]] = []
    good = answers(args.samples, 0.0, seed=0)
    runs = [inline(args.reward, good) for _ in range(args.repeats)]
    cases.append({"case": "inline, no limit (before)", "workers": 0, "bad_share": 0.0, "runs": runs})
    for workers, share, in_flight in itertools.product(args.workers, args.bad_share, (1, GROUPS_IN_FLIGHT)):
        pairs = answers(args.samples, share, seed=0)
        runs = [trio.run(pooled, args.reward, pairs, workers, args.timeout, args.group, in_flight)
                for _ in range(args.repeats)]
        cases.append({"case": f"{workers} workers, {in_flight} group(s) at once", "workers": workers,
                      "groups_in_flight": in_flight, "bad_share": share, "runs": runs})
    print(f"{'case':34} {'bad share':>9} {'rewards/s':>10} {'timeouts':>9}")
    for case in cases:
        case["rewards_per_s"] = statistics.median(run["rewards_per_s"] for run in case["runs"])
        case["timeouts"] = statistics.median(run["timeouts"] for run in case["runs"])
        print(f"{case['case']:34} {case['bad_share']:>9.2%} {case['rewards_per_s']:>10.1f} {case['timeouts']:>9.0f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    document = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
                "machine": f"{platform.node()}: {os.cpu_count()} CPUs",
                "command": vars(args) | {"json": str(args.json)}, "cases": cases}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
