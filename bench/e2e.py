r"""End-to-end GPU benchmark: a scenario run per staleness bound; where a step's time goes; how busy the GPUs are.

Runs ``python -m vime.scenario qwen3_4b_gsm8k`` (``--scenario``) once per
``--max-staleness K``, one after another (each run alone on the machine), or
reads run folders that already exist (``--from``). The scenario flags after
``--`` (and any flag this script does not know) go to the scenario unchanged;
the script adds ``--steps``, ``--max-staleness K`` and ``--out RUN_DIR``.
While a run goes, nvidia-smi samples the GPUs every 0.5 s into RUN_DIR/gpu.csv
(each line stamped with the wall time it was read), and RUN_DIR/row_times.json
gets the wall time at which each row of metrics.jsonl appeared (the rows carry
no wall clock). Per run, over the steps after the ``--warmup`` first ones (the
measured steps):

* the median step time and its split, medians of: rollout (``time_generate_s``,
  the slowest group's generation), reward (``time_reward_s``, all groups),
  train, weight sync, sleep (``time_sleep_s``: colocated vLLM engines draining
  and going to sleep before training; 0 when absent) and wait (the trainer
  waiting for the batch);
* samples/s and response tokens/s: their sum over the sum of step times, and the tokens/s per GPU of the
  run's placement (the trainer's GPUs, and the rollout's unless colocated);
* the train phase's model TFLOP/s per trainer GPU (the trainer's ``train_tflops_per_gpu``, median; see
  ``vime.flops``) and its MFU: over the bf16 matmul peak measured on this machine before the runs
  (``--peak-tflops`` gives it instead, and must for ``--from`` on a machine without the GPU);
* the GPU busy fraction per GPU: mean ``utilization.gpu`` / 100 over the samples
  between the appearance of the warm-up's last row and of the last row (all
  samples for a folder without row_times.json);
* ``gpu_busy_generate``: the busiest GPU's busy fraction inside the measured batches' generation spans
  (``generate_from``-``generate_until``, which the buffer writes in each row), and ``overhead_s``: the
  median over the measured steps of each step's seconds outside generation, training and the weight sync
  (``overhead``). It holds the collate and sleep columns' seconds: the table's columns do not add up;
* the staleness histogram (share of trained samples 0, 1, 2 ... versions old)
  and the weight-sync share (median of weight-sync time over step time);
* ``train_rollout_logprob_abs_diff``: first, last, max and median over all
  steps, warm-up included (a drift check), on the tokens sampled by the
  weights the trainer holds (sync runs; async runs only where some are), and
  the same of ``train_rollout_logprob_abs_diff_stale``, on tokens of older
  versions (async runs: the mismatch plus the policy's movement since);
* where the start-up went (``startup``, summary.json's breakdown, ``vime.startup``) and ``startup_s``, its
  ``first_step_s``: from the command to the first step's row.

Across runs with the same ``--placement`` and ``--settings`` labels, against
their sync run (K = 0) in this invocation:

* ideal_speedup = (rollout + train) / max(rollout, train), with rollout the sync
  run's median ``time_generate_s`` and train its medians of ``time_train_s`` +
  ``time_weight_sync_s`` + ``time_sleep_s``: the most that overlapping
  generation with training on separate GPUs can gain (null for colocated
  runs, where the two take turns on one GPU);
* measured_speedup = samples/s over the sync run's; ratio_of_ideal = measured / ideal.

Usage::

    python bench/e2e.py --placement colocated-1gpu --max-staleness 0 1 2 --steps 12 --warmup 2 --out runs/e2e \
        --json bench/results/e2e-h200.json -- --model-path M --data gsm8k/train.jsonl --train-backend megatron \
        --rollout-backend vllm --dtype bf16 --actor-num-gpus-per-node 1 --colocate --vllm-enable-sleep-mode true \
        --forced-response-lengths uniform:128
    python bench/e2e.py --placement split-2gpu --max-staleness 0 1 2 --out runs/e2e \
        --json bench/results/e2e-h200.json --append -- ... --actor-num-gpus-per-node 1 --rollout-num-gpus 1
    python bench/e2e.py --from runs/e2e/colocated-1gpu-k0 runs/e2e/colocated-1gpu-k1 --json x.json

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import torch

from vime.flops import matmul_peak_tflops
from vime.metrics import MetricsFollower, trained_ages

SPLIT = {"rollout": "time_generate_s", "reward": "time_reward_s", "train": "time_train_s",
         "weight_sync": "time_weight_sync_s", "sleep": "time_sleep_s", "wait": "time_wait_s",
         "collate": "time_collate_s"}
OPTIONAL = {"time_sleep_s", "time_collate_s"}  # absent from runs made before the trainer wrote them: 0 there
Samples = list[tuple[float, int, float]]  # (time.time(), GPU index, utilization 0-100): RUN_DIR/gpu.csv's lines
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
             "-lms", "500"]


@contextlib.contextmanager
def watching(run_dir: Path) -> Iterator[bool]:
    """While the body runs, sample the GPUs into RUN_DIR/gpu.csv and note when each row of metrics.jsonl
    appears (the rows carry no wall clock), into RUN_DIR/row_times.json. Both use time.time(), stamped as
    a line is read, so the samples can be cut to the measured steps. Yields whether nvidia-smi is here."""
    smi = subprocess.Popen(GPU_QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) \
        if shutil.which("nvidia-smi") else None
    times: list[float] = []
    done = threading.Event()

    def sample() -> None:
        with (run_dir / "gpu.csv").open("w") as out:
            for line in smi.stdout:
                out.write(f"{time.time():.3f}, {line.strip()}\n")
                out.flush()

    def poll() -> None:
        path = run_dir / "metrics.jsonl"
        while True:
            last_look = done.is_set()  # rows written just before the run ended still count
            if path.exists():
                rows = path.read_bytes().count(b"\n")  # a row is written with its newline, then flushed
                times.extend([time.time()] * (rows - len(times)))
            if last_look:
                return
            done.wait(0.2)

    threads = [threading.Thread(target=target, daemon=True) for target in ([poll, sample] if smi else [poll])]
    for thread in threads:
        thread.start()
    try:
        yield smi is not None
    finally:
        done.set()
        if smi is not None:
            smi.terminate()
            smi.wait()
        for thread in threads:
            thread.join()
        (run_dir / "row_times.json").write_text(json.dumps(times))


def run(args: argparse.Namespace, staleness: int, flags: list[str]) -> Path:
    """Run the scenario once into out/PLACEMENT[-SETTINGS]-kK; its labels and exit go to RUN_DIR/e2e.json."""
    settings = args.settings or "e2e"
    name = args.placement + ("" if settings == "e2e" else f"-{settings}") + f"-k{staleness}"
    run_dir = args.out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts afresh: vime.scenario refuses a folder with a run
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "vime.scenario", args.scenario, *flags, "--steps", str(args.steps),
               "--max-staleness", str(staleness), "--out", str(run_dir)]
    print(f"{name}: {' '.join(command[1:])}", flush=True)
    started = time.time()
    with watching(run_dir) as sampled, (run_dir / "scenario.log").open("w") as log:
        scenario = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = scenario.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            # the whole group: on a timeout the driver and every actor; after an exit, any straggler,
            # which would hold GPU memory the next run needs
            with contextlib.suppress(ProcessLookupError):  # none left
                os.killpg(scenario.pid, signal.SIGKILL)
            scenario.wait()
    wall_s = time.time() - started
    labels = dict(placement=args.placement, settings=settings, max_staleness=staleness, scenario=args.scenario,
                  scenario_flags=flags, exit_code=code, timed_out=code is None, wall_s=round(wall_s, 1),
                  gpu_note=None if sampled else "no nvidia-smi on this machine")
    (run_dir / "e2e.json").write_text(json.dumps(labels, indent=2) + "\n")
    ended = f"timed out after {args.timeout} s" if code is None else f"exit {code} after {wall_s:.0f} s"
    print(f"{name}: {ended}, {len(MetricsFollower(run_dir).new_rows())} of {args.steps} steps", flush=True)
    if code != 0:
        print("  " + "\n  ".join((run_dir / "scenario.log").read_text().splitlines()[-5:]), flush=True)
    return run_dir


def figures(run_dir: Path, warmup: int, labels: dict[str, Any]) -> dict[str, Any]:
    """One run's entry, from its folder's files; figures over no measured step are None."""
    config = _json(run_dir / "config.json") or {}
    rows = MetricsFollower(run_dir).new_rows()
    measured = rows[warmup:]
    elapsed = sum(row["step_time_s"] for row in measured)
    ages = trained_ages(measured)
    trained = sum(ages.values())
    found = gpu_samples(run_dir)
    busy, memory, note = gpu_figures(run_dir, found, rows, warmup)
    tokens_per_s = sum(row["response_tokens"] for row in measured) / elapsed if elapsed else None
    gpus = placed_gpus(config)
    tflops = _median([row["train_tflops_per_gpu"] for row in measured if row.get("train_tflops_per_gpu")])
    peak = labels.get("peak_tflops")
    startup = (_json(run_dir / "summary.json") or {}).get("startup")
    return {
        "placement": labels["placement"],
        "colocated": config.get("placement", {}).get("colocate", False),
        "settings": labels["settings"],
        "max_staleness": config.get("data", {}).get("max_staleness", labels.get("max_staleness")),
        "steps": len(measured),
        "warmup": len(rows) - len(measured),
        "step_time_s": _median([row["step_time_s"] for row in measured]),
        "split": {part: _median([row.get(key, 0.0) if key in OPTIONAL else row[key] for row in measured])
                  for part, key in SPLIT.items()},
        "samples_per_s": sum(row["samples"] for row in measured) / elapsed if elapsed else None,
        "tokens_per_s": tokens_per_s,
        "gpus": gpus,
        "tokens_per_s_per_gpu": tokens_per_s / gpus if tokens_per_s and gpus else None,
        "train_tflops_per_gpu": tflops,
        "peak_tflops": peak,
        "train_mfu": tflops / peak if tflops and peak else None,
        "staleness": {str(age): ages[age] / trained for age in sorted(ages)},
        "staleness_mean": sum(age * count for age, count in ages.items()) / trained if trained else None,
        "logprob_abs_diff": drift(rows, "train_rollout_logprob_abs_diff"),
        "logprob_abs_diff_stale": drift(rows, "train_rollout_logprob_abs_diff_stale"),
        "gpu_busy": busy,
        "gpu_busy_generate": busy_generating(found[0] if found else [], measured),
        "overhead_s": _median([value for value in map(overhead, measured) if value is not None]),
        "gpu_memory_max_mib": memory,
        "peak_gpu_mem_gib": max(memory) / 1024 if memory else None,  # the fullest GPU's most, over the run
        "gpu_note": labels.get("gpu_note") or note,
        "weight_sync_share": _median([row["time_weight_sync_s"] / row["step_time_s"] for row in measured]),
        "startup_s": (startup or {}).get("first_step_s"),
        "startup": startup,
        "run_dir": str(run_dir),
        "complete": (run_dir / "summary.json").exists() and not labels.get("timed_out"),
        "scenario_flags": labels.get("scenario_flags"),
        **{key: labels[key] for key in ("exit_code", "timed_out", "wall_s") if key in labels},
    }


def placed_gpus(config: dict[str, Any]) -> int | None:
    """How many GPUs the run's placement used: the trainer's, and the rollout's unless they share them."""
    placement = config.get("placement", {})
    trainer, rollout = placement.get("actor_num_gpus_per_node", 0), placement.get("rollout_num_gpus", 0)
    return (trainer if placement.get("colocate") else trainer + rollout) or None


