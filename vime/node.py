"""``python -m vime.node --join tcp://HEAD:PORT``: offer this host to a running job.

Run on each extra host (by hand, by Slurm's ``srun``, by a Kubernetes pod), the token in ``VIME_TOKEN``::

    VIME_TOKEN=TOKEN python -m vime.node --join tcp://HEAD:PORT --name gpu-node-3

The agent joins the job as an actor of role ``node`` (the same token and TLS checks as any join: a refused one
exits 2 saying why), tells the driver what the host offers (:class:`~vime.messages.nodes.NodeFacts`), then
starts the actors the driver places here, each as ``python -m vime.actor`` joined to the driver (and the
trainer ranks its rank 0 places here, each as ``python -m vime.backends.tensor_parallel``: ``vime.trainer_ranks``),
and supervises them as the driver supervises its own spawns (reporting a rank's exit and output to the trainer):

* every exit is reported at once (ActorExited); the driver decides what follows (a restart is started here
  again, through this agent);
* they write their logs to this host's ``--run-dir``/logs, which the agent forwards to the driver's
  ``RUN_DIR/logs/NAME.log`` as they grow (never blocking them: a slow driver only delays the copy);
* they stop when the job ends (Shutdown), when this agent is stopped (SIGTERM to each and what it started:
  each runs in a session of its own; SIGKILL after ``STOP_GRACE_S``) or killed (each runs with
  ``--exit-with-parent`` this agent), and when the driver stops answering for ``--driver-lost-s`` (the agent
  then exits 3 saying so).

What the driver may ask is narrow: only roles this agent allows (the built-in ones, and those its own
``--allow-role`` names) and only the environment in ``PLACEABLE_ENV``. The trust boundary is the job's token,
though: a built-in role's settings may name code to load (a custom reward or rollout function, vLLM engine
arguments), so whoever holds the token can run code on every node. It travels in the environment, never on a
command line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import structlog
import trio

from vime import actor as actor_cli
from vime.messages.nodes import ActorExited, ActorStarted, LogLines, NodeFacts, StartActor, StartRank, StopActor
from vime.messages.runtime import StatusQuery
from vime.roles import ROLES
from vime.runtime import Actor, PeerGone, RemoteError, handles
from vime.trainer_ranks import rank_command
from vime.transports.codec import Envelope

STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL, for the actors of a stopping node
EXIT_LOST_DRIVER = 3
LOG_POLL_S = 0.5  # how often an actor's log is read for what is new
LOG_READ = 1 << 20  # at most this much of one log per read, and per message to the driver
LOG_BACKLOG = 8  # log messages for the driver not yet sent: more, and forwarding waits (the file keeps it all)


@dataclasses.dataclass
class _Child:
    name: str
    process: trio.Process
    log_path: Path
    log_from: int  # where this process's part of the log starts (a restart appends to its predecessor's)
    reporter: str  # who asked for it, and is told its output and exit: the driver, or the trainer for its ranks


class NodeAgent(Actor):
    """One host's agent: starts, watches and stops the actors the driver places on it."""

    role = "node"

    def __init__(self, settings: Any, config: dict[str, Any]) -> None:
        super().__init__(settings, config)
        self.allowed_roles = (frozenset(ROLES) - {self.role}) | frozenset(config.get("allow_roles", ()))
        self.driver_lost_s = float(config.get("driver_lost_s", 15.0))
        self.children: dict[tuple[str, int], _Child] = {}  # by who asked and their number for the start
        self.run_dir = Path(settings.run_dir or tempfile.mkdtemp(prefix=f"vime-node-{settings.name}-"))
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)

    async def on_start(self) -> None:
        gpus = await trio.to_thread.run_sync(count_gpus)  # nvidia-smi may take seconds: heartbeats go on
        await self.tell("driver", NodeFacts(host=os.uname().nodename, address_host=self._address_host(), gpus=gpus,
                                            cpus=len(os.sched_getaffinity(0))))
        self.start_soon(self._watch_driver)

    def _address_host(self) -> str:
        return urlsplit(self.address).hostname or "127.0.0.1"

    @handles(StartActor)
    async def _on_start_actor(self, msg: StartActor, envelope: Envelope) -> ActorStarted:
        if msg.role not in self.allowed_roles:
            raise ValueError(f"role {msg.role!r} is not allowed on node {self.name}: built-in roles are, and those "
                             f"it was started with --allow-role for (restart it with --allow-role {msg.role})")
        scheme = urlsplit(self.address).scheme
        command = actor_cli.launch_command(
            msg.role, msg.name, self.settings.driver, f"{scheme}://{self._address_host()}:0",
            parent_pid=os.getpid(), run_dir=str(self.run_dir), config=msg.config, settings=msg.settings,
            seed=msg.seed, record=msg.record, tls=self._tls_files(), node=self.name)
        env = dict(os.environ, **msg.env, VIME_TOKEN=self.settings.token or "", PYTHONUNBUFFERED="1")
        return await self._start_child(envelope.sender, msg.start, msg.name, command, env)

    @handles(StartRank)
    async def _on_start_rank(self, msg: StartRank, envelope: Envelope) -> ActorStarted:
        """A trainer rank, the process rank 0 starts on its own host: no token (it joins the trainer's process
        group, not the job), supervised as an actor, reported to the trainer that asked."""
        env = {k: v for k, v in os.environ.items() if k != "VIME_TOKEN"} | {"PYTHONUNBUFFERED": "1"}
        return await self._start_child(envelope.sender, msg.start, msg.name, rank_command(msg.spec), env)

    async def _start_child(self, reporter: str, start: int, name: str, command: list[str],
                           env: dict[str, str]) -> ActorStarted:
        """Start a process for ``reporter`` (the driver, or the trainer for its ranks) and supervise it, telling
        ``reporter`` its output and exit."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        with open(log_path, "ab") as log:  # the process writes its log here itself: no pipe through this agent
            log_from = log.tell()
            process = await trio.lowlevel.open_process(command, stdout=log, stderr=log, env=env,
                                                       start_new_session=True)
        child = self.children[reporter, start] = _Child(name, process, log_path, log_from, reporter)
        self.log.info("started a process", peer=name, pid=process.pid, start=start, reporter=reporter)
        self.start_soon(self._supervise, start, child)
        return ActorStarted(pid=process.pid)

    def _tls_files(self) -> dict[str, str]:
        tls = self.settings.tls
        return {} if tls is None else {"cert_key": tls.cert_key_file, "ca": tls.ca_file}

    @handles(StopActor)
    async def _on_stop_actor(self, msg: StopActor, envelope: Envelope) -> None:
        """Signal at once and answer nothing: a stopped (SIGSTOP) or slow-to-stop actor must not hold this
        agent's handlers; its exit, when it comes, is reported by :meth:`_supervise`."""
        child = self.children.get((envelope.sender, msg.start))
        if child is not None:
            _signal_group(child.process, msg.signal)

    async def _supervise(self, start: int, child: _Child) -> None:
        """Forward the actor's log as it grows; once it exits, the rest of it, then the exit (its last words,
        a traceback say, reach the driver's log before the news of its death)."""
        with open(child.log_path, "rb") as log:
            log.seek(child.log_from)
            while True:
                exited = child.process.poll() is not None
                while await self._forward(child, log, waiting_ok=exited):
                    pass
                if exited:
                    break
                with trio.move_on_after(LOG_POLL_S):
                    await child.process.wait()
        del self.children[child.reporter, start]
        code = child.process.returncode
        self.log.info("a process exited", peer=child.name, pid=child.process.pid, code=code)
        await self.tell_quietly(child.reporter, ActorExited(name=child.name, start=start, code=code))

    async def _forward(self, child: _Child, log: BinaryIO, *, waiting_ok: bool) -> bool:
        """Send the child's reporter the next part of its log; whether there was any. While it runs, nothing is
        read when the reporter is behind (``LOG_BACKLOG``): the file keeps it for the next read."""
        if not waiting_ok and self.unsent_to(child.reporter) > LOG_BACKLOG:
            return False
        data = log.read(LOG_READ)
        if data:  # to a reporter gone, nothing: this host's copy is all there is
            await self.tell_quietly(child.reporter, LogLines(name=child.name, data=data))
        return bool(data)

    async def _watch_driver(self) -> None:
        """A node whose driver is gone (killed, or the link cut) must not keep its actors running: the driver
        answers a StatusQuery from anyone; ``driver_lost_s`` without an answer stops this node."""
        answered = time.monotonic()
        while True:
            await trio.sleep(1.0)
            try:
                await self.ask("driver", StatusQuery(), timeout=min(5.0, self.driver_lost_s))
                answered = time.monotonic()
            except (TimeoutError, PeerGone, RemoteError):
                if time.monotonic() - answered >= self.driver_lost_s:
                    self._lose_driver()
                    return

    def _lose_driver(self) -> None:
        self.log.error("the driver stopped answering; stopping this node's actors", driver=self.settings.driver)
        print(f"vime.node: the driver at {self.settings.driver} has not answered for {self.driver_lost_s:.0f} s; "
              f"stopping the {len(self.children)} actor(s) started here", file=sys.stderr, flush=True)
        self.exit_code = EXIT_LOST_DRIVER
        self.stop()

    async def on_stop(self) -> None:
        """SIGTERM to every actor started here (and what each started), SIGKILL to what still runs
        ``STOP_GRACE_S`` later."""
        children = list(self.children.values())
        for child in children:
            _signal_group(child.process, signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE_S):
            for child in children:
                await child.process.wait()
        for child in children:
            _signal_group(child.process, signal.SIGKILL)
            await child.process.wait()


