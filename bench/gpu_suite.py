r"""A device session's GPU evidence in one detached run: ``pytest -m gpu`` in lanes side by side on one GPU, then
the benches that the open issues owe, one at a time, each job with its own log, time limit and outcome.

Why a suite: the GPU machine is lent in calls of at most 10 minutes. It stays warm only while calls follow each
other, and each call returns only a few files. So ``start`` launches the run detached and returns at once.
``wait`` calls, each inside a call's limit, follow the run, print where it stands and pack what it made into one
archive. Starting the suite again on the same folder runs again only the jobs that have not passed.

The run has two phases. First, the test lanes run together, beside the job that builds the benches' 0.6B model.
Then the benches run one after another, each alone on the GPU, so no figure is shared with anything else. The
plan follows the card's memory: an H200 (about 140 GiB) gets the 4B packed-vs-padded train rows, the TRL layout
with two engines (the 13.88 s row of ``e2e-h200.json``) and the two 200-version runs side by side; a smaller
card gets the one-engine TRL layout (``e2e-h100.json``). ``--baseline-tree DIR`` (an older checkout, unpacked)
adds its own e2e and rollout runs beside HEAD's, for a before-and-after on the same card in the same session.

    python bench/gpu_suite.py start --data-dir DATA --out RUN [--jobs e2e-trl,rollout-bf16] [--baseline-tree OLD]
    python bench/gpu_suite.py wait --out RUN --seconds 540 --pack $OUT/suite.tgz
    python bench/gpu_suite.py plan --gib 80 --data-dir DATA --out RUN     # what would run on a card of that size

DATA is laid out as the shared data folder (``qwen3-tokenizer/``, ``gsm8k/train.jsonl``); it becomes the jobs'
``VIME_SHARED_DATA``. RUN/suite.json holds every job (command, lane, outcome, seconds), and the table is printed.
Each bench writes its own JSON under RUN/results; each job's output goes to RUN/logs/NAME.log. The environment
the GPU machine needs (``PYTHONPATH`` of its staged packages, ``VLLM_USE_FLASHINFER_SAMPLER=0``) is the caller's.
Start it from a copy of the tree that later calls leave alone: the jobs run from the tree the suite is in, for
as long as they take, while each call of the device tool brings a fresh copy of the working tree.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
BIG_GIB = 120  # a card at least this large runs the H200 plan
BENCH_LANE = "bench"  # the second phase: its jobs run one at a time, after every test lane has ended
PACKED = ("suite.json", "runner.log", "logs", "results")  # what ``wait --pack`` archives (not the models or runs)
JOB_MARK = "VIME_GPU_SUITE_JOB"  # in the environment of every process a job starts, for killing them all after it
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-rA", "-v", "-m", "gpu"]
TRL = ["--data", "{data}/gsm8k/train.jsonl", "--train-backend", "megatron", "--rollout-backend", "vllm",
       "--dtype", "bf16", "--actor-num-gpus-per-node", "1", "--colocate", "--eval-every", "0", "--save-every", "0",
       "--updates-per-step", "1", "--vllm-max-num-batched-tokens", "4096", "--rollout-batch-size", "64",
       "--group-size", "8", "--max-new-tokens", "512", "--forced-response-lengths", "max", "--enable-thinking",
       "--temperature", "1.0", "--lr", "1e-6", "--weight-decay", "0", "--adam-beta2", "0.999", "--clip-high", "0.2",
       "--loss-aggregation", "token"]  # TRL's GRPO settings (bench/RESULTS.md, "TRL-settings e2e")
TRL_LAYOUTS = {  # the card's layout: (label, its flags)
    True: ("trl-awake-2engines-mb32", ["--rollout-workers", "2", "--vllm-gpu-memory-utilization", "0.2",
                                       "--rollout-max-batch-size", "256", "--micro-batch-size", "32"]),
    False: ("trl-h100-1engine", ["--vllm-gpu-memory-utilization", "0.3", "--rollout-max-batch-size", "512",
                                 "--micro-batch-size", "8"]),
}


@dataclasses.dataclass(frozen=True)
class Job:
    """One command of the suite: ``argv`` after the Python interpreter, run in ``tree`` (HEAD's, or the baseline's)
    for at most ``timeout_s``; the jobs of one ``lane`` run one after another. It has passed when it exits 0 and
    its results (RUN/results/NAME.json, for a bench) have no failed part (:func:`_failed_parts`): the benches
    record a part that failed and go on."""

    name: str
    lane: str
    argv: list[str]
    timeout_s: int
    tree: str = str(ROOT)
    needs: str = ""  # an earlier job that must have passed (it makes a model this one loads); else skipped


def plan(gib: float, data: Path, run: Path, baseline: Path | None = None) -> list[Job]:
    """The jobs for a card of ``gib`` GiB, in the order they run within each lane."""
    big = gib >= BIG_GIB
    m06 = run / "models" / "m06"
    vllm = [*PYTEST, "tests/test_vllm.py", "-k"]
    jobs = [
        Job("tests-core", "t1", [*PYTEST, "tests/test_megatron.py", "tests/test_engines.py", "tests/test_gpu_memory.py",
                                 "tests/test_gpu_transport.py"], 600),
        Job("tests-learning", "t1", [*PYTEST, "tests/test_learning.py"], 600),
        Job("tests-vllm-placement", "t2", [*vllm, "placement_allows or sleeps_and_takes or routed"], 900),
        Job("tests-vllm-restart-fp8", "t2", [*vllm, "restarted or fp8"], 600),
        Job("tests-200-awake", "t3", [*vllm, "two_hundred and awake"], 900),
        Job("tests-200-sleep", "t4" if big else "t3", [*vllm, "two_hundred and sleep"], 900),
        Job("model-0.6b", "t5", ["-m", "vime.devtools.make_tiny_model", "--arch", "qwen3", "--shape", "qwen3-0.6b",
                                 "--tokenizer", str(data / "qwen3-tokenizer"), "--out", str(m06), "--dtype", "bf16",
                                 "--device", "cuda"], 300),
    ]
    label, layout = TRL_LAYOUTS[big]
    trees = [("", str(ROOT))] + ([("-baseline", str(baseline))] if baseline else [])
    for suffix, tree in trees:
        jobs.append(_bench(run, f"e2e-trl{suffix}", [
            "bench/e2e.py", "--placement", "colocated-1gpu", "--settings", label, "--max-staleness", "0",
            "--steps", "7", "--warmup", "1", "--timeout", "420", "--out", str(run / "runs" / f"e2e-trl{suffix}"),
            "--", "--model-path", str(m06), *[arg.format(data=data) for arg in TRL], *layout], 540, tree,
            "model-0.6b"))
    for suffix, tree in trees:
        jobs.append(_bench(run, f"rollout-bf16{suffix}", ["bench/rollout.py", "--models", "0.6b"], 540, tree))
    jobs += [
        _bench(run, "rollout-fp8", ["bench/rollout.py", "--models", "0.6b", "--update-models", "none",
                                    "--vllm-args", json.dumps({"quantization": "fp8"})], 540),
        _bench(run, "alignment-fp8", ["bench/alignment.py", "--models", "0.6b", "--trainers", "megatron",
                                      "--quantization", "fp8"], 540),
        *([_bench(run, "train-packed-4b", ["bench/train.py", "--shapes", "4b", "--backends", "megatron", "--mix",
                                           "dapo", "--max-tokens-per-gpu", "16384"], 600)] if big else []),
        _bench(run, "train-step-ppo", ["bench/train_step.py", "--model-path", str(m06), "--algos", "grpo", "ppo",
                                       "--micro-batch-sizes", "16"], 540, needs="model-0.6b"),
        _bench(run, "memory-300", ["bench/memory.py", "--out", str(run / "runs" / "memory"), "--run", "awake", "--",
                                   "arithmetic", "--train-backend", "megatron", "--rollout-backend", "vllm", "--dtype",
                                   "bf16", "--actor-num-gpus-per-node", "1", "--colocate",
                                   "--vllm-gpu-memory-utilization", "0.3", "--steps", "300", "--seed", "5"], 600),
    ]
    return jobs


def _bench(run: Path, name: str, argv: list[str], timeout_s: int, tree: str = str(ROOT), needs: str = "") -> Job:
    """A bench job writing its JSON to RUN/results/NAME.json (``--json`` before any ``--``: the bench's own flag)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return Job(name, BENCH_LANE, [*argv[:cut], "--json", str(run / "results" / f"{name}.json"), *argv[cut:]],
               timeout_s, tree, needs)


