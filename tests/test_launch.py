"""``python -m vime.launch``: the sbatch script (quoting, the head and the agents, a token made per job), the
Kubernetes objects (checked against the Kubernetes schema where kubernetes-validate is installed), and a real
one-node Slurm (Debian's slurmctld and slurmd, started here with a slurm.conf of the test's own) running the
default scenario to the end, where those binaries are installed and may run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from vime.launch import Scenario, driver_args, slurm

AWKWARD = "it's \"$HOME\" `date`; rm -rf /"  # a flag value a shell would otherwise split, expand or run


def _job(**changes) -> slurm.SlurmJob:
    values = dict(nodes=3, gpus_per_node=8, python="/opt/vime env/bin/python", job_name="vime-arithmetic",
                  scenario=Scenario.parse(["arithmetic", "--steps", "5", "--prompt-template", AWKWARD]),
                  partition="gpu", time="4:00:00", account="rl")
    return slurm.SlurmJob(**(values | changes))


def _launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vime.launch", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_sbatch_script_asks_for_the_nodes_and_runs_the_driver_on_the_head_and_agents_on_the_rest():
    text = slurm.script(_job())
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # the shell reads it
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=4:00:00", "#SBATCH --account=rl",
                 "#SBATCH --job-name=vime-arithmetic"):
        assert line in lines, line
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    driver = next(line for line in lines if line.startswith('"$python" -m vime.scenario'))
    words = shlex.split(driver.removesuffix(" &"))
    # the user's flags come back word for word, the awkward one unexpanded; the launcher's own follow
    assert words[:8] == ["$python", "-m", "vime.scenario", "arithmetic", "--steps", "5", "--prompt-template", AWKWARD]
    assert words[8:] == ["--transport", "tcp", "--rollout-nodes", "2", "--host", "$head_address", "--port", "$port",
                         "--out", "$run_dir"]
    assert "python='/opt/vime env/bin/python'" in lines
    agents = next(line for line in lines if "srun " in line)
    assert '--nodes=2 --ntasks=2 --ntasks-per-node=1 --exclude="$head"' in agents
    assert "-m vime.node --join" in agents and '"tcp://$head_address:$port"' in agents
    # the job's status is the driver's
    assert lines[-2:] == ['echo "vime: the driver exited with status $status"', 'exit "$status"']
    one = slurm.script(_job(nodes=1, gpus_per_node=0))
    assert "srun" not in one and "--rollout-nodes" not in one and "--gpus-per-node" not in one


@pytest.mark.parametrize("flags,rollout_nodes", [((), ["--rollout-nodes", "3"]),
                                                 (("--actor-num-nodes", "2"), ["--rollout-nodes", "2"]),
                                                 (("--actor-num-nodes=4",), []),
                                                 (("--rollout-nodes", "1"), [])])
def test_the_nodes_the_trainer_does_not_take_run_the_rollout_workers(flags, rollout_nodes):
    """A job of 4 nodes: the trainer takes the head and as many more as --actor-num-nodes says; the rollout
    workers go on the rest, unless the user said where; a trainer over more nodes than the job has is refused."""
    scenario = Scenario.parse(["arithmetic", *flags])
    assert driver_args(scenario, 4) == ["-m", "vime.scenario", "arithmetic", *flags, "--transport", "tcp",
                                        *rollout_nodes]
    with pytest.raises(ValueError, match="--actor-num-nodes 5 puts the trainer on more nodes than the job's --nodes "
                                         "4: pass --nodes 5 or more"):
        driver_args(Scenario.parse(["arithmetic", "--actor-num-nodes", "5"]), 4)


def test_the_token_is_made_as_each_job_starts_and_never_written_in_the_script():
    first, second = slurm.script(_job()), slurm.script(_job())
    assert first == second and not re.search(r"[0-9a-f]{32}", first)  # nothing secret in Slurm's copy
    make = f"python={shlex.quote(sys.executable)}; {slurm.MAKE_TOKEN}; echo $VIME_TOKEN"
    tokens = [subprocess.run(["bash", "-c", make], capture_output=True, text=True, check=True).stdout.strip()
              for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", token) for token in tokens) and tokens[0] != tokens[1]
    assert "export VIME_TOKEN" in first.splitlines()  # to the driver and, through srun, to the agents


def test_a_resumed_run_continues_in_its_folder_and_flags_the_launcher_sets_are_refused(tmp_path):
    resumed = slurm.script(_job(scenario=Scenario.parse(["arithmetic", "--resume", "runs/a b"])))
    assert f"run_dir={shlex.quote(str(Path('runs/a b').absolute()))}" in resumed.splitlines()
    assert '--out "$run_dir"' not in resumed and 'rm -f "$run_dir/join"' in resumed
    for flag, instead in (("--out", "--run-dir"), ("--port", "--port"), ("--transport", "tcp")):
        refused = _launch("slurm", "--nodes", "2", "--print", "--", "arithmetic", flag, "x")
        assert refused.returncode == 2 and f"{flag} is set by vime.launch" in refused.stderr, refused.stderr
        assert instead in refused.stderr
    unknown = _launch("slurm", "--nodes", "1", "--print", "--", "arithmetic; rm -rf /")
    assert unknown.returncode == 2 and "unknown scenario 'arithmetic; rm -rf /'" in unknown.stderr
    blank = _launch("slurm", "--nodes", "1", "--print", "--partition", "a b", "--", "arithmetic")
    assert blank.returncode == 2 and "#SBATCH lines cannot hold blanks" in blank.stderr
    printed = _launch("slurm", "--nodes", "2", "--print", "--run-dir", str(tmp_path / "run"), "--", "arithmetic")
    assert printed.returncode == 0 and f"run_dir={tmp_path / 'run'}" in printed.stdout


def test_kubernetes_objects_pass_the_schema_and_each_launch_has_its_own_token():
    validator = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra) checks the "
                                                                  "objects against the Kubernetes schema")
    yaml = pytest.importorskip("yaml")
    args = ("k8s", "--nodes", "3", "--gpus-per-node", "8", "--image", "registry.example/vime:1", "--pvc", "runs",
            "--", "arithmetic", "--prompt-template", AWKWARD)
    printed = [_launch(*args) for _ in range(2)]
    assert all(result.returncode == 0 for result in printed), printed[0].stderr
    objects = list(yaml.safe_load_all(printed[0].stdout))
    for item in objects:
        validator.validate(item, validator.latest_version(), strict=True)  # raises ValidationError
    secret, service, head, agents = objects
    assert [item["kind"] for item in objects] == ["Secret", "Service", "Job", "Job"]
    other_secret = next(yaml.safe_load_all(printed[1].stdout))
    assert re.fullmatch(r"[0-9a-f]{32}", secret["stringData"]["token"])
    assert secret["stringData"]["token"] != other_secret["stringData"]["token"]
    driver = head["spec"]["template"]["spec"]["containers"][0]
    assert driver["command"][:4] == ["python", "-m", "vime.scenario", "arithmetic"]
    # one word (no shell reads it), its $ doubled, as the kubelet reads $$ as $ and expands $(NAME)
    assert driver["command"][4:6] == ["--prompt-template", AWKWARD.replace("$", "$$")]
    assert "--rollout-nodes" in driver["command"] and "$(POD_IP)" in driver["command"]
    assert service["spec"]["selector"] == head["spec"]["template"]["metadata"]["labels"]
    assert agents["spec"]["completionMode"] == "Indexed" and agents["spec"]["completions"] == 2
    node = agents["spec"]["template"]["spec"]["containers"][0]
    assert f"tcp://{service['metadata']['name']}:29500" in node["command"]
    assert node["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert all("token" not in " ".join(c["command"]).lower() for c in (driver, node))  # in the environment only


@pytest.mark.slow
def test_the_driver_listens_on_the_port_and_with_the_token_a_launcher_gives(tmp_path):
    """What the launchers rely on, without a cluster: --port, and the token in $VIME_TOKEN."""
    port, token = _free_port(), "ab" * 16
    done = subprocess.run([sys.executable, "-m", "vime.scenario", "arithmetic", "--out", str(tmp_path / "run"),
                           "--transport", "tcp", "--port", str(port), "--steps", "1", "--rollout-batch-size", "4"],
                          env=dict(os.environ, VIME_TOKEN=token), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    join = (tmp_path / "run" / "join").read_text()
    assert f"--join tcp://127.0.0.1:{port}" in join and f"export VIME_TOKEN={token}\n" in join


# --------------------------------------------------------------------------- a real Slurm


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _node_names(nodes: int) -> list[str]:
    """One node: localhost, a name that resolves, as a real node's does. Several: n1, n2... (slurmctld refuses
    localhost beside them), whose names do not resolve, so that the test names the head's interface."""
    return ["localhost"] if nodes == 1 else [f"n{index}" for index in range(1, nodes + 1)]


