"""Does the real stack learn? Megatron trains and vLLM generates on one GPU, the policy moves, and the engine keeps
the trainer's log-probs all the while (issue 30, part 2).

Runs the arithmetic scenario (``python -m vime.scenario arithmetic``: 55 single-digit sums, exact-match
reward, a start at chance, 2-5 %) with ``--train-backend megatron --rollout-backend vllm --dtype bf16`` on a
model of a real model's width and depth, random init, over the scenario's own 16-token vocabulary (built
here with ``arithmetic.build_model(shape=...)``), in named layouts (``--runs``):

* ``a-sleep``: colocated, synchronous, vLLM sleeping while the trainer trains (weights by CUDA IPC);
* ``b-awake-k1``: colocated, vLLM awake beside the trainer, ``--max-staleness 1`` (the overlapped layout);
* ``c-nng``: colocated and synchronous, weights forced over nng (``--weight-sync nng``);
* ``d-r3`` / ``d-no-r3``: the MoE shape (``--moe-shape``, ``--moe-layers``) with
  ``--use-rollout-routing-replay`` on and off.

One row per run: reward over the first 10 and the last 20 steps, the first step whose 10-step mean reaches
0.9, the train-rollout log-prob gap (``train_rollout_logprob_abs_diff``, on tokens the trained weights
sampled; an asynchronous run has such tokens on few steps, counted in ``diff_steps``) over the first and
the last 20 steps it exists and its largest, the weight path the trainer's log names, and the median step
time. ``--parallel N`` runs N at once on the one GPU (their step times then include each other), each
started ``--stagger`` seconds after the one before: a vLLM engine profiles the GPU's memory as it starts,
and a sleeping engine's memory changes every step, so list sleeping runs last. Prints a table and writes
``--json`` (rows with per-step curves) and ``--png`` (reward and gap against step, one line per run)::

    python bench/learn.py --runs a-sleep b-awake-k1 c-nng --steps 300 --json bench/results/learn-h200.json \\
        --png bench/results/learn-h200.png

Flags after ``--`` go to every run. It measures; it decides nothing (the exit status does not say whether
a run learned).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from learning import plot, summarize

REPO = Path(__file__).resolve().parent.parent
STACK = ["--train-backend", "megatron", "--rollout-backend", "vllm", "--save-every", "0", "--eval-every", "0"]
# The engine's context: prompts of 4 tokens and 2 new ones. Left to vLLM, it is the shape's own (40,960 for
# Qwen3), whose KV cache for one full request (4.4 GiB) does not fit the small --vllm-util that lets several
# runs share the GPU: an engine then fails to start until its worker's restart finds memory free.
ON_GPU = ["--dtype", "bf16", "--actor-num-gpus-per-node", "1", "--colocate", "--vllm-max-model-len", "64"]
ON_CPU = ["--dtype", "fp32"]  # --cpu: a check of this script on a machine without a GPU (vLLM's CPU build)
# name: (placement, max staleness, the run's own flags, dense or MoE model)
RUNS: dict[str, tuple[str, int, list[str], str]] = {
    "a-sleep": ("colocated, vLLM sleeping", 0, ["--vllm-enable-sleep-mode", "true"], "dense"),
    "b-awake-k1": ("colocated, vLLM awake", 1, [], "dense"),
    "c-nng": ("colocated, vLLM awake", 0, ["--weight-sync", "nng"], "dense"),
    "d-r3": ("colocated, vLLM awake", 0, ["--use-rollout-routing-replay"], "moe"),
    "d-no-r3": ("colocated, vLLM awake", 0, [], "moe"),
}


LR_HELP = ("every run's --lr. The scenario's own 5e-4 is sized for its 2-layer, hidden-128 model: at 28 layers of "
           "hidden 1024 its first updates collapse the policy onto one wrong answer (entropy 2.5 -> 1e-4 in 9 steps, "
           "reward 0 for good). Measured at Qwen3-0.6B's shape (bench/RESULTS.md): 1e-5 reaches 0.98, 3e-5 "
           "plateaus near 0.7, 1e-4 collapses")


def model_folder(args: argparse.Namespace, root: Path, kind: str) -> Path:
    """Where the random checkpoint of ``kind`` (dense or MoE) is built for these flags."""
    shape, layers = _shape(args, kind)
    return root / "models" / f"{shape}-{layers or 'all'}-s{args.seed}"


def _shape(args: argparse.Namespace, kind: str) -> tuple[str, int | None]:
    """The model shape and depth the flags give ``kind`` (dense or MoE)."""
    return {"dense": (args.dense_shape, args.dense_layers), "moe": (args.moe_shape, args.moe_layers)}[kind]


def build_models(args: argparse.Namespace, root: Path, kinds: set[str]) -> dict[str, Path]:
    """The random checkpoints the runs need, built once each (in a subprocess: the MoE shape's host memory
    goes back when it ends)."""
    folders: dict[str, Path] = {}
    for kind in sorted(kinds):
        shape, layers = _shape(args, kind)
        folder = model_folder(args, root, kind)
        if not (folder / "config.json").exists():
            code = ("import sys; from pathlib import Path; from vime.scenarios import arithmetic; "
                    "arithmetic.build_model(Path(sys.argv[1]), seed=int(sys.argv[2]), shape=sys.argv[3], "
                    "layers=int(sys.argv[4]) or None)")
            subprocess.run([sys.executable, "-c", code, str(folder), str(args.seed), shape, str(layers or 0)],
                           check=True, cwd=REPO)
        folders[kind] = folder
    return folders


def command_of(name: str, model: Path, args: argparse.Namespace, out: Path) -> list[str]:
    _, staleness, flags, _ = RUNS[name]
    placement = [*(ON_CPU if args.cpu else ON_GPU), "--vllm-gpu-memory-utilization", str(args.vllm_util)]
    return [sys.executable, "-m", "vime.scenario", "arithmetic", *STACK, *placement, *flags, "--max-staleness",
            str(staleness), "--model-path", str(model), "--lr", str(args.lr), "--steps",
            str(args.steps), "--seed", str(args.seed), "--out", str(out), *args.extra]


def weight_path(run_dir: Path) -> str | None:
    """The path the trainer chose for the engine, as its log says (``"path": "ipc"``)."""
    log = run_dir / "logs" / "trainer.log"
    found = re.findall(r'"path": "(\w+)"', log.read_text()) if log.exists() else []
    return ",".join(sorted(set(found))) or None


def _gap_figures(diffs: list[float | None]) -> dict[str, Any]:
    present = [value for value in diffs if value is not None]
    return {"diff_steps": len(present),
            "diff_first20": statistics.fmean(present[:20]) if present else None,
            "diff_last20": statistics.fmean(present[-20:]) if present else None,
            "diff_max": max(present, default=None)}


def row_of(name: str, command: list[str], run_dir: Path, code: int | None, wall: float | None) -> dict[str, Any]:
    """A run's row from its folder; ``date`` is when its metrics were last written (or now, if it wrote none)."""
    placement, staleness, flags, kind = RUNS[name]
    metrics = run_dir / "metrics.jsonl"
    finished = (datetime.datetime.fromtimestamp(metrics.stat().st_mtime, datetime.timezone.utc) if metrics.exists()
                else datetime.datetime.now(datetime.timezone.utc))
    row: dict[str, Any] = {
        "name": name, "train_backend": "megatron", "rollout_backend": "vllm", "placement": placement,
        "max_staleness": staleness, "weight_path": weight_path(run_dir), "r3": "--use-rollout-routing-replay" in flags,
        "model": kind, "exit_code": code, "wall_s": None if wall is None else round(wall, 1),
        "date": finished.strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(command[1:]).replace(str(run_dir), "RUN_DIR")}
    if not metrics.exists():
        return row
    figures, curves = summarize(run_dir)
    if not figures["steps_done"]:
        return row
    row.update(steps=figures["steps_done"], reward_first10=figures["reward_first10"],
               reward_final20=figures["reward_final20"], steps_to_0_9=figures["steps_to_0_9"],
               entropy_final20=figures["entropy_final20"], staleness_mean=figures["staleness_mean"],
               **_gap_figures(curves["train_rollout_logprob_abs_diff"]),
               step_time_s=round(statistics.median(curves.pop("step_time_s")), 3), curves=curves)
    return row


