"""Soak (issue 32, item 4): a long asynchronous run under kill -9s of random actors, audited to the group.

Runs the default scenario (``python -m vime.scenario``) for ``--steps`` steps at ``--max-staleness 2`` with 3
rollout workers, killing an actor of a random kind -- router, reward, trainer, buffer, a rollout worker or the
driver -- every ``--every`` steps on average; a worker is restarted by the driver, anything else is continued
with the ``--resume`` the scenario prints (``vime.devtools.soak`` says how, and what the audit checks). With
``--baseline`` the same run without kills runs beside it (both meet the same load), for the reward it reaches.

Prints a table (kills and recoveries by kind, the groups' accounting, the audit's findings, the final reward
of both runs) and writes ``--json``. Arguments after ``--`` go to both runs.

Usage::

    python bench/soak.py --steps 2000 --every 100 --baseline --json bench/results/soak-cpu.json
    python bench/soak.py --steps 60 --every 10 --json /tmp/soak.json -- --rollout-batch-size 16

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from vime.devtools.soak import KINDS, Plan, audit, soak

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100, help="steps between kills, on average")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--seed", type=int, default=1, help="the run's seed and the kill plan's")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--baseline", action="store_true", help="the same run without kills, beside it")
    parser.add_argument("--out", type=Path, help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("--json", type=Path)
    args, extra = parser.parse_known_args()
    extra = [token for token in extra if token != "--"]
    flags = ["--steps", str(args.steps), "--save-every", str(args.save_every), "--max-staleness", "2",
             "--rollout-workers", "3", "--seed", str(args.seed), *extra]
    out = args.out or Path(tempfile.mkdtemp(prefix="vime-soak-"))
    result: dict[str, Any] = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
                              "commit": _commit(), "machine": _machine(), "flags": flags}
    baseline = threading.Thread(target=lambda: result.update(baseline=_baseline(out / "baseline", flags)))
    if args.baseline:
        baseline.start()
    plan = Plan(every=args.every, kinds=tuple(args.kinds), seed=args.seed)
    (out / "soak").mkdir(parents=True, exist_ok=True)
    result["soak"] = soak(out / "soak", flags, plan, say=lambda line: print(line, flush=True))
    if args.baseline:
        baseline.join()
    _print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)


def _baseline(out: Path, flags: list[str]) -> dict[str, Any]:
    """The run without kills: how far its reward gets, and its own audit."""
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with open(out / "launch.log", "wb") as log:
        subprocess.run([sys.executable, "-m", "vime.scenario", "--out", str(out / "run"), *flags,
                        "--record", "router"], stdout=log, stderr=subprocess.STDOUT, check=True)
    return {"seconds": round(time.monotonic() - began, 1), **audit(out / "run")}


def _print_table(result: dict[str, Any]) -> None:
    soaked = result["soak"]
    by_kind: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for kill in soaked["kills"]:
        by_kind[kill["kind"]].append(kill)
    print(f"\n{'kind':<10}{'kills':>7}{'recovered':>11}{'median recovery s':>19}")
    for kind in KINDS:
        kills = by_kind.get(kind, [])
        back = "rejoined_s" if kind == "rollout" else "recovery_s"  # a worker is back once it has joined again
        times = [kill[back] for kill in kills if kill.get(back) is not None]
        median = f"{statistics.median(times):.1f}" if times else "-"
        print(f"{kind:<10}{len(kills):>7}{sum(1 for kill in kills if kill.get(back) is not None):>11}{median:>19}")
    groups = soaked["groups"]
    print(f"\nlaunches {len(soaked['launches'])}, {soaked['steps']} steps in {soaked['seconds']:.0f} s")
    print("groups: " + ", ".join(f"{key} {value}" for key, value in groups.items()))
    print(f"router saw {soaked['groups_seen_by_router']} group ids; trained ids {soaked['trained_ids']}")
    print(f"findings: {soaked['findings'] or 'none'}")
    line = f"final reward (mean of the last 20 steps): soak {soaked['reward_final20']:.3f}"
    if "baseline" in result:
        line += f", without kills {result['baseline']['reward_final20']:.3f}"
    print(line)


def _commit() -> str:
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def _machine() -> str:
    return f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