def _signal_group(process: trio.Process, sig: int) -> None:
    """Signal an actor and the processes it started (a vLLM engine core): each runs in its own session."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)


def count_gpus() -> int:
    """The GPUs this host offers: those ``CUDA_VISIBLE_DEVICES`` names when set, else those ``nvidia-smi -L``
    lists (no torch import for this: the agent stays light); 0 when nvidia-smi fails, with a warning."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        structlog.get_logger().warning("nvidia-smi -L failed; this node offers no GPUs", error=str(err))
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vime.node", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--allow-role", action="append", default=[], metavar="MODULE:CLASS",
                        help="a role of your own the driver may start here (repeat for several); built-in roles "
                             "always may")
    parser.add_argument("--driver-lost-s", type=float, default=15.0,
                        help="stop this node's actors and exit 3 when the driver has not answered for this long")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the node's own flags; every other flag is ``python -m vime.actor``'s (--join, --name, --listen,
    --token, --tls-cert-key, --tls-ca, --run-dir...)."""
    args, rest = _parser().parse_known_args(argv)
    config = {"allow_roles": args.allow_role, "driver_lost_s": args.driver_lost_s}
    return actor_cli.main(["node", *rest, "--config", json.dumps(config)])


if __name__ == "__main__":
    sys.exit(main())
