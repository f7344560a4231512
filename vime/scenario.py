"""``python -m vime.scenario [NAME]``: run a named scenario (the default when NAME is omitted).

Scenarios live in ``vime.scenarios``, one module each, listed with ``--list``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import trio

from vime.logs import configure

SCENARIOS = {"selfcheck": "vime.scenarios.selfcheck"}
DEFAULT = "selfcheck"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime.scenario", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", default=DEFAULT, help=f"scenario name (default: {DEFAULT})")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: runs/NAME-TIMESTAMP)")
    parser.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    if args.list:
        for name, module in SCENARIOS.items():
            print(f"{name:<12} {importlib.import_module(module).DESCRIPTION}")
        return 0
    if args.name not in SCENARIOS:
        parser.error(f"unknown scenario {args.name!r}; --list shows the scenarios")
    configure(args.log_level)
    scenario = importlib.import_module(SCENARIOS[args.name])
    run_dir = args.out or Path("runs") / f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"vime {args.name}: {scenario.DESCRIPTION}; run folder {run_dir}", flush=True)
    figures = trio.run(scenario.run, run_dir, args.transport, lambda line: print(f"  {line}", flush=True))
    print("PASSED" if figures["passed"] else "FAILED", flush=True)
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
