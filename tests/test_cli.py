"""Entry points as a user runs them, and the public surface."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import vime


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_help_of_every_entry_point():
    for module in ("vime.actor", "vime.replay", "vime.scenario", "vime.inject", "vime.launch",
                   "vime.devtools.make_tiny_model"):
        result = run(module, "--help")
        assert result.returncode == 0 and "usage: python -m " + module in result.stdout


def test_scenario_list():
    result = run("vime.scenario", "--list")
    assert result.returncode == 0 and [line.split()[0] for line in result.stdout.splitlines()] == [
        "arithmetic", "qwen3_4b_gsm8k", "qwen3_4b_gsm8k_tools", "qwen3_30b_a3b_dapo", "glm45_air_dapo", "selfcheck",
        "slime"]


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


# every actor's entry point, the driver's supervisor, the actors that carry no tensors (the self-check's echo and
# tally too, which the runtime's tests spawn by the dozen) and the replay, which reads any actor's log
TORCH_FREE = ("vime.actor", "vime.cluster", "vime.actors.router", "vime.actors.reward", "vime.scenarios.selfcheck",
              "vime.replay")

# A scored group as the reward actor sends it and the buffer reads it: its samples declare a tensor field.
_SCORED_GROUP_ROUND_TRIP = """
from vime.messages.pipeline import Sample, ScoredGroup
from vime.transports.codec import Envelope, decode_frame, encode, encode_frame
sample = Sample(group_id=0, index=0, prompt_ids=[1], response_ids=[2], logprobs=[-0.5], versions=[0],
                finish_reason="stop", label="3", metadata={})
group = ScoredGroup(group_id=0, samples=[sample], worker="w", generate_s=0.1, finished_at=0.0, reward_s=0.2)
frame = encode_frame("ipc://x", None, [encode(Envelope("ScoredGroup", "reward", "buffer", 1, None, 0.0, 0, False,
                                                       group))])
assert decode_frame(frame, max_message_bytes=1 << 20).messages[0].payload == group
"""


def test_actors_that_carry_no_tensors_import_no_torch():
    """An actor's entry point, the driver's cluster, the router and the reward actor import no torch, nor does
    a message whose records merely declare a tensor field (a Sample's routed experts) as it travels: torch's
    import costs each process over a second of start-up, on every run and in every test that starts actors."""
    probe = ("import importlib, sys\n"
             f"for name in {TORCH_FREE!r}:\n"
             "    importlib.import_module(name)\n"
             "    assert 'torch' not in sys.modules, f'importing {name} imported torch'\n"
             + _SCORED_GROUP_ROUND_TRIP
             + "assert 'torch' not in sys.modules, 'a scored group imported torch on its way'\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


def test_choices_come_from_the_settings_types():
    import argparse
    import typing

    import pytest

    from vime.algorithms.config import PolicyLossConfig
    from vime.config import ModelConfig, RunConfig, add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser, RunConfig())
    choices = {action.dest: action.choices for action in parser._actions if action.choices}
    assert choices["dtype"] == ("fp32", "bf16")
    assert choices["weight_sync"] == ("auto", "nng", "ipc", "broadcast", "nng-delta")
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
    for flag in ("--transport {ipc,tcp,tls+tcp}", "--resume RUN_DIR", "--record [ROLES]", "--tls-cert-key",
                 "--host", "--out", "--log-level"):
        assert flag in result.stdout, flag
    bad = run("vime.scenario", "selfcheck", "--transport", "udp")
    assert bad.returncode == 2 and "--transport: invalid choice: 'udp'" in bad.stderr
    assert "--resume" not in run("vime.scenario", "selfcheck", "--help").stdout  # a training flag only


SMALL = ("--steps", "3", "--rollout-batch-size", "4", "--max-new-tokens", "2")


def scenario_run(*flags: str, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vime.scenario", "arithmetic", *flags], capture_output=True,
                          text=True, timeout=timeout, env=env)


def with_plugins(tmp_path, source: str) -> dict[str, str]:
    """An environment in which ``plugins`` (written from ``source``) imports, as a user's reward module."""
    import os
    import textwrap

    (tmp_path / "plugins.py").write_text(textwrap.dedent(source))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))