def launch(names: list[str], models: dict[str, Path], args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """Run ``names``, ``args.parallel`` at a time, each start ``args.stagger`` s after the one before."""
    waiting, running, rows = list(names), {}, []
    while waiting or running:
        if waiting and len(running) < args.parallel:
            name = waiting.pop(0)
            run_dir = root / name
            shutil.rmtree(run_dir, ignore_errors=True)  # the scenario refuses a folder holding an earlier run
            command = command_of(name, models[RUNS[name][3]], args, run_dir)
            log = open(root / f"{name}.log", "w")
            running[name] = (subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), command,
                             run_dir, time.monotonic(), log)
            print(f"  started {name}", flush=True)
            if waiting:
                time.sleep(args.stagger)
            continue
        time.sleep(1)
        for name, (process, command, run_dir, started, log) in list(running.items()):
            timed_out = time.monotonic() - started > args.timeout
            if process.poll() is None and not timed_out:
                continue
            if timed_out and process.poll() is None:
                process.terminate()
                process.wait(60)
            log.close()
            del running[name]
            rows.append(row_of(name, command, run_dir, None if timed_out else process.returncode,
                               time.monotonic() - started))
            print(f"  done: {name}: final20 {rows[-1].get('reward_final20')}", flush=True)
    return rows


