"""Entry points as a user runs them, and the public surface."""

from __future__ import annotations

import json
import subprocess
import sys

import vime


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_help_of_every_entry_point():
    for module in ("vime.actor", "vime.replay", "vime.scenario", "vime.inject", "vime.devtools.make_tiny_model"):
        result = run(module, "--help")
        assert result.returncode == 0 and "usage: python -m " + module in result.stdout


def test_scenario_list():
    result = run("vime.scenario", "--list")
    assert result.returncode == 0 and [line.split()[0] for line in result.stdout.splitlines()] == [
        "arithmetic", "qwen3_4b_gsm8k", "qwen3_4b_gsm8k_tools", "qwen3_30b_a3b_dapo", "glm45_air_dapo", "selfcheck"]


def test_training_flags_come_from_the_settings():
    result = run("vime.scenario", "arithmetic", "--help")
    assert result.returncode == 0
    for flag in ("--algo", "--steps", "--seed", "--rollout-workers", "--record", "--max-staleness",
                 "--no-normalize-std", "--kl-estimator", "--custom-reward", "--custom-rollout"):
        assert flag in result.stdout
    bad = run("vime.scenario", "arithmetic", "--rollout-batch-size", "many")
    assert bad.returncode == 2 and "invalid int value" in bad.stderr


def test_selfcheck_scenario_runs(tmp_path):
    result = run("vime.scenario", "selfcheck", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout and "no divergence" in result.stdout
    figures = json.loads((tmp_path / "run" / "selfcheck.json").read_text())
    assert figures["passed"] and figures["death_noticed_s"] < 5


def test_unknown_role_says_what_exists():
    result = run("vime.actor", "nosuchrole", "--join", "tcp://127.0.0.1:9")
    assert result.returncode != 0 and "built-in roles" in result.stderr


def test_public_api_is_stable():
    assert sorted(vime.__all__) == [
        "Actor", "ActorEvent", "ActorInfo", "ActorSettings", "Cluster", "Envelope", "PeerGone", "RemoteError",
        "handles", "message",
    ]
    for name in vime.__all__:
        assert getattr(vime, name) is not None


def test_every_package_folder_is_installed():
    """A wheel (not only an editable install) must carry every subpackage."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {f"vime.{path.parent.name}" for path in (root / "vime").glob("*/__init__.py")}
    folders |= set(config["package-dir"])  # vime, and the top-level folders installed as vime.*
    assert folders <= listed, f"add {sorted(folders - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_reading_the_config_imports_no_torch():
    """The command line is parsed, and config.json read, before any engine: vime.config must not pull torch
    (torch.distributed with it) through the backends or the runtime."""
    probe = ("import sys, vime.config, vime.settings; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout[:500] + result.stderr[-500:]


def test_choices_come_from_the_settings_types():
    import argparse
    import typing

    import pytest

    from vime.algorithms.config import PolicyLossConfig
    from vime.config import ModelConfig, RunConfig, add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser, RunConfig())
    choices = {action.dest: action.choices for action in parser._actions if action.choices}
    assert choices["dtype"] == ("fp32", "bf16") and choices["weight_sync"] == ("auto", "nng", "ipc", "broadcast")
    assert choices["algo"] == typing.get_args(typing.get_type_hints(type(RunConfig().job))["algo"])
    assert {"rollout_backend", "train_backend", "lr_schedule", "loss_aggregation", "kl_estimator", "tis_level",
            "policy_loss", "ratio_level", "off_policy_correction"} <= set(choices)
    with pytest.raises(ValueError, match="--dtype must be one of fp32, bf16, not 'fp16'"):
        ModelConfig(dtype="fp16")  # set in code or read from config.json: the same list refuses it
    with pytest.raises(ValueError, match="--tis-level must be one of token, sequence-geometric, sequence-product"):
        PolicyLossConfig(tis_level="group")


def test_every_actor_setting_is_a_flag():
    """vime.actor's flags are ActorSettings' fields: a field added there is a flag at once, and --settings
    takes any field (a flag of the same field wins), with no list of which fields are whose kept by hand."""
    import dataclasses
    import os

    import pytest

    from vime.actor import ActorLaunch, _parser, _settings
    from vime.runtime import ActorSettings
    from vime.settings import flags_of, given_settings

    parser = _parser()
    spelled = {option for action in parser._actions for option in action.option_strings}
    assert {flags_of(field)[0] for field in dataclasses.fields(ActorSettings)} <= spelled
    assert {"--join", "--exit-with-parent", "--inbox-capacity", "--seed", "--tls-ca"} <= spelled
    args = parser.parse_args(["echo", "--join", "ipc:///tmp/driver", "--listen", "ipc:///tmp/me", "--record",
                              "--inbox-capacity", "64", "--exit-with-parent",
                              "--settings", '{"seed": 3, "inbox_capacity": 8, "heartbeat_s": 0.5}'])
    settings = _settings(args, ActorLaunch(**given_settings(args, ActorLaunch)), "echo")
    assert (settings.driver, settings.record, settings.seed) == ("ipc:///tmp/driver", True, 3)
    assert settings.heartbeat_s == 0.5
    assert settings.inbox_capacity == 64 and settings.parent_pid == os.getppid() and settings.name.startswith("echo-")
    with pytest.raises(SystemExit, match=r"unknown field\(s\) \['inbox'\]"):
        _settings(args, ActorLaunch(settings='{"inbox": 8}'), "echo")


def test_launch_flags_come_from_the_launch_settings():
    result = run("vime.scenario", "arithmetic", "--help")
    for flag in ("--transport {ipc,tcp,tls+tcp}", "--resume RUN_DIR", "--record, --no-record", "--tls-cert-key",
                 "--host", "--out", "--log-level"):
        assert flag in result.stdout, flag
    bad = run("vime.scenario", "selfcheck", "--transport", "udp")
    assert bad.returncode == 2 and "--transport: invalid choice: 'udp'" in bad.stderr
    assert "--resume" not in run("vime.scenario", "selfcheck", "--help").stdout  # a training flag only