def _slurm_conf(folder: Path, nodes: int, cpus: int) -> Path:
    """A cluster of ``nodes`` nodes on this host (one slurmd each, ``slurmd -N``, on ports of their own): no
    munge (auth/none, which Slurm 22.05 still ships), every file in ``folder``, processes tracked without cgroups
    (a container may not delegate them)."""
    (folder / "state").mkdir(parents=True)
    (folder / "spool").mkdir()
    names = _node_names(nodes)
    conf = folder / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=vimetest", "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/none", "CredType=cred/none",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}/%n",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        *(f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={_free_port()} "
          f"CPUs={cpus} State=UNKNOWN" for name in names),
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP", ""]))
    return conf


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


@pytest.fixture
def slurm_folder() -> Iterator[Path]:
    """A short folder for a Slurm's files: slurmstepd makes a Unix socket in its spool, and under an xdist
    worker's longer tmp_path that path passed the 108 bytes a socket's may have (the job never started)."""
    folder = Path(tempfile.mkdtemp(prefix="vime-slurm-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _slurm_on_this_host(folder: Path, nodes: int) -> Iterator[dict[str, str]]:
    """slurmctld and a slurmd per node, in the foreground (so that this test holds their processes), stopped
    whatever happens; the environment that points Slurm's commands at them. Skips saying why where they cannot
    run."""
    commands = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
    missing = [name for name in commands if shutil.which(name) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)}: install Debian's slurmctld and slurmd (.ci/run does) to test the "
                    "launcher against a real Slurm")
    if os.geteuid() != 0:
        pytest.skip("slurmd starts jobs as their user, which needs root; run as root to test against a real Slurm")
    conf = _slurm_conf(folder, nodes, len(os.sched_getaffinity(0)))
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = [subprocess.Popen(command, env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for command in (["slurmctld", "-D", "-i", "-f", str(conf)],
                               *(["slurmd", "-D", "-N", name, "-f", str(conf)] for name in _node_names(nodes)))]
    try:
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t %D"], env=env, capture_output=True, text=True)
            if state.stdout.strip() == f"idle {nodes}":
                break
            if time.monotonic() > deadline or any(daemon.poll() is not None for daemon in daemons):
                logs = "\n".join(f"{path.name}:\n{_tail(path)}" for path in sorted(folder.glob("*.log")))
                pytest.skip(f"a {nodes}-node Slurm did not start here (sinfo: {state.stdout.strip() or state.stderr})"
                            f"\n{logs}")
            time.sleep(1)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", str(os.geteuid())], env=env, capture_output=True)
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def _job_state(job_id: str, env: dict[str, str]) -> tuple[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", shown)
    code = re.search(r"ExitCode=(\S+)", shown)
    return (state.group(1) if state else "UNKNOWN"), (code.group(1) if code else "?")


def _submit_and_wait(env: dict[str, str], output: Path, *launch_args: str) -> tuple[str, str]:
    """Launch on the Slurm of ``env``, wait for the job to end; its state and exit code (``COMPLETED 0:0``), and
    its output (the driver's and, through srun, the agents')."""
    launched = _launch("slurm", "--time", "10", f"--sbatch-arg=--output={output}", *launch_args, env=env)
    assert launched.returncode == 0, launched.stderr
    job_id = re.search(r"submitted job (\d+)", launched.stdout).group(1)
    deadline = time.monotonic() + 300
    while (state := _job_state(job_id, env))[0] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job_id} still {state[0]} after 300 s"
        time.sleep(2)
    return f"{state[0]} {state[1]}", output.read_text(errors="replace") if output.exists() else "(no output)"


SMALL_RUN = ("--", "arithmetic", "--steps", "3", "--rollout-batch-size", "4")  # a minute or so on 2 cores


@pytest.mark.slow
def test_a_real_one_node_slurm_runs_the_default_scenario_to_the_end(tmp_path, slurm_folder):
    port = _free_port()
    run_dir = tmp_path / "run"
    with _slurm_on_this_host(slurm_folder, 1) as env:
        refused = _submit_and_wait(env, tmp_path / "refused.out", "--nodes", "1", "--run-dir",
                                   str(tmp_path / "refused"), "--", "arithmetic", "--rollout-batch-size", "many")
        state, log = _submit_and_wait(env, tmp_path / "run.out", "--nodes", "1", "--run-dir", str(run_dir),
                                      "--port", str(port), *SMALL_RUN)
    # the job's status is the driver's: 2 for a run refused, 0 for one that ran to the end
    assert refused[0] == "FAILED 2:0" and "vime: the driver exited with status 2" in refused[1], refused
    assert state == "COMPLETED 0:0" and "vime: the driver exited with status 0" in log, f"{state}\n{log}"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    join = (run_dir / "join").read_text()
    assert f"--join tcp://127.0.0.1:{port}" in join  # the driver listened where the script said
    assert re.search(r"export VIME_TOKEN=[0-9a-f]{32}\n", join)


@pytest.mark.slow
def test_a_real_two_node_slurm_puts_the_rollout_worker_on_the_node_agent_srun_started(tmp_path, slurm_folder):
    """Two slurmd on this host stand in for two hosts (their addresses are this host's loopback, which the
    script refuses beyond one node unless an interface is named: --head-interface lo): the script's srun starts
    the agent on n2 with the token made on the head (n1), and the driver places the rollout worker there."""
    run_dir = tmp_path / "run"
    with _slurm_on_this_host(slurm_folder, 2) as env:
        state, log = _submit_and_wait(env, tmp_path / "run.out", "--nodes", "2", "--run-dir", str(run_dir),
                                      "--head-interface", "lo", *SMALL_RUN)
    assert state == "COMPLETED 0:0" and "vime: the driver exited with status 0" in log, f"{state}\n{log}"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    assert "driver on n1 (127.0.0.1:" in log
    started = [json.loads(line) for line in log.splitlines() if '"started a process"' in line]  # the agent's log
    assert [(entry["actor"], entry["peer"]) for entry in started] == [("node-n2", "rollout-0")], log