COLUMNS = ("name", "max_staleness", "weight_path", "r3", "steps", "reward_first10", "reward_final20", "steps_to_0_9",
           "diff_first20", "diff_last20", "diff_max", "diff_steps", "step_time_s")


def table(rows: list[dict[str, Any]]) -> str:
    def show(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(show(row.get(column)) for column in COLUMNS) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dense-shape", default="qwen3-0.6b")
    parser.add_argument("--dense-layers", type=int, default=None, help="default: the shape's own depth")
    parser.add_argument("--moe-shape", default="qwen3-30b-a3b")
    parser.add_argument("--moe-layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5, help=LR_HELP)
    parser.add_argument("--vllm-util", type=float, default=0.15,
                        help="each engine's --vllm-gpu-memory-utilization (--cpu: the share of host memory it takes)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once on the GPU")
    parser.add_argument("--stagger", type=float, default=90.0, help="seconds between two starts")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    parser.add_argument("--cpu", action="store_true", help="fp32 on CPU, no GPU placement: to try this script")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--tabulate", action="store_true",
                        help="run nothing: the rows of the --runs found under --out (a run cut short included)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then flags for every run")
    args = parser.parse_args()
    args.extra = [flag for flag in args.extra if flag != "--"]
    if args.tabulate and not args.out:
        parser.error("--tabulate reads the runs under --out: pass their folder")
    root = args.out or Path(tempfile.mkdtemp(prefix="learn-"))
    if args.tabulate:
        found = [name for name in args.runs if (root / name).is_dir()]
        rows = [row_of(name, command_of(name, model_folder(args, root, RUNS[name][3]), args, root / name),
                       root / name, None, None) for name in found]
    else:
        root.mkdir(parents=True, exist_ok=True)
        models = build_models(args, root, {RUNS[name][3] for name in args.runs})
        print(f"{len(args.runs)} runs of {args.steps} steps under {root}", flush=True)
        rows = launch(args.runs, models, args, root)
    rows.sort(key=lambda row: args.runs.index(row["name"]))
    print(table(rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "parallel": args.parallel, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        plot(rows, args.png, label=lambda row: row["name"])


if __name__ == "__main__":
    main()
