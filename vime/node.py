"""``python -m vime.node --join tcp://HEAD:PORT``: offer this host to a running job.

Run on each extra host (by hand, by Slurm's ``srun``, by a Kubernetes pod), the token in ``VIME_TOKEN``::

    VIME_TOKEN=TOKEN python -m vime.node --join tcp://HEAD:PORT --name gpu-node-3

The agent joins the job as an actor of role ``node`` (the same token and TLS checks as any join: a refused one
exits 2 saying why), tells the driver what the host offers (:class:`~vime.messages.nodes.NodeFacts`), then
starts the actors the driver places here, each as ``python -m vime.actor`` joined to the driver, and
supervises them as the driver supervises its own spawns:

* every exit is reported at once (ActorExited); the driver decides what follows (a restart is started here
  again, through this agent);
* what they write (stdout, stderr) goes to the driver's ``RUN_DIR/logs/NAME.log``, and to this host's
  ``--run-dir``/logs too;
* they stop when the job ends (Shutdown), when this agent is stopped (SIGTERM: they get SIGTERM, then
  SIGKILL after ``STOP_GRACE_S``) or killed (each runs with ``--exit-with-parent`` this agent), and when the
  driver stops answering for ``--driver-lost-s`` (the agent then exits 3 saying so).

What the driver may ask is narrow: only roles this agent allows (the built-in ones, and those its own
``--allow-role`` names) and only the environment in ``PLACEABLE_ENV``, since received data never decides
what code runs here.
"""

from __future__ import annotations

import argparse
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

import trio

from vime import actor as actor_cli
from vime.messages.nodes import (
    ActorExited,
    ActorStarted,
    ActorStopped,
    LogLines,
    NodeFacts,
    StartActor,
    StopActor,
)
from vime.messages.runtime import StatusQuery
from vime.roles import ROLES
from vime.runtime import Actor, PeerGone, handles
from vime.transports.codec import Envelope

STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL, for the actors of a stopping node
EXIT_LOST_DRIVER = 3
_LOG_CHUNK = 64 << 10


@dataclasses.dataclass
class _Child:
    process: trio.Process
    log: BinaryIO
    drained: trio.Event = dataclasses.field(default_factory=trio.Event)  # its output reached EOF