def test_ctrl_c_ends_quietly_with_the_run_folder_and_the_resume_command(tmp_path):
    """Ctrl-C at the terminal (SIGINT to the whole foreground group) mid-run: no traceback, the run folder and
    the command that resumes it, exit 130. Before: a 55-line traceback, no command."""
    import os
    import shlex
    import signal
    import time

    from vime import checkpoint

    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "vime.scenario", "arithmetic", "--out", str(run_dir),
                                "--steps", "200", "--rollout-batch-size", "4", "--save-every", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in process.stdout:
            if line.startswith("step "):
                break
        deadline = time.monotonic() + 60
        while checkpoint.latest(run_dir) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, out + err
    assert "Traceback" not in out + err and len(err.splitlines()) <= 6, err
    assert f"run folder {run_dir}" in err
    command = shlex.split(err.strip().splitlines()[-1])
    assert command == [sys.executable, "-m", "vime.scenario", "arithmetic", "--resume", str(run_dir)], err


def test_an_out_folder_in_use_is_refused_and_a_refused_run_leaves_the_folder_as_it_found_it(tmp_path):
    """An earlier run's folder is not written over (its logs and checkpoints would mix with the new run's): exit
    2 naming it and what to do. Before: the run went ahead in it. A folder with other files only is used."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.json").write_text("{}")
    result = scenario_run("--out", str(used), *SMALL)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"--out {used} holds an earlier run (config.json)" in result.stderr and f"--resume {used}" in result.stderr
    assert sorted(path.name for path in used.iterdir()) == ["config.json"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "launcher.log").write_text("")
    refused = scenario_run("--out", str(other), *SMALL, "--reward", "nope")  # after its model is built
    assert refused.returncode == 2 and "not a built-in reward" in refused.stderr, refused.stderr[-500:]
    assert [path.name for path in other.iterdir()] == ["launcher.log"]


def test_resuming_a_finished_run_is_refused_unless_more_steps_are_asked(tmp_path):
    """--resume of a run that ended would train again the steps after its last checkpoint and overwrite its
    metrics and summary: refused (exit 2) saying so; with --steps beyond its end it says what it replaces.
    Before: it retrained silently."""
    from vime.config import RunConfig

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(RunConfig().replace(steps=3).to_dict()))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 3}))
    (run_dir / "metrics.jsonl").write_text("kept\n")
    result = scenario_run("--resume", str(run_dir))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"--resume {run_dir}: that run finished its 3 steps" in result.stderr
    assert "add --steps N with N over 3" in result.stderr
    assert (run_dir / "metrics.jsonl").read_text() == "kept\n"
    further = scenario_run("--resume", str(run_dir), "--steps", "5")
    assert f"resuming the finished run {run_dir} to 5 steps" in further.stdout, further.stdout + further.stderr


def test_a_reward_returning_none_nan_or_a_string_is_refused_before_any_actor_starts(tmp_path):
    """The custom reward is called once, as the reward actor calls it, before anything starts: exit 2 naming the
    function and its value. Before: the reward actor died mid-run, exit 1."""
    env = with_plugins(tmp_path, """
        def gives_none(response, label, **metadata):
            return None

        def gives_nan(response, label, **metadata):
            return float("nan")

        def gives_text(response, label, **metadata):
            return "1.0"
        """)
    for function, value in [("gives_none", "None"), ("gives_nan", "nan"), ("gives_text", "'1.0'")]:
        out = tmp_path / function
        result = scenario_run("--out", str(out), *SMALL, "--custom-reward", f"plugins:{function}", env=env)
        assert result.returncode == 2, result.stdout + result.stderr[-800:]
        assert f"reward function '{function}' returned {value}; it must return a finite float" in result.stderr
        assert not out.exists()  # refused before anything was left in it


def test_a_reward_that_raises_mid_run_puts_its_message_on_the_console(tmp_path):
    env = with_plugins(tmp_path, """
        class GraderDown(Exception):
            pass

        def flaky(response, label, **metadata):
            if response.strip() != label.strip():
                raise GraderDown("the grading service at grader:9000 is down")
            return 1.0
        """)
    result = scenario_run("--out", str(tmp_path / "run"), *SMALL, "--custom-reward", "plugins:flaky",
                          env=env)
    assert result.returncode == 1, result.stdout + result.stderr[-800:]
    assert "GraderDown: the grading service at grader:9000 is down" in result.stderr, result.stderr[-800:]


async def test_the_join_file_runs_as_written_and_the_summary_counts_workers_and_refused_joins(tmp_path):
    """RUN_DIR/join, run as it stands on a host with vime installed, adds a worker: the installed vime-actor
    (not ``python -m``, which a system python cannot run) and the token from the environment, never on a
    command line. The same with a wrong token is refused and counted in summary.json, beside each worker's
    groups; the trailing reward is named for what it is. Before: ``python -m vime.actor ... --token T``, and
    neither count."""
    import os
    from pathlib import Path

    import trio

    from vime.pipeline import train
    from vime.scenarios import arithmetic

    run_dir = tmp_path / "run"
    config = arithmetic.prepare(run_dir, arithmetic.defaults().replace(steps=4, rollout_batch_size=4,
                                                                        max_new_tokens=2))
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    seen: dict[str, object] = {}

    async def join(job, row) -> None:
        if seen:
            return
        text = (run_dir / "join").read_text()
        seen["text"], seen["token"] = text, job.token
        with open(tmp_path / "joined.log", "wb") as log:
            seen["joined"] = await trio.lowlevel.open_process(["sh", str(run_dir / "join")], env=env, stdout=log,
                                                              stderr=log)
        seen["refused"] = await trio.run_process(["sh", "-c", text.replace(job.token, "0" * 32)], env=env,
                                                 capture_stdout=True, capture_stderr=True, check=False)
        with trio.fail_after(90):
            while not [e for e in job.events if e.what == "joined" and e.name.startswith("rollout-")
                       and e.name != "rollout-0"]:
                await trio.sleep(0.1)

    try:
        summary = await train(config, run_dir, transport="tcp", on_step=join, timeout_s=300)
    finally:
        joined = seen.get("joined")
        if joined is not None and joined.returncode is None:
            with trio.move_on_after(30):  # the job's end stops it
                await joined.wait()
            joined.kill()
    text = seen["text"]
    assert "--token" not in text and "python" not in text and "\nvime-actor rollout --join tcp://" in text, text
    assert f"\nexport VIME_TOKEN={seen['token']}\n" in text
    refused = seen["refused"]
    assert refused.returncode == 2 and b"join refused" in refused.stderr, refused.stderr[-500:]
    assert joined.returncode == 0, (tmp_path / "joined.log").read_text()[-2000:]
    assert summary["refused_joins"] == 1
    workers = summary["workers"]
    assert "rollout-0" in workers and workers["rollout-0"]["groups"] > 0
    assert abs(sum(worker["share"] for worker in workers.values()) - 1) < 1e-9
    assert sum(worker["groups"] for worker in workers.values()) >= summary["groups"]["trained"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["raw_reward_last10_mean"] == sum(row["raw_reward"] for row in rows) / len(rows)
    assert "final_raw_reward" not in summary


def test_steps_count_from_one_on_the_console_in_metrics_and_in_checkpoints(tmp_path):
    """One convention: step N is the Nth step, which publishes weight version N; its checkpoint is step_N.
    Before: the console said "step 1/3" of the row metrics.jsonl called step 0."""
    from vime import checkpoint

    run_dir = tmp_path / "run"
    result = scenario_run("--out", str(run_dir), *SMALL, "--save-every", "2")
    assert result.returncode == 0, result.stdout + result.stderr[-800:]
    shown = [int(line.split()[1].split("/")[0]) for line in result.stdout.splitlines() if line.startswith("step ")]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert shown == [1, 3] and [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["weight_version"] == row["step"] for row in rows)
    assert checkpoint.step_of(checkpoint.latest(run_dir)) == 2


def test_the_start_up_breakdown_is_on_the_console_and_in_the_summary(tmp_path):
    """Where the start-up goes (issue 36): from the command to the first step, the driver's own phases, each
    actor's spawn until it registered, the engine builds as the trainer and each rollout worker timed them, the
    first step's own time, and their sum beside the wall time; printed as the first step comes, and in
    summary.json beside ``startup_s``."""
    run_dir = tmp_path / "run"
    result = scenario_run("--out", str(run_dir), *SMALL)
    assert result.returncode == 0, result.stdout + result.stderr[-800:]
    summary = json.loads((run_dir / "summary.json").read_text())
    startup = summary["startup"]
    workers = [f"rollout-{index}" for index in
               range(json.loads((run_dir / "config.json").read_text())["rollout"]["rollout_workers"])]
    driver = ("command_s", "preflight_s", "cluster_open_s", "wait_for_nodes_s")
    assert list(startup) == [*driver, "spawn_s", "engine_build_s", "step_time_s", "phases_sum_s", "first_step_s"]
    assert list(startup["spawn_s"]) == ["router", "reward", "trainer", "buffer", *workers]
    assert list(startup["engine_build_s"]) == ["trainer", *workers]  # reported by the actors themselves
    first = startup["first_step_s"]
    assert all(startup[phase] >= 0 for phase in driver) and startup["command_s"] > 0  # imports count
    assert all(0 < seconds <= first for seconds in [*startup["spawn_s"].values(), *startup["engine_build_s"].values()])
    # the driver's phases and the first four spawns run one after another, before any step
    in_series = sum(startup[phase] for phase in driver) + sum(startup["spawn_s"][role] for role in
                                                               ("router", "reward", "trainer", "buffer"))
    assert in_series < first
    assert 0 < startup["step_time_s"] < first
    parts = [startup[phase] for phase in (*driver, "step_time_s")] + [
        seconds for phase in ("spawn_s", "engine_build_s") for seconds in startup[phase].values()]
    assert startup["phases_sum_s"] == pytest.approx(sum(parts))
    assert summary["startup_s"] is not None  # kept for what reads it
    lines = result.stdout.splitlines()
    head = next(index for index, line in enumerate(lines) if line.startswith("start-up: "))
    assert lines[head - 1].startswith("step 1/3") and lines[head + 8].startswith("step 3/3"), result.stdout
    assert f"first step {first:.1f} s after the command; phases sum to {startup['phases_sum_s']:.1f} s" in lines[head]
    built = next(line for line in lines[head:head + 8] if line.split()[:2] == ["engine", "build"])
    assert built.split()[2:] == [word for name, seconds in startup["engine_build_s"].items()
                                 for word in (name, f"{seconds:.2f}")]


def test_an_error_after_the_run_does_not_take_its_folder_back(tmp_path, monkeypatch):
    """Only a run refused before anything started is undone: a ValueError from after the training (a torn
    line read for the summary, a report that cannot be drawn) once made the refusal path remove the finished
    run's metrics, logs and checkpoints -- the whole folder for a new --out."""
    import vime.pipeline
    from vime import scenario

    def broken_report(*args, **kwargs):
        raise ValueError("the report could not be drawn")

    monkeypatch.setattr(vime.pipeline, "write_report", broken_report)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="the report could not be drawn"):
        scenario.main(["--out", str(out), *SMALL])
    assert (out / "metrics.jsonl").is_file() and (out / "summary.json").is_file() and (out / "logs").is_dir()
