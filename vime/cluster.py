"""The driver: starts actors as OS processes, watches them, talks to them.

:class:`Cluster` runs a small actor named ``driver`` inside the calling
program. Every actor -- spawned here or joined from another host with
``python -m vime.actor ROLE --join ADDRESS`` -- registers with it and gets the
directory of the others; the driver keeps ``RUN_DIR/actors.json`` current.

Supervision: a spawned actor's death is seen the moment its process exits
(any cause, ``kill -9`` included); a joined actor is declared dead when its
heartbeats stop for ``dead_after_s``. Either way the driver logs it, removes
it from the directory it sends to everyone (asks waiting on it fail with
PeerGone), records an event, and restarts it if it was spawned with
``restart=True`` and did not exit cleanly (exit status 0 is a deliberate
leave, after SIGTERM say), or when :meth:`Cluster.restart` is called; one whose
node was lost is stranded, and restarted there when that node joins again. An
actor that fails by itself (a non-zero exit, or a crash: SIGABRT, SIGSEGV,
SIGBUS) within ``QUICK_DEATH_S`` of starting, ``GIVE_UP_AFTER`` times in a
row, is not restarted again: its start-up is broken (a bad engine argument,
too little GPU memory), and the driver records a ``gave up`` event instead of
looping. A kill (SIGKILL, SIGTERM) is someone's decision and does not count.

Leaks: an actor that dies without closing (``kill -9``, a crash) leaves its
shared-memory segments (``vime.transports.shm``); the driver removes them
when it sees the death, and as it starts it sweeps what dead processes of
the same user left, its own ipc sockets included (their folder carries the
driver's pid, beside the segments).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import structlog
import trio

from vime.actor import launch_command
from vime.logs import configure
from vime.messages.model_files import ModelFileChunk, ModelFileRead, ModelManifest, ModelManifestQuery
from vime.messages.nodes import ActorExited, LogLines, NodeFacts, StartActor, StopActor, check_placeable
from vime.messages.runtime import Directory, Heartbeat, Register, Registered, Shutdown
from vime.model_files import CHUNK_NOT_LEFT, ModelServer
from vime.runtime import Actor, ActorSettings, PeerGone, RemoteError, handles
from vime.transports.codec import Envelope
from vime.transports.shm import pid_alive, remove_left_by, segment_dir, sweep_stale

QUICK_DEATH_S = 120.0
GIVE_UP_AFTER = 3
_CRASHES = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS})


@dataclasses.dataclass
class ActorInfo:
    name: str
    role: str
    pid: int
    address: str
    host: str
    joined: bool
    started_at: float
    last_heartbeat: float
    status: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """A host whose node agent (``python -m vime.node``) joined the job: where its actors listen, what it has."""

    name: str
    host: str
    address_host: str
    gpus: int
    cpus: int


@dataclasses.dataclass(frozen=True)
class ActorEvent:
    """Something the driver saw happen to an actor: ``joined``, ``died``, ``restarted``, ``gave up`` (on
    restarting it), ``stranded`` (not restarted: its node is lost), ``refused``; to a node: ``node joined``,
    ``node lost``."""

    what: str
    name: str
    detail: str
    at: float


@dataclasses.dataclass
class _Spawned:
    role: str
    config: dict[str, Any]
    settings: dict[str, Any]
    seed: int
    restart: bool
    record: bool
    env: dict[str, str]
    node: str | None = None  # the node agent that runs it (vime.node); None: this host, a child of the driver
    process: trio.Process | None = None  # on this host
    remote_start: int | None = None  # on a node, while it runs: the number of its start (StartActor.start)
    registered: trio.Event = dataclasses.field(default_factory=trio.Event)
    started_at: float = 0.0  # time.monotonic() of the latest start
    quick_failures: int = 0  # failures in a row, each within QUICK_DEATH_S of its start


class NodeRefused(RuntimeError):
    """A node agent would not start an actor (a role it does not allow, say); nothing was started."""


class _Driver(Actor):
    role = "driver"

    def __init__(self, settings: ActorSettings, cluster: Cluster) -> None:
        super().__init__(settings)
        self.cluster = cluster

    @handles(Register)
    async def _on_register(self, msg: Register, envelope: Envelope) -> Registered:
        return self.cluster._register(msg)

    @handles(NodeFacts)
    async def _on_node_facts(self, msg: NodeFacts, envelope: Envelope) -> None:
        self.cluster._node_joined(envelope.sender, msg)

    @handles(ActorExited)
    async def _on_actor_exited(self, msg: ActorExited, envelope: Envelope) -> None:
        self.cluster._exited_on_node(envelope.sender, msg)

    @handles(LogLines)
    async def _on_log_lines(self, msg: LogLines, envelope: Envelope) -> None:
        self.cluster._log_from_node(envelope.sender, msg)

    @handles(ModelManifestQuery)
    async def _on_model_manifest(self, msg: ModelManifestQuery, envelope: Envelope) -> ModelManifest:
        return await self._model_server().manifest(self.start_soon, sizes_only=msg.sizes_only)

    @handles(ModelFileRead)
    async def _on_model_file_read(self, msg: ModelFileRead, envelope: Envelope) -> ModelFileChunk:
        server = self._model_server()
        if self.unsent_to(envelope.sender):  # a reader that does not take its chunks piles them up here
            raise ValueError(CHUNK_NOT_LEFT)
        return await server.read(msg)

    def _model_server(self) -> ModelServer:
        if self.cluster.model_server is None:
            raise ValueError("this job shares no model folder (its driver was opened without model_folder); "
                             "pass --model-path DIR, this host's copy of the model")
        return self.cluster.model_server

    def on_arrival(self, envelope: Envelope) -> bool:
        """Heartbeats are stamped as they arrive: queued behind a handler that takes a while (a model file's
        chunk read from disk), a live joined actor would look dead."""
        if type(envelope.payload) is not Heartbeat:
            return False
        info = self.cluster.actors.get(envelope.payload.name)
        if info is None:
            self.cluster._turn_away(envelope.payload.name)
        else:
            info.last_heartbeat = time.monotonic()
            info.status = envelope.payload.status
        return True


def new_join_token() -> str:
    """A random join token that is safe on a command line: hex only, because a url-safe token starts
    with '-' one time in 64 and ``--token -x...`` then reads as an option, and the join fails."""
    return secrets.token_hex(16)


class Cluster:
    """A running job: the driver actor plus the actors it spawned or let join."""

    def __init__(self, run_dir: Path, *, transport: str, host: str, token: str | None, record: bool,
                 dead_after_s: float, tls: dict[str, str] | None, job_config: dict[str, Any] | None,
                 model_folder: str | Path | None) -> None:
        self.run_dir = Path(run_dir)
        self.job_config = job_config
        self.model_server = ModelServer(model_folder) if model_folder else None
        self.transport = transport
        self.host = host
        self.token = token
        self.record = record
        self.dead_after_s = dead_after_s
        self.tls = tls or {}
        self.run_id = uuid.uuid4().hex[:12]
        self.actors: dict[str, ActorInfo] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.trainer_ranks: list[dict[str, Any]] = []  # where each trainer rank runs, when they span hosts
        self._starts = itertools.count(1)  # numbers the starts on nodes (StartActor.start)
        self._turned_away: set[str] = set()  # actors counted dead that still send heartbeats, told to stop
        self.events: list[ActorEvent] = []
        self._event_posted = trio.lowlevel.ParkingLot()
        self._spawned: dict[str, _Spawned] = {}
        self._gone: set[str] = set()  # spawned actors dead and not to be restarted
        self._stranded: set[str] = set()  # of those, the ones to restart when their lost node joins again
        self._socket_dir = Path(tempfile.mkdtemp(prefix=f"vime-{os.getpid()}-ipc-", dir=segment_dir()))
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self.driver: _Driver | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, run_dir: str | Path, *, transport: str = "ipc", host: str = "127.0.0.1",
                   port: int = 0, token: str | None = None, record: bool = False, dead_after_s: float = 4.0,
                   tls: dict[str, str] | None = None,
                   job_config: dict[str, Any] | None = None,
                   model_folder: str | Path | None = None) -> AsyncIterator[Cluster]:
        """Start the driver; on exit, shut every actor down (SIGKILL after 5 s).

        ``job_config`` is handed to actors that join by hand without ``--config``
        (``python -m vime.actor rollout --join ...``), so they need only the address and token.
        ``model_folder`` is the job's model, which the driver serves, file by file, to a joined actor whose host
        does not have it (``vime.model_files``); nothing outside it is served.
        """
        if not structlog.is_configured():  # a program embedding the driver gets vime's log format, on stderr
            configure()
        if transport not in ("ipc", "tcp", "tls+tcp"):
            raise ValueError(f"transport must be ipc, tcp or tls+tcp, not {transport!r}")
        if transport != "ipc" and token is None:
            token = new_join_token()
        _sweep_stale()
        cluster = cls(Path(run_dir), transport=transport, host=host, token=token, record=record,
                      dead_after_s=dead_after_s, tls=tls, job_config=job_config, model_folder=model_folder)
        cluster.run_dir.mkdir(parents=True, exist_ok=True)
        listen = (f"ipc://{cluster._socket_dir}/driver" if transport == "ipc" else f"{transport}://{host}:{port}")
        settings = ActorSettings(name="driver", listen=listen, token=token, run_dir=str(cluster.run_dir),
                                 record=record, tls_cert_key=cluster.tls.get("cert_key"), tls_ca=cluster.tls.get("ca"))
        cluster.driver = _Driver(settings, cluster)
        try:
            async with trio.open_nursery() as nursery:
                cluster._nursery = nursery
                await nursery.start(lambda task_status: cluster.driver.serve(handle_signals=False,
                                                                             task_status=task_status))
                nursery.start_soon(cluster._watch_heartbeats)
                cluster._write_actors_json()
                try:
                    yield cluster
                finally:
                    with trio.CancelScope(shield=True):
                        await cluster._shutdown_all()
                    nursery.cancel_scope.cancel()
        finally:
            shutil.rmtree(cluster._socket_dir, ignore_errors=True)

    @property
    def address(self) -> str:
        """Where actors join: pass it to ``python -m vime.actor ROLE --join``."""
        assert self.driver is not None
        return self.driver.address

    # ------------------------------------------------------------- spawning

    async def spawn(self, role: str, name: str | None = None, config: dict[str, Any] | None = None, *,
                    settings: dict[str, Any] | None = None, seed: int = 0, restart: bool = False,
                    record: bool | None = None, env: dict[str, str] | None = None,
                    timeout: float = 60.0, node: str | None = None) -> ActorInfo:
        """Start ``role`` (a built-in role or ``module:Class``) as its own process.

        ``config`` holds the role's own settings; ``settings`` tunes the
        runtime (ActorSettings fields such as ``inbox_capacity``); ``record``
        overrides the job's ``record`` for this actor; ``env`` adds to the
        process's environment (its GPUs: ``CUDA_VISIBLE_DEVICES``). ``node``
        names a joined node agent to start it on (``vime.node``); it is then
        supervised through that agent as a local spawn is here.

        Returns once it has registered. Raises RuntimeError, with the tail of
        its log, if the process exits first or does not register in time.
        """
        name = name or f"{role.rpartition(':')[2].lower()}-{len(self._spawned)}"
        if name in self._spawned or name in self.actors:
            raise ValueError(f"an actor named {name!r} already exists in this job")
        if node is not None:
            if node not in self.nodes:
                raise ValueError(f"no node named {node!r} has joined this job (joined: {sorted(self.nodes) or 'none'}"
                                 "); start one there with python -m vime.node --join ADDRESS --name NODE")
            check_placeable(name, env or {})
        entry = self._spawned[name] = _Spawned(role, dict(config or {}), dict(settings or {}), seed, restart,
                                                   self.record if record is None else record, dict(env or {}), node)
        try:
            await self._start_process(name, entry, timeout)
        except NodeRefused:
            del self._spawned[name]  # nothing started: the name is free for a corrected spawn
            raise
        return self.actors[name]

    async def _start_process(self, name: str, entry: _Spawned, timeout: float) -> None:
        entry.registered = trio.Event()
        log_path = self.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if entry.node is None:
            await self._start_here(name, entry, log_path)
        else:
            await self._start_on_node(name, entry)
        entry.started_at = time.monotonic()
        with trio.move_on_after(timeout):
            await entry.registered.wait()
        if not entry.registered.is_set():
            if entry.node is None:
                entry.process.kill()
            else:
                await self._kill_on_node(entry)
            raise RuntimeError(f"actor {name} ({entry.role}) did not register within {timeout} s; "
                               f"its log {log_path} ends with:\n{_tail(log_path)}")
        if name not in self.actors:
            raise RuntimeError(f"actor {name} ({entry.role}) exited during start-up; "
                               f"its log {log_path} ends with:\n{_tail(log_path)}")

    async def _start_here(self, name: str, entry: _Spawned, log_path: Path) -> None:
        """Start the actor as a child of this process, its output to ``log_path``."""
        listen = f"ipc://{self._socket_dir}/{name}" if self.transport == "ipc" else f"{self.transport}://{self.host}:0"
        command = launch_command(entry.role, name, self.address, listen, parent_pid=os.getpid(),
                                 run_dir=str(self.run_dir), config=entry.config, settings=entry.settings,
                                 seed=entry.seed, record=entry.record, tls=self.tls)
        env = dict(os.environ, **entry.env, VIME_TOKEN=self.token or "", PYTHONUNBUFFERED="1")
        with open(log_path, "ab") as log_file:
            entry.process = await trio.lowlevel.open_process(command, stdout=log_file, stderr=log_file, env=env)
        assert self._nursery is not None
        self._nursery.start_soon(self._watch_process, name, entry, entry.process)

    async def _start_on_node(self, name: str, entry: _Spawned) -> None:
        """Have the actor's node agent start it; RuntimeError naming the node when it cannot."""
        if entry.node not in self.nodes:
            raise NodeRefused(f"actor {name} ({entry.role}) cannot start: its node {entry.node!r} is not in the job "
                              f"(nodes now: {sorted(self.nodes) or 'none'})")
        start = next(self._starts)
        order = StartActor(name=name, start=start, role=entry.role, config=json.dumps(entry.config),
                           settings=json.dumps(entry.settings), seed=entry.seed, record=entry.record, env=entry.env)
        try:
            await self.driver.ask(entry.node, order, timeout=60.0)
        except (RemoteError, PeerGone, TimeoutError) as err:
            raise NodeRefused(f"node {entry.node} did not start actor {name} ({entry.role}): {err}") from err
        entry.remote_start = start

    async def _kill_on_node(self, entry: _Spawned) -> None:
        """SIGKILL the node's process of ``entry``, forgetting it first: its exit, reported later, is not news
        (a restart may be running its successor by then)."""
        start, entry.remote_start = entry.remote_start, None
        if start is not None:
            await self.driver.tell_quietly(entry.node, StopActor(start=start, signal=signal.SIGKILL))

    async def _watch_process(self, name: str, entry: _Spawned, process: trio.Process) -> None:
        code = await process.wait()
        if entry.process is not process:
            return
        await self._exited(name, entry, code)

    def _exited_on_node(self, node: str, msg: ActorExited) -> None:
        """A node reports an exit: that of the process it runs for us now, or news of one already replaced."""
        entry = self._spawned.get(msg.name)
        if entry is None or entry.node != node or entry.remote_start != msg.start:
            return
        entry.remote_start = None
        self._nursery.start_soon(self._exited, msg.name, entry, msg.code)

    async def _exited(self, name: str, entry: _Spawned, code: int, how: str | None = None) -> None:
        """One supervision for every spawned actor, here or on a node: record the death, restart if asked."""
        how = how or (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
        self._declare_dead(name, how)
        entry.registered.set()  # wakes a spawn still waiting
        failed = code > 0 or -code in _CRASHES
        quick = failed and time.monotonic() - entry.started_at < QUICK_DEATH_S
        entry.quick_failures = entry.quick_failures + 1 if quick else 0
        if not (entry.restart and code != 0 and name in self._spawned):  # exit 0 is a deliberate leave (SIGTERM)
            self._gone.add(name)
            return
        if entry.node is not None and entry.node not in self.nodes:
            self._gone.add(name)
            self._stranded.add(name)
            self._post(ActorEvent("stranded", name, f"its node {entry.node} is not in the job; restarted there "
                                                     "when it joins again", time.time()))
            return
        if entry.quick_failures >= GIVE_UP_AFTER:
            log_path = self.run_dir / "logs" / f"{name}.log"
            self._give_up(name, f"it failed {entry.quick_failures} times in a row within {QUICK_DEATH_S:.0f} s of "
                                f"starting; its log {log_path} ends with:\n{_tail(log_path)}")
            return
        await self._restart(name)

    def _give_up(self, name: str, detail: str) -> None:
        self.driver.log.error("not restarting", name=name, why=detail.splitlines()[0])
        self._gone.add(name)
        self._post(ActorEvent("gave up", name, detail, time.time()))

    def gone_for_good(self, name: str) -> bool:
        """Whether the spawned actor ``name`` died and the driver will not restart it: it left cleanly, was
        spawned without restarts, or kept failing as it started (until :meth:`restart` is called)."""
        return name in self._gone

    async def restart(self, name: str, timeout: float = 60.0) -> ActorInfo:
        """Start a spawned actor again with its role and config (after it died, or killing it first)."""
        entry = self._spawned[name]
        self._gone.discard(name)
        self._stranded.discard(name)
        if entry.process is not None and entry.process.returncode is None:
            old = entry.process
            entry.process = None
            old.kill()
            await old.wait()
            self._declare_dead(name, "killed for restart")
        elif entry.remote_start is not None:
            await self._kill_on_node(entry)
            self._declare_dead(name, "killed for restart")
        await self._start_process(name, entry, timeout)
        self._post(ActorEvent("restarted", name, f"pid {self.actors[name].pid}", time.time()))
        return self.actors[name]

    async def _restart(self, name: str) -> None:
        try:
            await self.restart(name)
        except RuntimeError as err:
            self.driver.log.error("restart failed", name=name, error=str(err))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send a signal to a spawned actor's process (tests use SIGKILL): here at once, so that signals sent one
        after another arrive in order; on a node through its agent, in the order sent."""
        entry = self._spawned[name]
        if entry.node is None:
            if entry.process is not None:
                entry.process.send_signal(sig)
        elif entry.remote_start is not None:
            stop = StopActor(start=entry.remote_start, signal=int(sig))
            self._nursery.start_soon(self.driver.tell_quietly, entry.node, stop)

    # ----------------------------------------------------------- membership

    def _register(self, msg: Register) -> Registered:
        if msg.name in self.actors:
            raise ValueError(f"an actor named {msg.name!r} is already registered; pick another --name")
        spawned = self._spawned.get(msg.name)
        now = time.monotonic()
        self._turned_away.discard(msg.name)
        self.actors[msg.name] = ActorInfo(msg.name, msg.role, msg.pid, msg.address, msg.host,
                                          joined=spawned is None, started_at=time.time(), last_heartbeat=now)
        self.driver.log.info("actor registered", peer=msg.name, peer_role=msg.role, pid=msg.pid, address=msg.address)
        self._post(ActorEvent("joined", msg.name, f"{msg.role} pid {msg.pid} at {msg.address}", time.time()))
        self._publish_directory()
        if spawned is not None:
            spawned.registered.set()
        return Registered(run_id=self.run_id, directory=self._directory(), heartbeat_s=1.0,
                          config=self.job_config if spawned is None else None)

    def _declare_dead(self, name: str, how: str) -> None:
        info = self.actors.pop(name, None)
        if info is None:
            return
        self._remove_left_by(info)
        if self._closing:
            self.driver.log.info("actor exited", peer=name, peer_role=info.role, pid=info.pid, how=how)
        else:
            self.driver.log.error("actor died", peer=name, peer_role=info.role, pid=info.pid, how=how)
        self._post(ActorEvent("died", name, how, time.time()))
        node_lost = self.nodes.pop(name, None) is not None
        self._publish_directory()
        if node_lost:
            self._node_lost(name, how)

    def _turn_away(self, name: str) -> None:
        """An actor counted dead (its heartbeats stopped: a node cut off, a process frozen) that speaks again
        is told to stop, once: the job went on without it, and it would serve nobody (a node would hold its
        GPUs). Started again, it joins afresh. Told at the address this heartbeat came from, never by name: a
        successor of that name may have registered meanwhile. A spawn of this host is only ever counted dead
        once its process has exited: a heartbeat of its still on the way is no news."""
        entry = self._spawned.get(name)
        if self._closing or name in self._turned_away or (entry is not None and entry.node is None):
            return
        address = self.driver._learned.get(name)
        if address is None:
            return
        self._turned_away.add(name)
        self.driver.log.warning("an actor counted dead sends heartbeats; telling it to stop", peer=name,
                                address=address)
        self._nursery.start_soon(self._stop_at, name, address)

    async def _stop_at(self, name: str, address: str) -> None:
        shutdown = Shutdown(reason="the driver counted this actor dead when its heartbeats stopped; start it again "
                                   "to rejoin")
        with contextlib.suppress(LookupError, PeerGone):
            await self.driver._send(name, shutdown, weight_version=None, address=address)

    def _node_joined(self, name: str, facts: NodeFacts) -> None:
        info = self.actors.get(name)
        if info is None or info.role != "node":
            self.driver.log.warning("NodeFacts from an actor that is not a node agent; ignored", peer=name)
            return
        self.nodes[name] = NodeInfo(name, facts.host, facts.address_host, facts.gpus, facts.cpus)
        self.driver.log.info("node joined", node=name, host=facts.host, address_host=facts.address_host,
                             gpus=facts.gpus, cpus=facts.cpus)
        self._post(ActorEvent("node joined", name, f"{facts.gpus} GPUs, {facts.cpus} CPUs at {facts.address_host}",
                              time.time()))
        self._write_actors_json()
        self._restart_stranded(name)

    def _restart_stranded(self, node: str) -> None:
        """A node that joins again (the same ``--name``: its host restarted, its link back) takes back the actors
        its loss stranded, restarted there as a restart after a death is, so that the job uses the host again."""
        stranded = sorted(name for name in self._stranded if self._spawned[name].node == node)
        if stranded:
            self.driver.log.info("restarting the actors stranded on a node that joined again", node=node,
                                 actors=stranded)
        for name in stranded:
            self._stranded.discard(name)
            self._nursery.start_soon(self._restart, name)

    def _node_lost(self, node: str, how: str) -> None:
        """A node's agent died or went silent: so did every actor it ran for us, as far as the job knows (each
        runs with --exit-with-parent its agent; one cut off with it is stopped by its agent's driver watch)."""
        lost = [n for n, e in self._spawned.items() if e.node == node and e.remote_start is not None]
        (self.driver.log.info if self._closing else self.driver.log.error)("node lost", node=node, how=how,
                                                                          actors=lost)
        self._post(ActorEvent("node lost", node, f"{how}; its actors: {', '.join(lost) or 'none'}", time.time()))
        for name in lost:
            entry = self._spawned[name]
            entry.remote_start = None
            self._nursery.start_soon(self._exited, name, entry, -signal.SIGKILL, f"its node {node} was lost ({how})")

    def record_trainer_ranks(self, rows: list[dict[str, Any]]) -> None:
        """Note where the trainer's ranks run (``vime.trainer_ranks.RankPlan.rows``), in RUN_DIR/actors.json."""
        self.trainer_ranks = rows
        self._write_actors_json()

    def _log_from_node(self, node: str, msg: LogLines) -> None:
        """Append what a node's actor wrote to its log here; a node writes only the logs of actors it runs."""
        entry = self._spawned.get(msg.name)
        if entry is None or entry.node != node:
            self.driver.log.warning("log lines for an actor that node does not run; dropped", node=node,
                                    peer=msg.name)
            return
        with open(self.run_dir / "logs" / f"{msg.name}.log", "ab") as log:
            log.write(msg.data)

    def _remove_left_by(self, info: ActorInfo) -> None:
        """Free the shared memory of an actor that died on this host without closing (``kill -9``): its pool
        may hold a GiB, and nobody else knows it is garbage. One still running (silent, not dead) keeps it."""
        if info.host != os.uname().nodename or pid_alive(info.pid):
            return
        removed = remove_left_by(info.pid)
        if removed:
            self.driver.log.info("removed a dead actor's shared memory", peer=info.name, pid=info.pid,
                                 segments=len(removed))

    def _directory(self) -> dict[str, str]:
        return {name: info.address for name, info in self.actors.items()}

    def _publish_directory(self) -> None:
        self.driver._set_directory(self._directory())
        self._write_actors_json()
        for name in self.actors:
            self._nursery.start_soon(self.driver.tell_quietly, name, Directory(addresses=self._directory()))

    def _write_actors_json(self) -> None:
        rows = [{"name": i.name, "role": i.role, "pid": i.pid, "address": i.address, "host": i.host,
                 "joined": i.joined, "started_at": i.started_at} for i in self.actors.values()]
        nodes = [dataclasses.asdict(node) for node in self.nodes.values()]
        document = {"run_id": self.run_id, "driver": self.address, "updated_at": time.time(), "actors": rows,
                    "nodes": nodes, "trainer_ranks": self.trainer_ranks}
        path = self.run_dir / "actors.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(document, indent=2))
        tmp.replace(path)

    async def _watch_heartbeats(self) -> None:
        """Joined actors have no process handle here; silence is their death."""
        while True:
            await trio.sleep(0.25)
            now = time.monotonic()
            for info in list(self.actors.values()):
                if info.joined and now - info.last_heartbeat > self.dead_after_s:
                    self._declare_dead(info.name, f"no heartbeat for {now - info.last_heartbeat:.1f} s")

    def _post(self, event: ActorEvent) -> None:
        self.events.append(event)
        self._event_posted.unpark_all()

    async def wait_event(self, what: str, name: str, timeout: float = 10.0) -> ActorEvent:
        """Wait for (or return the latest past) event ``what`` about ``name``."""
        seen = 0
        with trio.fail_after(timeout):
            while True:
                for event in self.events[seen:]:
                    if event.what == what and event.name == name:
                        return event
                seen = len(self.events)
                await self._event_posted.park()

    # ------------------------------------------------------------ messaging

    async def ask(self, name: str, payload: Any, *, timeout: float = 30.0) -> Any:
        return await self.driver.ask(name, payload, timeout=timeout)

    async def tell(self, name: str, payload: Any) -> None:
        await self.driver.tell(name, payload)

    async def _shutdown_all(self) -> None:
        self._closing = True
        for entry in self._spawned.values():
            entry.restart = False
        with trio.move_on_after(5.0):  # an actor not reading its inbox must not keep the job open: it is killed
            for name in list(self.actors):
                await self.driver.tell_quietly(name, Shutdown(reason="job finished"))
        processes = [e.process for e in self._spawned.values() if e.process and e.process.returncode is None]
        with trio.move_on_after(5.0):
            for process in processes:
                await process.wait()
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()


def _sweep_stale() -> None:
    """Remove the segments and socket folders that dead runs of this user left (a driver or an actor killed
    with ``kill -9``): tmpfs is memory, and nothing else would ever free it."""
    removed = sweep_stale()
    if removed:
        structlog.get_logger().info("removed what dead vime processes left", folder=str(segment_dir()),
                                    entries=len(removed))


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