def drift(rows: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """First, last, max and median of a log-prob gap over the steps that measured it (null where a step had
    no token of the kind: the trainer's own version for the plain gap, older ones for the stale gap)."""
    values = [row[key] for row in rows if row.get(key) is not None]
    return dict(first=values[0], last=values[-1], max=max(values), median=statistics.median(values),
                steps=len(values)) if values else None


def gpu_samples(run_dir: Path) -> tuple[Samples, dict[int, float]] | None:
    """The run's GPU samples and the most memory each GPU used (MiB); None without gpu.csv."""
    path = run_dir / "gpu.csv"
    if not path.exists():
        return None
    samples, memory = [], {}
    for line in path.read_text().splitlines():
        try:
            stamp, index, utilization, mib = (float(field) for field in line.split(","))
        except ValueError:  # "[N/A]" or a message from nvidia-smi instead of a sample
            continue
        samples.append((stamp, int(index), utilization))
        memory[int(index)] = max(memory.get(int(index), 0.0), mib)
    return samples, memory


def busy_generating(samples: Samples, measured: list[dict[str, Any]]) -> float | None:
    """The busiest GPU's busy fraction while the measured steps' batches were generated: the samples inside
    each row's ``generate_from``-``generate_until`` (the buffer's span of the batch, by the rollout workers'
    wall clocks). On one GPU that is the GPU; split at k = 0, the rollout's. At k >= 1 training overlaps the
    spans and counts too. None without samples or spans (runs from before the buffer wrote them)."""
    windows = [(row["generate_from"], row["generate_until"]) for row in measured if "generate_from" in row]
    busy = collections.defaultdict(list)
    for stamp, index, utilization in samples:
        if any(start <= stamp <= end for start, end in windows):
            busy[index].append(utilization / 100)
    return max(statistics.fmean(values) for values in busy.values()) if busy else None


def overhead(row: dict[str, Any]) -> float | None:
    """Seconds of the step outside generation, training and the weight sync: the step less the training, the
    sync and the generation it waited for (at k = 0 the batch's whole span; at k >= 1 the wait, which is the
    part of the span training did not hide). What is left: message hops, the reward's tail, collation,
    sleep and wake, the driver's and buffer's turns. None for a row from before the buffer wrote spans."""
    if "time_generate_span_s" not in row:
        return None
    generating = min(row["time_wait_s"], row["time_generate_span_s"])
    return row["step_time_s"] - row["time_train_s"] - row["time_weight_sync_s"] - generating


def gpu_figures(run_dir: Path, found: tuple[Samples, dict[int, float]] | None, rows: list[dict[str, Any]],
                warmup: int) -> tuple[list[float] | None, list[float] | None, str | None]:
    """Busy fraction per GPU index over the measured steps' window, the most memory each used over the
    whole run (MiB), and a note when the busy fractions are missing or cover the whole run; ``found`` is
    :func:`gpu_samples`'s."""
    if found is None:
        return None, None, "no gpu.csv"
    samples, memory = found
    times = _json(run_dir / "row_times.json")
    note = None
    if times and len(times) == len(rows) > warmup:
        start = times[warmup - 1] if warmup else times[0] - rows[0]["step_time_s"]
        samples = [s for s in samples if start <= s[0] <= times[-1]]
    else:
        note = "busy over the whole run: no row times for the measured steps"
    busy = collections.defaultdict(list)
    for _, index, utilization in samples:
        busy[index].append(utilization / 100)
    most = [memory[index] for index in sorted(memory)] or None
    if not busy:
        return None, most, "no GPU sample in the measured steps"
    return [statistics.fmean(busy[index]) for index in sorted(busy)], most, note


def add_speedups(results: list[dict[str, Any]]) -> None:
    """Set ideal_speedup, measured_speedup and ratio_of_ideal on every run from its labels' sync run."""
    for result in results:
        sync = next((r for r in results if r["max_staleness"] == 0 and r["placement"] == result["placement"]
                     and r["settings"] == result["settings"]), None)
        ideal = measured = None
        if sync is not None:
            split = sync["split"]
            if split["rollout"] is not None and not sync["colocated"]:  # None together: no measured step
                rollout, train = split["rollout"], split["train"] + split["weight_sync"] + split["sleep"]
                ideal = (rollout + train) / max(rollout, train) if max(rollout, train) > 0 else None
            if result["samples_per_s"] and sync["samples_per_s"]:
                measured = result["samples_per_s"] / sync["samples_per_s"]
        result.update(ideal_speedup=ideal, measured_speedup=measured,
                      ratio_of_ideal=measured / ideal if measured and ideal else None)


def table(results: list[dict[str, Any]]) -> str:
    """One line per run; '-' where a figure is missing."""
    head = (f"{'run':<24} {'k':>2} {'steps':>5} {'step':>7} {'rollout':>7} {'reward':>7} {'train':>7} {'sync':>7} "
            f"{'sleep':>7} {'wait':>7} {'collate':>7} {'overhead':>8} {'samples/s':>9} {'tok/s':>8} {'mfu':>5} "
            f"{'gpu busy':>9} {'gen busy':>8} "
            f"{'stale':>5} {'dlogp first/last/max':>26} {'speedup':>11} {'peak GiB':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        split = " ".join(_show(r["split"][part], "7.3f") for part in SPLIT)
        busy = "/".join(f"{fraction:.2f}" for fraction in r["gpu_busy"]) if r["gpu_busy"] else "-"
        fresh, stale = r["logprob_abs_diff"], r["logprob_abs_diff_stale"]
        gaps = (stale or fresh) if r["max_staleness"] else (fresh or stale)
        gap = "/".join(f"{gaps[key]:.1e}" for key in ("first", "last", "max")) if gaps else "-"
        speedup = f"{_show(r['measured_speedup'], '.2f')}/{_show(r['ideal_speedup'], '.2f')}"
        lines.append(f"{Path(r['run_dir']).name:<24} {_show(r['max_staleness'], '>2')} {r['steps']:>5} "
                     f"{_show(r['step_time_s'], '7.3f')} {split} {_show(r.get('overhead_s'), '8.3f')} "
                     f"{_show(r['samples_per_s'], '9.1f')} {_show(r['tokens_per_s'], '8.0f')} "
                     f"{_show(r['train_mfu'], '5.3f')} {busy:>9} {_show(r.get('gpu_busy_generate'), '8.2f')} "
                     f"{_show(r['staleness_mean'], '5.2f')} "
                     f"{gap:>26} {speedup:>11} {_show(r.get('peak_gpu_mem_gib'), '8.1f')}"
                     + ("" if r["complete"] else "  (incomplete)"))
    return "\n".join(lines)


def write_json(path: Path, results: list[dict[str, Any]], machine: str, append: bool) -> None:
    """Write the runs; with ``append``, keep the file's runs of other (placement, settings, max_staleness)."""
    runs = results
    if append and path.exists():
        new = {_identity(result) for result in results}
        runs = [run for run in json.loads(path.read_text())["runs"] if _identity(run) not in new] + results
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
                                "command": " ".join(sys.argv), "runs": runs}, indent=2) + "\n")