class NodeAgent(Actor):
    """One host's agent: starts, watches and stops the actors the driver places on it."""

    role = "node"

    def __init__(self, settings: Any, config: dict[str, Any]) -> None:
        super().__init__(settings, config)
        self.allowed_roles = (frozenset(ROLES) - {self.role}) | frozenset(config.get("allow_roles", ()))
        self.driver_lost_s = float(config.get("driver_lost_s", 15.0))
        self.children: dict[str, _Child] = {}
        self.run_dir = Path(settings.run_dir or tempfile.mkdtemp(prefix=f"vime-node-{settings.name}-"))
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)

    async def on_start(self) -> None:
        await self.tell("driver", NodeFacts(host=os.uname().nodename, address_host=self._address_host(),
                                            gpus=count_gpus(), cpus=os.cpu_count() or 1))
        self.start_soon(self._watch_driver)

    def _address_host(self) -> str:
        return urlsplit(self.address).hostname or "127.0.0.1"

    @handles(StartActor)
    async def _on_start_actor(self, msg: StartActor, envelope: Envelope) -> ActorStarted:
        if msg.role not in self.allowed_roles:
            raise ValueError(f"role {msg.role!r} is not allowed on node {self.name}: built-in roles are, and those "
                             f"it was started with --allow-role for (restart it with --allow-role {msg.role})")
        if msg.name in self.children:
            raise ValueError(f"actor {msg.name!r} is already running on node {self.name}")
        scheme = urlsplit(self.address).scheme
        command = actor_cli.launch_command(
            msg.role, msg.name, self.settings.driver, f"{scheme}://{self._address_host()}:0",
            parent_pid=os.getpid(), run_dir=str(self.run_dir), config=msg.config, settings=msg.settings,
            seed=msg.seed, record=msg.record, tls=self._tls_files())
        env = dict(os.environ, **msg.env, PYTHONUNBUFFERED="1")
        process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                   env=env)
        child = self.children[msg.name] = _Child(process, open(self.run_dir / "logs" / f"{msg.name}.log", "ab"))
        self.log.info("started an actor", peer=msg.name, role=msg.role, pid=process.pid)
        self.start_soon(self._forward_output, msg.name, child)
        self.start_soon(self._watch_child, msg.name, child)
        return ActorStarted(pid=process.pid)

    def _tls_files(self) -> dict[str, str]:
        tls = self.settings.tls
        return {} if tls is None else {"cert_key": tls.cert_key_file, "ca": tls.ca_file}

    @handles(StopActor)
    async def _on_stop_actor(self, msg: StopActor, envelope: Envelope) -> ActorStopped:
        child = self.children.get(msg.name)
        if child is None:
            raise ValueError(f"no actor {msg.name!r} is running on node {self.name}")
        child.process.send_signal(msg.signal)
        return ActorStopped(code=await child.process.wait())

    async def _forward_output(self, name: str, child: _Child) -> None:
        """Copy what the actor writes to this host's log and to the driver's, until its output closes."""
        assert child.process.stdout is not None
        try:
            while data := await child.process.stdout.receive_some(_LOG_CHUNK):
                child.log.write(data)
                child.log.flush()
                try:
                    await self.tell("driver", LogLines(name=name, data=bytes(data)))
                except (LookupError, PeerGone):
                    pass  # the driver is gone: this host's copy is all there is
        finally:
            child.log.close()
            child.drained.set()

    async def _watch_child(self, name: str, child: _Child) -> None:
        """Report the actor's exit, after its last words (a traceback) have gone to the driver's log."""
        code = await child.process.wait()
        with trio.move_on_after(2.0):  # a process it started may hold its output open
            await child.drained.wait()
        if self.children.get(name) is child:
            del self.children[name]
        self.log.info("an actor exited", peer=name, pid=child.process.pid, code=code)
        try:
            await self.tell("driver", ActorExited(name=name, pid=child.process.pid, code=code))
        except (LookupError, PeerGone):
            pass

    async def _watch_driver(self) -> None:
        """A node whose driver is gone (killed, or the link cut) must not keep its actors running: the driver
        answers a StatusQuery from anyone; ``driver_lost_s`` without an answer stops this node."""
        answered = time.monotonic()
        while True:
            await trio.sleep(1.0)
            try:
                await self.ask("driver", StatusQuery(), timeout=min(5.0, self.driver_lost_s))
                answered = time.monotonic()
            except (TimeoutError, PeerGone):
                if time.monotonic() - answered >= self.driver_lost_s:
                    self.log.error("the driver stopped answering; stopping this node's actors",
                                   driver=self.settings.driver, silent_s=round(time.monotonic() - answered, 1))
                    print(f"vime.node: the driver at {self.settings.driver} has not answered for "
                          f"{self.driver_lost_s:.0f} s; stopped the {len(self.children)} actor(s) started here",
                          file=sys.stderr, flush=True)
                    self.exit_code = EXIT_LOST_DRIVER
                    self.stop()
                    return

    async def on_stop(self) -> None:
        """SIGTERM to every actor started here, SIGKILL to those still running ``STOP_GRACE_S`` later."""
        children = list(self.children.values())
        for child in children:
            if child.process.returncode is None:
                child.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE_S):
            for child in children:
                await child.process.wait()
        for child in children:
            if child.process.returncode is None:
                child.process.kill()
                await child.process.wait()


def count_gpus() -> int:
    """The GPUs this host offers: those ``CUDA_VISIBLE_DEVICES`` names when set, else those ``nvidia-smi -L``
    lists (no torch import for this: the agent stays light)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
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
