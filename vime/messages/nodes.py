"""Node agents' message kinds: a host beside the driver's, and the actors the driver starts there.

The flow::

    node --Register--> driver (as any actor joining), then node --NodeFacts--> driver
    driver --StartActor--> node --ActorStarted--> driver; the actor then registers with the driver itself
    node --LogLines--> driver (what its actors write), node --ActorExited--> driver (one of them exited)
    driver --StopActor--> node (a signal: a kill, a restart, SIGSTOP/SIGCONT; its exit comes as ActorExited)
    trainer --StartRank--> node --ActorStarted--> trainer: a trainer rank, whose ActorExited, LogLines go to the
    trainer (and StopActor comes from it)

Each start carries the driver's number for it (``start``), echoed in ActorExited and required by StopActor:
the exit of a process already replaced, or a signal meant for it, never touches its successor. A node agent's
death (its heartbeats stop) is the death of every actor it started.
"""

from __future__ import annotations

import re

from vime.transports.records import message

# Environment a driver may set for an actor it starts on a node: which GPUs and how many threads, nothing that
# decides what code runs (PYTHONPATH, LD_PRELOAD, NCCL_NET_PLUGIN...).
PLACEABLE_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"})
_ACTOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def check_placeable(name: str, env: dict[str, str]) -> None:
    """What an actor started on a node may be called and given: its name becomes a log file's name on both hosts
    (nothing that climbs out of the logs folder), its environment only ``PLACEABLE_ENV``."""
    if not _ACTOR_NAME.fullmatch(name):
        raise ValueError(f"actor name {name[:100]!r}: use letters, digits, '.', '_' and '-' (at most 100)")
    unknown = set(env) - PLACEABLE_ENV
    if unknown:
        raise ValueError(f"an actor on a node may be given only {sorted(PLACEABLE_ENV)} from the driver, not "
                         f"{sorted(unknown)}; set the others in the node agent's own environment")


@message
class NodeFacts:
    """node -> driver (tell), once it is registered: what this host offers. ``address_host`` is where the
    actors it starts listen (the interface the driver is reached from)."""

    host: str
    address_host: str
    gpus: int
    cpus: int


@message
class StartActor:
    """driver -> node (ask, answered with ActorStarted): start ``role`` here as actor ``name``, joined to the
    job, and supervise it; ``start`` numbers this start. ``config`` and ``settings`` are JSON objects as
    ``python -m vime.actor`` takes them; the node starts only roles it allows (built-in ones, and those its
    ``--allow-role`` names)."""

    name: str
    start: int
    role: str
    config: str
    settings: str
    seed: int
    record: bool
    env: dict[str, str]

    def __post_init__(self) -> None:
        check_placeable(self.name, self.env)


@message
class StartRank:
    """trainer (rank 0) -> node (ask, answered with ActorStarted): start a trainer rank here, as rank 0 starts
    those of its own host (``python -m vime.backends.tensor_parallel SPEC``, ``vime.trainer_ranks``), under
    ``name`` (``trainer-rank-N``), and supervise it as the node's actors; its exit (ActorExited) and output
    (LogLines) go to the trainer, not the driver. ``start`` is the trainer's number for it, as StopActor takes."""

    name: str
    start: int
    spec: str

    def __post_init__(self) -> None:
        check_placeable(self.name, {})


@message
class ActorStarted:
    """node -> driver, the answer to StartActor: the process is running (not yet registered)."""

    pid: int


@message
class StopActor:
    """driver -> node (tell): send ``signal`` to the processes of start ``start`` (the actor and what it
    started), if they still run. An exit that follows comes as ActorExited."""

    start: int
    signal: int


@message
class ActorExited:
    """node -> driver (tell): an actor this node started exited, with ``code`` (negative: killed by that
    signal). Sent for every exit, asked for or not: the driver's supervision decides what follows."""

    name: str
    start: int
    code: int


@message
class LogLines:
    """node -> driver (tell): what actor ``name``'s process wrote (stdout and stderr), appended to the driver's
    ``RUN_DIR/logs/NAME.log`` as its own spawns' are."""

    name: str
    data: bytes

    def __post_init__(self) -> None:
        check_placeable(self.name, {})