def gpu_names() -> str:
    """The machine in words for the JSON: '2 x NVIDIA H200', or 'cpu' without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = [line.strip() for line in found.stdout.splitlines() if line.strip()]
    return f"{len(names)} x {names[0]}" if names else "cpu"


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _identity(run: dict[str, Any]) -> tuple:
    return run["placement"], run["settings"], run["max_staleness"]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _show(value: Any, spec: str) -> str:
    """``value`` formatted, or '-' as wide as the spec asks when it is missing."""
    if value is None:
        return "-".rjust(int(spec.split(".")[0].lstrip(">") or 0))
    return format(value, spec)


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     usage="%(prog)s [options] [-- SCENARIO-FLAGS...]")
    parser.add_argument("--scenario", default="qwen3_4b_gsm8k")
    parser.add_argument("--placement", help="label of the GPU layout, e.g. colocated-1gpu, split-2gpu")
    parser.add_argument("--settings", help="label of the settings (default: e2e; the TRL comparison: trl)")
    parser.add_argument("--max-staleness", nargs="+", type=int, default=[0, 1, 2], metavar="K",
                        help="one run per bound; the async runs are compared with K = 0")
    parser.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures but drift's")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per run (default: none)")
    parser.add_argument("--out", type=Path, default=Path("runs/e2e"))
    parser.add_argument("--from", dest="existing", nargs="+", type=Path, default=[], metavar="RUN_DIR",
                        help="summarise these run folders; runs nothing")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--append", action="store_true", help="merge into --json's runs instead of replacing them")
    parser.add_argument("--machine", default=None, help="free text for the JSON (default: the GPUs' names)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the bf16 matmul peak the train MFU divides by (default: measured here on GPU 0)")
    args, unknown = parser.parse_known_args(argv[:cut])
    flags = unknown + argv[cut + 1:]
    if not args.existing and not args.placement:
        parser.error("--placement names the layout of these runs (e.g. colocated-1gpu)")
    machine = args.machine or gpu_names()
    peak = args.peak_tflops
    if peak is None and torch.cuda.is_available():  # before any run: the GPU is idle
        peak = round(max(matmul_peak_tflops("cuda").values()), 1)
    results: list[dict[str, Any]] = []
    for folder in args.existing or (run(args, staleness, flags) for staleness in args.max_staleness):
        saved = _json(folder / "e2e.json") or {}  # labels and exit of a run this script made; the flags win
        labels = {**saved, "placement": args.placement or saved.get("placement", folder.name),
                  "settings": args.settings or saved.get("settings", "e2e"), "peak_tflops": peak}
        results.append(figures(folder, args.warmup, labels))
        add_speedups(results)
        if args.json:  # after every run, so an invocation cut short keeps what it measured
            write_json(args.json, results, machine, args.append)
    print(f"\nmedian seconds per step over the steps after the first {args.warmup}; samples/s, tok/s, gpu busy and "
          "stale (mean age) over those steps;\ndlogp over all steps (same-version tokens; in async runs older ones); "
          "speedup: samples/s over the sync run's / ideal;\noverhead: the step less training, weight sync and "
          "the generation waited for (collate and sleep are in it); gen busy: the busiest GPU inside the batches' "
          "generation spans")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