def run_jobs(jobs: list[Job], run: Path, env: dict[str, str]) -> None:
    """Every job that has not passed in ``run`` before: the test lanes side by side, then the bench lane."""
    for folder in ("jobs", "logs", "results"):
        (run / folder).mkdir(parents=True, exist_ok=True)
    lanes: dict[str, list[Job]] = {}
    for job in jobs:
        lanes.setdefault(job.lane, []).append(job)
    bench = lanes.pop(BENCH_LANE, [])
    threads = [threading.Thread(target=_run_lane, args=(lane, run, env), daemon=True) for lane in lanes.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _run_lane(bench, run, env)


def _run_lane(jobs: list[Job], run: Path, env: dict[str, str]) -> None:
    for job in jobs:
        if _passed(run, job.name):
            continue
        if job.needs and not _passed(run, job.needs):
            _record(run, job.name, {"name": job.name, "lane": job.lane,
                                    "state": f"skipped: {job.needs} has not passed"})
        else:
            _run_job(job, run, env)


def _passed(run: Path, name: str) -> bool:
    done = _outcome(run, name)
    return done.get("rc") == 0 and not done.get("failed_parts")


def _run_job(job: Job, run: Path, env: dict[str, str]) -> None:
    """Run one job and record its outcome. Whatever it started ends with it, at its limit or when it exits: the
    processes that carry its mark in their environment (a scenario's actors, torchrun's ranks and vLLM's engine
    cores make sessions of their own), so that no straggler holds the GPU into the next job."""
    started = time.time()
    results = run / "results" / f"{job.name}.json"
    results.unlink(missing_ok=True)  # a rerun that dies before writing must not count the last run's
    mark = f"{job.name}-{os.getpid()}-{started}"
    record = {"name": job.name, "lane": job.lane, "tree": job.tree, "started": started,
              "command": shlex.join(["python3", *job.argv])}
    _record(run, job.name, {**record, "state": "running"})
    with open(run / "logs" / f"{job.name}.log", "w") as log:
        process = subprocess.Popen([sys.executable, *job.argv], cwd=job.tree, stdout=log, stderr=subprocess.STDOUT,
                                   env={**env, JOB_MARK: mark, "PYTHONPATH": os.pathsep.join(
                                       filter(None, [job.tree, env.get("PYTHONPATH")]))})
        try:
            rc, state = process.wait(timeout=job.timeout_s), "ended"
        except subprocess.TimeoutExpired:
            process.kill()
            rc, state = process.wait(), f"killed at its {job.timeout_s} s limit"
        _kill_marked(mark)
    _record(run, job.name, {**record, "state": state, "rc": rc, "seconds": round(time.time() - started, 1),
                            "failed_parts": _failed_parts(results)})


def _kill_marked(mark: str | None) -> None:
    """SIGKILL every process whose environment holds ``JOB_MARK=mark`` (any job's mark for None), in passes
    until one finds none: a process may fork while a pass goes."""
    for _ in range(10):
        found = False
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                held = process.environ().get(JOB_MARK)
                if held is not None and mark in (None, held):
                    process.kill()
                    found = True
        if not found:
            return
        time.sleep(0.2)


def _failed_parts(results: Path) -> int:
    """How many parts of a bench's JSON failed, at any depth: an ``error`` (or ``*_error``) entry, a run that
    exited non-zero, timed out or did not complete. The benches record these and still exit 0."""
    def count(value: object) -> int:
        if isinstance(value, list):
            return sum(map(count, value))
        if not isinstance(value, dict):
            return 0
        failed = (any(key.endswith("error") and item for key, item in value.items())
                  or value.get("exit_code") not in (0, None) or value.get("timed_out") is True
                  or value.get("complete") is False)
        return int(failed) + sum(map(count, value.values()))

    try:
        return count(json.loads(results.read_text()))
    except (OSError, ValueError):
        return 0


def _record(run: Path, name: str, record: dict) -> None:
    path = run / "jobs" / f"{name}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").replace(path)


