"""``python -m vime.scenario [NAME]``: run a named scenario (the default when NAME is omitted).

Scenarios live in ``vime.scenarios``, one module each, listed with ``--list``.
A training scenario supplies defaults for every setting; each setting is
also a flag (``--lr``, ``--rollout-batch-size``, ``--advantage-estimator rloo`` ...), shown by
``python -m vime.scenario NAME --help``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import trio

from vime.config import LaunchConfig, RunConfig, TrainingLaunchConfig, add_flags, engine_flags, from_flags
from vime.logs import configure
from vime.settings import add_setting_flags, given_settings

SCENARIOS = {name: f"vime.scenarios.{name}" for name in (
    "arithmetic", "qwen3_4b_gsm8k", "qwen3_4b_gsm8k_tools", "qwen3_30b_a3b_dapo", "glm45_air_dapo", "selfcheck")}
DEFAULT = "arithmetic"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv and not argv[0].startswith("-") else DEFAULT  # the name comes first: flags take values
    if name not in SCENARIOS:
        print(f"unknown scenario {name!r}; python -m vime.scenario --list shows them", file=sys.stderr)
        return 2
    scenario = importlib.import_module(SCENARIOS[name])
    training = hasattr(scenario, "defaults")
    parser = argparse.ArgumentParser(prog="python -m vime.scenario", usage="%(prog)s [NAME] [--flag VALUE ...]",
                                     description=scenario.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default=DEFAULT, help=f"scenario name (default: {DEFAULT})")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    add_setting_flags(parser.add_argument_group("launch"), LaunchConfig)
    if training:
        add_setting_flags(parser.add_argument_group("launch a training run"), TrainingLaunchConfig)
        add_flags(parser, scenario.defaults())
    engine, argv = engine_flags(argv) if training else ({}, argv)  # before argparse, which cannot know their names
    args = parser.parse_args(argv)
    vars(args).update(engine)
    if args.list:
        for scenario_name, module in SCENARIOS.items():
            print(f"{scenario_name:<20} {importlib.import_module(module).DESCRIPTION}")
        return 0
    launch = LaunchConfig(**given_settings(args, LaunchConfig))
    training_launch = TrainingLaunchConfig(**given_settings(args, TrainingLaunchConfig))
    configure(launch.log_level)
    resume = training_launch.resume is not None
    run_dir = training_launch.resume or launch.out or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"vime {name}: {scenario.DESCRIPTION}; run folder {run_dir}", flush=True)
    if not training:
        figures = trio.run(scenario.run, run_dir, launch.transport, lambda line: print(f"  {line}", flush=True))
        print("PASSED" if figures["passed"] else "FAILED", flush=True)
        return 0 if figures["passed"] else 1
    from vime.pipeline import RunFailed, make_run_folder, progress_display, train

    try:
        make_run_folder(run_dir)
        config = (from_flags(args, _saved_config(run_dir)) if resume
                  else scenario.prepare(run_dir, from_flags(args, scenario.defaults())))
    except ValueError as err:
        return _refuse(err)
    if getattr(args, "kl_coef", None):  # a run with ppo or reinforce++ would otherwise take it in the new meaning
        print("note: --kl-coef is the KL penalty folded into the reward (slime's meaning); the KL term in the loss, "
              "which vime's --kl-coef set before issue 31, is --kl-loss-coef", flush=True)
    if config.eval.eval_every and not config.eval.eval_data:
        print("no --eval-data: held-out evaluation is off", flush=True)
    display = progress_display(config.job.steps)
    try:
        summary = trio.run(lambda: train(config, run_dir, record=training_launch.record, transport=launch.transport,
                                         show=display, resume=resume, host=launch.host, tls=launch.tls()))
    except ValueError as err:  # train's preflight: raised before any actor starts
        return _refuse(err)
    except RunFailed as err:
        print(f"run failed: {err}", file=sys.stderr)
        return 1
    finally:
        display.close()
    print(json.dumps({k: summary[k] for k in ("final_raw_reward", "first_step_reward_0.9", "seconds_to_reward_0.9",
                                              "max_train_rollout_logprob_abs_diff", "total_s")}), flush=True)
    print(f"metrics: {run_dir / 'metrics.jsonl'}  report: {run_dir / 'report.png'}", flush=True)
    return 0


def _saved_config(run_dir: Path) -> RunConfig:
    """The settings a run was started with, from RUN_DIR/config.json."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"--resume {run_dir}: no config.json there; is it a vime run folder?")
    return RunConfig.from_dict(json.loads(path.read_text()))


def _refuse(error: ValueError) -> int:
    print(f"python -m vime.scenario: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
