"""Actor start-up: how long each actor of a run takes from its process start to its Register reaching the driver.

Issue 36 item 3 (a fast start). Each round opens a job and spawns the default scenario's actors one after
another, as ``vime.pipeline`` does (router, reward, trainer, buffer, one rollout worker; each with the run's own
settings), timing each ``Cluster.spawn`` (process start, imports, the role's construction, registration). An
actor's ``on_start`` (the trainer's model build, a rollout engine's) runs after it registers and is not counted:
that is the other half of the start-up, which the e2e bench's breakdown covers. Medians over ``--rounds``.

Usage::

    python bench/startup.py --rounds 3 --json bench/results/startup-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from vime.cluster import Cluster
from vime.config import ActorStart
from vime.scenarios import arithmetic

REPO = Path(__file__).resolve().parent.parent
ROLES = ("router", "reward", "trainer", "buffer", "rollout")


async def one_round(folder: Path) -> dict[str, float]:
    """Seconds from spawn to registered for each role, and for all of them in series (``all``)."""
    config = arithmetic.prepare(folder, arithmetic.defaults())
    document = config.to_dict()
    started = ActorStart(config).to_dict()
    seconds: dict[str, float] = {}
    async with Cluster.open(folder, job_config=document) as job:
        for role in ROLES:
            began = time.perf_counter()
            await job.spawn(role, role, document if role in ("reward", "rollout") else started, timeout=300)
            seconds[role] = time.perf_counter() - began
    seconds["all"] = sum(seconds[role] for role in ROLES)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="vime-startup-") as folder:
            rounds.append(trio.run(one_round, Path(folder)))
    rows = {what: {"median_s": statistics.median(r[what] for r in rounds), "runs_s": [r[what] for r in rounds]}
            for what in (*ROLES, "all")}
    print(f"start to registered, {args.rounds} rounds (medians)")
    print(f"{'actor':<10} {'seconds':>8}")
    for what, row in rows.items():
        print(f"{what:<10} {row['median_s']:>8.2f}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        load = os.getloadavg()[0]
        document = {"date": datetime.date.today().isoformat(), "commit": commit,
                    "command": " ".join(["python", "bench/startup.py", *sys.argv[1:]]),
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f} at the end",
                    "python": platform.python_version(), "rows": rows}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