def _outcome(run: Path, name: str) -> dict:
    path = run / "jobs" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def outcomes(jobs: list[Job], run: Path) -> list[dict]:
    """Each job's outcome so far (``state``: not started, running, ended, or killed at its limit), also written to
    RUN/suite.json."""
    rows = [{"name": job.name, "lane": job.lane, "state": "not started", **_outcome(run, job.name)} for job in jobs]
    for row in rows:
        if row["state"] == "running":
            row["seconds"] = round(time.time() - row["started"], 1)
    (run / "suite.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                "jobs": rows}, indent=1))
    return rows


def pack(run: Path, archive: Path) -> None:
    """RUN's logs, results and table in one archive (the device call returns only a few files)."""
    with tarfile.open(archive.with_suffix(".tmp"), "w:gz") as tar:
        for name in PACKED:
            if (run / name).exists():
                tar.add(run / name, arcname=name)
    archive.with_suffix(".tmp").replace(archive)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["start", "run", "wait", "plan"])
    parser.add_argument("--out", type=Path, required=True, help="the suite's folder (kept across calls)")
    parser.add_argument("--data-dir", type=Path, help="the tokenizer and GSM8K, laid out as the shared data folder")
    parser.add_argument("--jobs", help="comma-separated job names (default: all of the card's plan)")
    parser.add_argument("--baseline-tree", type=Path, help="an older checkout whose e2e and rollout run beside HEAD's")
    parser.add_argument("--gib", type=float, help="plan for a card of this size (default: the GPU's, via torch)")
    parser.add_argument("--seconds", type=float, default=540, help="wait: how long to follow the run")
    parser.add_argument("--pack", type=Path, help="wait: the archive to write every 20 s and at the end")
    args = parser.parse_args()
    run = args.out.resolve()
    settings = run / "settings.json"
    if args.action in ("start", "plan"):
        if args.data_dir is None:
            parser.error(f"{args.action} needs --data-dir")
        chosen = {"data": str(args.data_dir.resolve()), "jobs": args.jobs, "gib": args.gib or _card_gib(parser),
                  "baseline": args.baseline_tree and str(args.baseline_tree.resolve())}
    elif settings.is_file():
        chosen = json.loads(settings.read_text())
    else:
        parser.error(f"{run} has no settings.json: run `start` first")
    jobs = _chosen_jobs(chosen, run, parser)
    if args.action == "plan":
        for job in jobs:
            print(f"{job.lane:<6} {job.timeout_s:>4} s  {job.name}: {shlex.join(['python3', *job.argv])}")
    elif args.action == "start":
        if _runner_alive(run):
            parser.error(f"the suite's runner in {run} is still running: `wait` for it, or kill it first")
        _kill_marked(None)  # what a runner that was killed mid-job left, still holding the GPU
        run.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(chosen))
        with open(run / "runner.log", "a") as log:
            runner = subprocess.Popen([sys.executable, __file__, "run", "--out", str(run)], stdout=log,
                                      stderr=subprocess.STDOUT, env={**os.environ, "VIME_SHARED_DATA": chosen["data"]},
                                      start_new_session=True)
        (run / "runner.pid").write_text(str(runner.pid))
        print(f"started the suite's runner (process {runner.pid}) on a {chosen['gib']:.0f} GiB card: {len(jobs)} jobs")
    elif args.action == "run":
        run_jobs(jobs, run, dict(os.environ))
    else:
        _follow(jobs, run, args.seconds, args.pack)
    return 0


