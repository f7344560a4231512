"""The sbatch script of a vime run over a Slurm allocation (``python -m vime.launch slurm``).

The script runs on the first node of the allocation (Slurm starts a batch script there), which makes it the
head: it makes the join token, starts the driver in the background, waits until the driver listens (its
``RUN_DIR/join`` appears), starts one node agent on every other node with one ``srun`` step, and exits with
the driver's status once the driver ends (the agents then stop: the job's end tells them). Nothing here needs a
Slurm plug-in or a prolog; ``scontrol show hostnames`` names the nodes.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
from pathlib import Path

import structlog

from vime.launch import Scenario, check_counts, driver_args

# The token is made on the head as the job starts: a script holding it would leave it in Slurm's state
# (``scontrol write batch_script``) and in every copy of the script.
MAKE_TOKEN = "VIME_TOKEN=$(\"$python\" -c 'import secrets; print(secrets.token_hex(16))')"


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """One launch's choices; ``sbatch_args`` are passed through as ``#SBATCH`` lines, verbatim."""

    nodes: int
    gpus_per_node: int
    scenario: Scenario
    python: str
    job_name: str
    run_dir: str | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    port: int | None = None
    head_interface: str | None = None
    sbatch_args: tuple[str, ...] = ()


def script(job: SlurmJob) -> str:
    """The whole sbatch script; ValueError for a job that cannot run, saying what to pass."""
    check_counts(job.nodes, job.gpus_per_node)
    if job.scenario.resumed and job.run_dir and Path(job.scenario.resumed).absolute() != Path(job.run_dir).absolute():
        raise ValueError(f"--resume {job.scenario.resumed} and --run-dir {job.run_dir} name two run folders; "
                         "leave --run-dir out to continue the resumed run in its own folder")
    return "\n".join([*_header(job), "", *_body(job), ""])


def _header(job: SlurmJob) -> list[str]:
    """The ``#SBATCH`` lines: one task per node (the driver's or an agent's), each node whole, since the
    driver's actors and an agent's use every CPU and GPU of their host."""
    lines = ["#!/bin/bash",
             f"# vime: {job.scenario.name} over {job.nodes} node(s), written by python -m vime.launch slurm",
             f"#SBATCH --job-name={_sbatch_value(job.job_name)}",
             f"#SBATCH --nodes={job.nodes}",
             "#SBATCH --ntasks-per-node=1",
             "#SBATCH --exclusive"]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    for flag, value in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if value:
            lines.append(f"#SBATCH --{flag}={_sbatch_value(value)}")
    lines += [f"#SBATCH {_sbatch_value(arg)}" for arg in job.sbatch_args]
    return lines


def _sbatch_value(value: str) -> str:
    """An ``#SBATCH`` line is not read by a shell but split on blanks by sbatch: refuse what it would split."""
    if any(char.isspace() for char in value):
        raise ValueError(f"{value!r}: #SBATCH lines cannot hold blanks; pass a value without them")
    return value


def _body(job: SlurmJob) -> list[str]:
    """The shell part. ``set -u`` (never ``-e``: a failing driver must still reach ``exit``); every user value
    is quoted once, here, with shlex."""
    folder = job.scenario.resumed or job.run_dir
    run_dir = (shlex.quote(str(Path(folder).absolute())) if folder
               else f'"$SLURM_SUBMIT_DIR/runs/{job.scenario.name}-$SLURM_JOB_ID"')
    port = str(job.port) if job.port else "$((20000 + SLURM_JOB_ID % 20000))"  # jobs sharing a head rarely clash
    lines = ["set -u",
             f"python={shlex.quote(job.python)}",
             f"run_dir={run_dir}",
             f"port={port}",
             'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             *_head_address(job),
             f"{MAKE_TOKEN} || exit 1",
             "export VIME_TOKEN",
             'rm -f "$run_dir/join"  # a resumed run\'s: it must mean that this driver listens',
             'echo "vime: driver on $head ($head_address:$port), run folder $run_dir"',
             f'"$python" {shlex.join(driver_args(job.scenario, job.nodes))} --host "$head_address" --port "$port"'
             + ('' if job.scenario.resumed else ' --out "$run_dir"') + " &",
             "driver=$!"]
    if job.nodes > 1:
        lines += _agents(job)
    lines += ["status=0",
              'wait "$driver" || status=$?']
    if job.nodes > 1:
        lines.append('[ -z "$agents" ] || { kill "$agents" 2>/dev/null; wait "$agents"; }  # still running: stop them')
    lines += ['echo "vime: the driver exited with status $status"',
              'exit "$status"']
    return lines


def _head_address(job: SlurmJob) -> list[str]:
    """The address the other nodes reach the head at: of ``--head-interface``, else what the head's name
    resolves to (a loopback address will not do beyond one node)."""
    if job.head_interface:
        find = (f"ip -4 -o addr show dev {shlex.quote(job.head_interface)} "
                "| awk '{split($4, a, \"/\"); print a[1]; exit}'")
        fix = f"check that {job.head_interface} is the head's interface"
    else:
        find = 'getent ahostsv4 "$head" | awk \'NR == 1 {print $1}\''
        fix = "pass vime.launch --head-interface IFACE (e.g. eth0, ib0)"
    lines = [f"head_address=$({find})",
             f'[ -n "$head_address" ] || {{ echo "vime: no IPv4 address for the head $head; {fix}" >&2; exit 2; }}']
    if job.nodes > 1 and not job.head_interface:  # an interface named is the user's choice (lo: a test's nodes)
        lines.append(f'case "$head_address" in 127.*) echo "vime: the head $head resolves to $head_address, which '
                     f'other nodes cannot reach; {fix}" >&2; exit 2;; esac')
    return lines


def _agents(job: SlurmJob) -> list[str]:
    """Wait for the driver to listen (RUN_DIR/join is written once it does; a joiner gives up after 30 s
    and a driver may take minutes to build its model), then one agent on each other node, named for it."""
    agent = ('exec "$0" -m vime.node --join "$1" --name "node-$SLURMD_NODENAME"')
    others = job.nodes - 1
    return ['until [ -e "$run_dir/join" ] || ! kill -0 "$driver" 2>/dev/null; do sleep 1; done',
            'agents=""',
            'if [ -e "$run_dir/join" ]; then  # else the driver ended first: its status says why',
            f'    srun --nodes={others} --ntasks={others} --ntasks-per-node=1 --exclude="$head" --kill-on-bad-exit=0 '
            f'bash -c {shlex.quote(agent)} "$python" "tcp://$head_address:$port" &',
            "    agents=$!",
            "fi"]


def submit(text: str) -> str:
    """Submit a script with ``sbatch`` (reading it from stdin); the job's id. RuntimeError saying what sbatch
    said when it refuses."""
    try:
        done = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise RuntimeError("sbatch not found: run this on a Slurm login node, or pass --print and submit the "
                           "script where sbatch is") from None
    if done.returncode != 0:
        raise RuntimeError(f"sbatch refused the job (status {done.returncode}): {done.stderr.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    structlog.get_logger().info("submitted", job_id=job_id)
    return job_id
