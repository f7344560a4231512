r"""Memory per weight version: does any process of a run grow as the versions go by?

Runs ``python -m vime.scenario ARGS --out RUN_DIR`` (everything after ``--``) once per ``--run NAME``, one
after another, and while each runs samples every ``--every`` seconds:

* each actor's resident host memory (``VmRSS`` of the pids in RUN_DIR/actors.json, kept current by the
  driver, a restarted actor included);
* on a GPU machine, nvidia-smi's memory per compute process (mapped to the actors by pid; vLLM runs inside
  its rollout worker's process) and the device's used memory (what the processes hold, as the driver sees it);

each sample tagged with the weight version the run has published so far (rows in metrics.jsonl). Per version
it keeps the last sample, and beside it the trainer's own ``trainer_gpu_allocated_mib`` and
``trainer_rss_mib`` from its row. The table gives, per process, the value at a few versions and the growth
per version (least squares over the versions from ``--from-version`` on, after the start-up's allocations);
a leak of one bucket per version shows as a slope of the bucket's size. Beside it, the change of the peak:
the largest reading over the last 20 versions less the largest over the 20 from ``--from-version``. The
slope alone misleads where a reading may catch a process between states: a vLLM engine in sleep mode holds
almost nothing while the trainer trains, so some samples see it asleep; the peaks compare awake with awake.
The last version is left out of both (it is sampled while the run shuts down).

Usage (one H200; each run's flags after ``--``; ``--run`` repeats for several layouts)::

    python bench/memory.py --json bench/results/memory-h200.json --run awake -- arithmetic \
        --train-backend megatron --rollout-backend vllm --dtype bf16 --actor-num-gpus-per-node 1 --colocate \
        --vllm-gpu-memory-utilization 0.3 --steps 300 --seed 5
    python bench/memory.py --json x.json --append --run sleep -- arithmetic ... --vllm-enable-sleep-mode true

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

APPS_QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
DEVICE_QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
SHOWN_VERSIONS = (1, 10, 50, 100, 200, 300)


def _rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def _smi(query: list[str]) -> list[list[str]]:
    if not shutil.which("nvidia-smi"):
        return []
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
        return [[field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()]
    return []


def sample(run_dir: Path) -> dict[str, Any]:
    """One look at every actor's memory: host RSS and nvidia-smi's GPU memory by actor name, and the device's."""
    actors = json.loads((run_dir / "actors.json").read_text())["actors"] if (run_dir / "actors.json").exists() else []
    by_pid = {row["pid"]: row["name"] for row in actors if row.get("pid")}
    gpu = {by_pid.get(int(pid), f"pid {pid}"): float(used) for pid, used in _smi(APPS_QUERY) if pid.isdigit()}
    device = [float(row[0]) for row in _smi(DEVICE_QUERY)]
    return {"rss_mib": {name: _rss_mib(pid) for pid, name in by_pid.items()}, "gpu_mib": gpu,
            "device_used_mib": sum(device) if device else None}


def watch(run_dir: Path, scenario: subprocess.Popen, every: float) -> dict[int, dict[str, Any]]:
    """The last sample seen at each weight version, until the scenario exits."""
    per_version: dict[int, dict[str, Any]] = {}
    metrics = run_dir / "metrics.jsonl"
    while scenario.poll() is None:
        versions = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
        with contextlib.suppress(OSError, json.JSONDecodeError):  # actors.json replaced as we read it
            per_version[versions] = sample(run_dir)
        time.sleep(every)
    return per_version


def run(args: argparse.Namespace, name: str, flags: list[str]) -> dict[str, Any]:
    run_dir = args.out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "vime.scenario", *flags, "--out", str(run_dir)]
    print(f"{name}: {' '.join(command[1:])}", flush=True)
    started = time.time()
    with (run_dir.parent / f"{name}.log").open("w") as log:
        scenario = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            per_version = watch(run_dir, scenario, args.every)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(scenario.pid, signal.SIGKILL)
            scenario.wait()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    trace = []
    for row in rows:
        version = row["weight_version"]
        seen = per_version.get(version, {})
        trace.append({"version": version, "reward": row["raw_reward"],
                      "trainer_gpu_allocated_mib": row.get("trainer_gpu_allocated_mib"),
                      "trainer_rss_mib": row.get("trainer_rss_mib"), **seen})
    return {"name": name, "command": " ".join(["python -m vime.scenario", *flags]), "exit_code": scenario.returncode,
            "wall_s": round(time.time() - started, 1), "versions": len(rows), "trace": trace,
            "growth_mib_per_version": growth(trace, args.from_version),
            "peak_change_mib": peak_change(trace, args.from_version)}