def _runner_alive(run: Path) -> bool:
    """Whether the runner that ``start`` last launched on ``run`` is still running."""
    try:
        runner = psutil.Process(int((run / "runner.pid").read_text()))
        return runner.status() != psutil.STATUS_ZOMBIE and "gpu_suite" in " ".join(runner.cmdline())
    except (OSError, ValueError, psutil.Error):
        return False


def _chosen_jobs(chosen: dict, run: Path, parser: argparse.ArgumentParser) -> list[Job]:
    """The card's plan, cut to ``--jobs`` where given."""
    jobs = plan(chosen["gib"], Path(chosen["data"]), run, chosen["baseline"] and Path(chosen["baseline"]))
    if not chosen["jobs"]:
        return jobs
    names = set(chosen["jobs"].split(","))
    unknown = sorted(names - {job.name for job in jobs})
    if unknown:
        parser.error(f"--jobs {unknown}: not in this card's plan ({', '.join(job.name for job in jobs)})")
    while needed := {job.needs for job in jobs if job.name in names and job.needs and job.needs not in names
                     and not _passed(run, job.needs)}:
        names |= needed  # a chosen job's prerequisite runs too, unless it has passed in RUN already
    return [job for job in jobs if job.name in names]


def _follow(jobs: list[Job], run: Path, seconds: float, archive: Path | None) -> None:
    """Wait up to ``seconds`` for the runner to end, packing every 20 s; then the table."""
    packed = time.monotonic()
    deadline = packed + seconds
    while _runner_alive(run) and time.monotonic() < deadline:
        time.sleep(1.0)
        if archive and time.monotonic() - packed >= 20:
            outcomes(jobs, run)
            pack(run, archive)
            packed = time.monotonic()
    unfinished = [row["name"] for row in outcomes(jobs, run) if row["state"] in ("running", "not started")]
    print(f"the suite is still running after {seconds:.0f} s" if _runner_alive(run) else
          f"the runner died before {unfinished} ended: see {run / 'runner.log'}" if unfinished else
          "the suite has ended")
    for row in outcomes(jobs, run):
        errors = f", {row['failed_parts']} failed parts" if row.get("failed_parts") else ""
        print(f"{row['name']:<24} {row['lane']:<6} {str(row.get('rc', '')):>4} {row.get('seconds', ''):>8} "
              f"{row['state']}{errors}")
    if archive:
        pack(run, archive)


def _card_gib(parser: argparse.ArgumentParser) -> float:
    import torch

    if not torch.cuda.is_available():
        parser.error("no GPU here: pass --gib to plan for a card of that size")
    return torch.cuda.get_device_properties(0).total_memory / 2**30


if __name__ == "__main__":
    sys.exit(main())
