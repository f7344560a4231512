"""``python -m vime.scenario [NAME]``: run a named scenario (the default when NAME is omitted).

Scenarios live in ``vime.scenarios``, one module each, listed with ``--list``.
A training scenario supplies defaults for every setting; each setting is
also a flag (``--lr``, ``--rollout-batch-size``, ``--advantage-estimator rloo`` ...), shown by
``python -m vime.scenario NAME --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import importlib
import json
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import trio

from vime import megatron_flags, slime_flags
from vime.config import LaunchConfig, RunConfig, TrainingLaunchConfig, add_flags, engine_flags, from_flags
from vime.logs import configure
from vime.settings import add_setting_flags, given_settings

SCENARIOS = {name: f"vime.scenarios.{name}" for name in (
    "arithmetic", "qwen3_4b_gsm8k", "qwen3_4b_gsm8k_tools", "qwen3_30b_a3b_dapo", "glm45_air_dapo", "selfcheck",
    "slime")}
DEFAULT = "arithmetic"


def main(argv: list[str] | None = None) -> int:
    # kill -USR1 PID: every thread's stack, as actors do; to the process's own stderr, whatever a caller such as
    # pytest has put in sys.stderr meanwhile
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv and not argv[0].startswith("-") else DEFAULT  # the name comes first: flags take values
    if name not in SCENARIOS:
        print(f"unknown scenario {name!r}; python -m vime.scenario --list shows them", file=sys.stderr)
        return 2
    scenario = importlib.import_module(SCENARIOS[name])
    training = hasattr(scenario, "defaults")
    parser = argparse.ArgumentParser(prog="python -m vime.scenario", usage="%(prog)s [NAME] [--flag VALUE ...]",
                                     description=scenario.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("name", nargs="?", default=DEFAULT, help=f"scenario name (default: {DEFAULT})")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    add_setting_flags(parser.add_argument_group("launch"), LaunchConfig)
    if training:
        add_setting_flags(parser.add_argument_group("launch a training run"), TrainingLaunchConfig)
        add_flags(parser, scenario.defaults())
    notes: list[str] = []
    if training:  # before argparse, which cannot know their names
        try:
            argv, notes = slime_flags.sglang_flags(argv)
        except ValueError as err:
            return _refuse(err)
    engine, argv = engine_flags(argv) if training else ({}, argv)
    args = parser.parse_args(argv)
    vars(args).update(engine)
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    if args.list:
        for scenario_name, module in SCENARIOS.items():
            print(f"{scenario_name:<20} {importlib.import_module(module).DESCRIPTION}")
        return 0
    launch = LaunchConfig(**given_settings(args, LaunchConfig))
    training_launch = TrainingLaunchConfig(**given_settings(args, TrainingLaunchConfig))
    if training:
        try:
            out, resume_from, folder_notes = slime_flags.run_folder(args, launch.out, training_launch.resume)
        except ValueError as err:
            return _refuse(err)
        launch = dataclasses.replace(launch, out=out)
        training_launch = dataclasses.replace(training_launch, resume=resume_from)
        backend = getattr(args, "rollout_backend", None) or scenario.defaults().rollout.rollout_backend
        for note in [*folder_notes, *slime_flags.wandb_notes(args), *slime_flags.colocate_notes(args, backend)]:
            print(f"note: {note}", file=sys.stderr, flush=True)
    configure(launch.log_level)
    resume = training_launch.resume is not None
    run_dir = training_launch.resume or launch.out or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        if resume:
            _check_resumable(run_dir, getattr(args, "steps", None))
        else:
            _check_unused(run_dir)
    except ValueError as err:
        return _refuse(err)
    if training and (training_launch.dry_run or training_launch.dry_run_gpus is not None):
        return _dry_run(scenario, args, training_launch, run_dir)
    print(f"vime {name}: {scenario.DESCRIPTION}; run folder {run_dir}", flush=True)
    try:
        if training:
            return _train(name, scenario, args, launch, training_launch, run_dir)
        figures = trio.run(scenario.run, run_dir, launch.transport, lambda line: print(f"  {line}", flush=True))
    except BaseException as err:  # Ctrl-C, maybe inside the job's exception group; anything else goes on up
        if not _interrupted(err):
            raise
        then = f"\n{_how_to_continue(name, run_dir)}" if training else ""
        print(f"\ninterrupted; run folder {run_dir}{then}", file=sys.stderr, flush=True)
        return 130
    print("PASSED" if figures["passed"] else "FAILED", flush=True)
    return 0 if figures["passed"] else 1


def _train(name: str, scenario: ModuleType, args: argparse.Namespace, launch: LaunchConfig,
           training_launch: TrainingLaunchConfig, run_dir: Path) -> int:
    """Prepare and run a training scenario; the exit status. A run refused before any actor starts leaves
    RUN_DIR as it found it, so that the corrected command may use the same --out."""
    from vime.pipeline import Refused, RunFailed, make_run_folder, progress_display, train
    from vime.startup import command_started

    resume = training_launch.resume is not None
    undo = None if resume else _undoer(run_dir)
    try:
        recorded = training_launch.recorded_roles()
        tls = launch.tls()
        make_run_folder(run_dir)
        config = (from_flags(args, _saved_config(run_dir)) if resume
                  else scenario.prepare(run_dir, from_flags(args, scenario.defaults())))
    except ValueError as err:
        return _refuse(err, undo)
    if getattr(args, "kl_coef", None):  # a run with ppo or reinforce++ would otherwise take it in the new meaning
        print("note: --kl-coef is the KL penalty folded into the reward (slime's meaning); the KL term in the loss, "
              "which vime's --kl-coef set before issue 31, is --kl-loss-coef", flush=True)
    if config.eval.eval_every and not config.eval.eval_data:
        print("no --eval-data: held-out evaluation is off", flush=True)
    display = progress_display(config.job.steps)
    try:
        summary = trio.run(lambda: train(config, run_dir, record=recorded, transport=launch.transport,
                                         show=display, resume=resume, host=launch.host, tls=tls,
                                         model_flags=megatron_flags.given(args), port=launch.port,
                                         token=_given_token(launch.transport), launched_at=command_started(),
                                         show_startup=display.startup))
    except Refused as err:  # before any actor started
        return _refuse(err, undo)
    except RunFailed as err:
        print(f"run failed: {err}", file=sys.stderr)
        return 1
    finally:
        display.close()
    print(json.dumps({k: summary[k] for k in ("raw_reward_last10_mean", "first_step_reward_0.9",
                                              "seconds_to_reward_0.9", "max_train_rollout_logprob_abs_diff",
                                              "total_s")}), flush=True)
    print(f"metrics: {run_dir / 'metrics.jsonl'}  report: {run_dir / 'report.png'}", flush=True)
    return 0


def _given_token(transport: str) -> str | None:
    """The join token a launcher chose for this job (``vime.launch`` exports it to the driver and its nodes as
    $VIME_TOKEN, off every command line); None: the driver makes one. An ipc job takes no joins."""
    return os.environ.get("VIME_TOKEN") or None if transport != "ipc" else None


def _dry_run(scenario: ModuleType, args: argparse.Namespace, training_launch: TrainingLaunchConfig,
             run_dir: Path) -> int:
    """``--dry-run``: resolve the settings as the run would, check what its preflight checks (reading the model's
    config.json and tokenizer, not its weights), place the processes on this host's GPUs or on
    ``--dry-run-gpus N``, print the resolved config (JSON) and the placement; 0, or 2 with what the run would
    refuse. Nothing is written: no run folder, and a scenario that builds its model (arithmetic without
    --model-path) only says what it would build."""
    from vime.pipeline import check_reward, preflight
    from vime.placement import describe

    resume = training_launch.resume is not None
    try:
        if not training_launch.dry_run:
            raise ValueError("--dry-run-gpus plans a --dry-run; add --dry-run")
        if (training_launch.dry_run_gpus or 0) < 0:
            raise ValueError(f"--dry-run-gpus {training_launch.dry_run_gpus}: pass a GPU count, 0 or more")
        training_launch.recorded_roles()
        config = from_flags(args, _saved_config(run_dir) if resume else scenario.defaults())
        builds = None if resume or config.model.model_path else getattr(scenario, "BUILDS", None)
        if builds is None and not resume:
            config = scenario.prepare(run_dir, config)  # one that would build its model has said so instead
        gpus = None if training_launch.dry_run_gpus is None else [str(i) for i in range(training_launch.dry_run_gpus)]
        placed, row = preflight(config, gpus, weights=False, model=builds is None,
                                model_flags=megatron_flags.given(args))
        trio.run(check_reward, config, row)
        config = config.replace(rollout_workers=len(placed.engines))  # as the run records it
        lines = describe(config, placed)
    except ValueError as err:
        return _refuse(err)
    print(json.dumps(config.to_dict(), indent=2, default=str))
    host = (f"a host with {training_launch.dry_run_gpus} GPUs (--dry-run-gpus)" if gpus is not None
            else "this host's GPUs")
    print(f"placement on {host}:")
    for line in lines:
        print(f"  {line}")
    if builds is not None:
        print(f"model: none given; the run would build {builds} in {run_dir / 'model'} (not built by --dry-run, "
              "so what needs the model folder was not checked)")
    print(f"dry run: nothing started, no run folder made (the run would write {run_dir})", flush=True)
    return 0


# What every run writes as it starts (its settings, its actors' list and logs), and what it leaves: a folder
# holding any of them holds a run. Other files (a launcher's own log, say) may be there.
RUN_FILES = ("config.json", "actors.json", "logs", "metrics.jsonl", "checkpoints")


def _check_unused(run_dir: Path) -> None:
    """A new run's folder must not hold an earlier run: the new one would write over its metrics and summary
    and mix its logs and checkpoints with the old. ValueError saying what to do instead."""
    held = sorted(path.name for path in run_dir.iterdir()) if run_dir.is_dir() else []
    if not set(held) & set(RUN_FILES):
        return
    then = (f"continue that run with --resume {run_dir}, " if (run_dir / "config.json").is_file() else "")
    raise ValueError(f"--out {run_dir} holds an earlier run ({', '.join(held[:5])}{' ...' if len(held) > 5 else ''}"
                     f"); {then}pass a new folder, or remove this one first")


def _check_resumable(run_dir: Path, steps: int | None) -> None:
    """Refuse to resume a run that finished (it has summary.json for all its steps) unless ``--steps`` asks
    for more: resuming would train again the steps after its last checkpoint and replace its results.
    With more steps, say what will be replaced."""
    from vime import checkpoint  # torch comes with it: not for --help

    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return
    done = json.loads(summary_path.read_text()).get("steps", 0)
    if done < _saved_config(run_dir).job.steps:
        return  # a resumed run that died after it asked for more steps
    saved = checkpoint.latest(run_dir)
    start = checkpoint.step_of(saved) if saved else 0
    if steps is None or steps <= done:
        raise ValueError(f"--resume {run_dir}: that run finished its {done} steps (see its summary.json); "
                         f"resuming it would train steps {start + 1} to {done} again from its last checkpoint "
                         "and overwrite metrics.jsonl and summary.json. To train it further, add --steps N with N "
                         f"over {done}; to start again, pass a new --out")
    print(f"resuming the finished run {run_dir} to {steps} steps from its checkpoint of step {start}: steps "
          f"{start + 1} to {done} are trained again and replace their rows in metrics.jsonl; summary.json and "
          "report.png are rewritten at the end", flush=True)


def _interrupted(error: BaseException) -> bool:
    """Ctrl-C, alone or inside an exception group (trio's nurseries wrap what ends them)."""
    if isinstance(error, BaseExceptionGroup):
        return error.subgroup(KeyboardInterrupt) is not None
    return isinstance(error, KeyboardInterrupt)


def _how_to_continue(name: str, run_dir: Path) -> str:
    """The command that continues an interrupted run, or why there is none."""
    from vime import checkpoint

    saved = checkpoint.latest(run_dir) if run_dir.is_dir() else None
    if saved is None:
        return "no checkpoint was written (--save-every N writes them), so it cannot be resumed; start it again"
    command = shlex.join([sys.executable, "-m", "vime.scenario", name, "--resume", str(run_dir)])
    return f"continue it from the checkpoint of step {checkpoint.step_of(saved)} with:\n  {command}"


def _saved_config(run_dir: Path) -> RunConfig:
    """The settings a run was started with, from RUN_DIR/config.json."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"--resume {run_dir}: no config.json there; is it a vime run folder?")
    return RunConfig.from_dict(json.loads(path.read_text()))


def _refuse(error: ValueError, undo: Callable[[], None] | None = None) -> int:
    """Say why the run is refused; exit status 2. ``undo`` takes back what this command wrote in the run folder,
    since nothing ran in it."""
    if undo is not None:
        undo()
    print(f"python -m vime.scenario: {error}", file=sys.stderr)
    return 2


def _undoer(run_dir: Path) -> Callable[[], None]:
    """What puts ``run_dir`` back as it is now: removed if it does not exist yet, else only what is added to it
    is removed."""
    before = {path.name for path in run_dir.iterdir()} if run_dir.is_dir() else None

    def undo() -> None:
        if before is None:
            shutil.rmtree(run_dir, ignore_errors=True)
            return
        for path in run_dir.iterdir():
            if path.name in before:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    return undo


if __name__ == "__main__":
    sys.exit(main())