def _series(trace: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Every measured quantity of the trace as (version, MiB) points, named for the process and what it is."""
    series: dict[str, list[tuple[int, float]]] = {}
    for point in trace:
        values = {"trainer torch allocated": point.get("trainer_gpu_allocated_mib"),
                  "device used": point.get("device_used_mib"),
                  **{f"{name} gpu": used for name, used in point.get("gpu_mib", {}).items()},
                  **{f"{name} rss": used for name, used in point.get("rss_mib", {}).items()}}
        for key, value in values.items():
            if value is not None:
                series.setdefault(key, []).append((point["version"], value))
    return series


def growth(trace: list[dict[str, Any]], first: int) -> dict[str, float | None]:
    """Least-squares MiB per version of each quantity, over the versions from ``first`` on."""
    slopes: dict[str, float | None] = {}
    for key, points in _series(trace).items():
        points = [(v, y) for v, y in points if v >= first]
        if len(points) < 3:
            slopes[key] = None
            continue
        mean_v = sum(v for v, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        spread = sum((v - mean_v) ** 2 for v, _ in points)
        slopes[key] = sum((v - mean_v) * (y - mean_y) for v, y in points) / spread if spread else None
    return slopes


def peak_change(trace: list[dict[str, Any]], first: int, window: int = 20) -> dict[str, float | None]:
    """Per quantity, the largest reading of the last ``window`` versions less that of the ``window`` versions
    from ``first`` on, the last version left out; None when the run is too short for two windows."""
    changes: dict[str, float | None] = {}
    for key, points in _series(trace).items():
        last = max(v for v, _ in points)
        points = [(v, y) for v, y in points if first <= v < last]
        early = [y for v, y in points if v < first + window]
        late = [y for v, y in points if v >= last - window]
        changes[key] = max(late) - max(early) if early and late and last - window >= first + window else None
    return changes


def table(result: dict[str, Any]) -> str:
    """Per quantity: MiB at a few versions, and the growth per version."""
    shown = [v for v in SHOWN_VERSIONS if v <= result["versions"]]
    lines = [f"{result['name']}: exit {result['exit_code']}, {result['versions']} versions, {result['wall_s']} s",
             f"  {'MiB':34}" + "".join(f"{'v' + str(v):>10}" for v in shown) + f"{'per version':>13}"
             f"{'peak change':>13}"]
    for key, points in sorted(_series(result["trace"]).items()):
        at = dict(points)
        cells = "".join(f"{at[v]:>10.1f}" if v in at else f"{'-':>10}" for v in shown)
        slope = result["growth_mib_per_version"].get(key)
        change = result.get("peak_change_mib", {}).get(key)
        lines.append(f"  {key:34}{cells}{'-' if slope is None else f'{slope:.3f}':>13}"
                     f"{'-' if change is None else f'{change:.1f}':>13}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, metavar="NAME",
                        help="a label for one run of the flags after --; repeat it to run them again under another")
    parser.add_argument("--out", type=Path, default=Path("runs/memory"), help="run folders go under this folder")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--from-version", type=int, default=10, help="growth is fitted from this version on")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--append", action="store_true", help="add to the runs already in --json")
    args, flags = parser.parse_known_args()
    flags = [flag for flag in flags if flag != "--"]
    results = [run(args, name, flags) for name in args.run]
    for result in results:
        print(table(result), flush=True)
    earlier = json.loads(args.json.read_text())["runs"] if args.append and args.json.exists() else []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = _smi(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    document = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
                "machine": f"{platform.node()}: {gpu[0][0] if gpu else 'no GPU'}, {os.cpu_count()} CPUs",
                "runs": earlier + results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
