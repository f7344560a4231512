"""Where the trainer's ranks run, and how rank 0 starts the others there: on this host, or through a node agent.

The trainer's ranks (``--tensor-model-parallel-size`` x ``--data-parallel-size`` x
``--pipeline-model-parallel-size``) are laid out in Megatron's rank order, ``--actor-num-gpus-per-node`` of them
per host (ranks per host on CPU): the head (the driver's host, where rank 0, the trainer actor, runs) holds the
first, each of ``--actor-num-nodes`` - 1 node agents (``python -m vime.node``) the next ones. A tensor-parallel
group, of consecutive ranks, stays within a host; data-parallel copies span hosts. :func:`plan_ranks` makes the
plan, or refuses one the joined nodes cannot hold.

Every rank but 0 is the same process wherever it runs, ``python -m vime.backends.tensor_parallel SPEC``
(:func:`rank_command`): rank 0 starts those of the head as its children, and asks a node agent for the others
(:class:`NodeRanks`), which supervises them as it does the actors it starts: their exit reported at once, their
output forwarded (both to the trainer, whose log then holds every rank's output, as for its local ranks), and
stopped with the job. What is left out: a node's ranks on GPUs other than those its agent sees, and
restarting a lost rank (the run stops; ``--resume`` continues it).

Torch-free: the node agent imports it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import trio

from vime.messages.nodes import ActorExited, LogLines, StartRank, StopActor

RANK_MODULE = "vime.backends.tensor_parallel"
HEAD = "head"  # the node name of the driver's host in a plan and in RUN_DIR/actors.json


@dataclasses.dataclass(frozen=True)
class RankSlot:
    """Where trainer rank ``rank`` runs: on node agent ``node`` (None: the head, as a child of rank 0), its
    ``local_rank``-th GPU there; ``host`` names the host for the user (its address)."""

    rank: int
    local_rank: int
    node: str | None = None
    host: str = "127.0.0.1"

    def describe(self) -> str:
        """The rank, and where it ran when not on the head, as an error names it."""
        return f"trainer rank {self.rank}" + (f" on node {self.node} ({self.host})" if self.node else "")


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """The trainer's ranks after rank 0 (``slots``), and the address rank 0's store binds, which every rank
    reaches (loopback while all run on the head)."""

    store_host: str
    slots: tuple[RankSlot, ...]

    @classmethod
    def local(cls, ranks: int) -> RankPlan:
        """Every rank on this host, over loopback: one host's trainer, as before nodes."""
        return cls("127.0.0.1", tuple(RankSlot(rank, rank) for rank in range(1, ranks)))

    def to_dict(self) -> dict[str, Any]:
        return {"store_host": self.store_host, "slots": [dataclasses.asdict(slot) for slot in self.slots]}

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> RankPlan:
        return cls(str(document["store_host"]), tuple(RankSlot(**slot) for slot in document["slots"]))

    def rows(self, head_host: str) -> list[dict[str, Any]]:
        """Every rank, 0 included, with its node and host: for RUN_DIR/actors.json."""
        return [{"rank": 0, "local_rank": 0, "node": HEAD, "host": head_host},
                *({**dataclasses.asdict(slot), "node": slot.node or HEAD} for slot in self.slots)]


class NodeFacts(Protocol):
    """What :func:`plan_ranks` reads of a joined node (``vime.cluster.NodeInfo``)."""

    name: str
    address_host: str
    gpus: int


def plan_ranks(ranks: int, per_node: int, store_host: str, nodes: Sequence[NodeFacts], on_gpu: bool) -> RankPlan:
    """``ranks`` over the head and ``nodes``, ``per_node`` each in Megatron's order (``nodes`` in the order given;
    ``vime.placement.check_trainer_nodes`` has checked the flags). ValueError naming what is missing: a node too
    few, or GPUs a node lacks (``on_gpu``: the ranks run on GPUs)."""
    hosts = ranks // per_node
    if hosts - 1 != len(nodes):
        raise ValueError(f"--actor-num-nodes {hosts}: the trainer needs {hosts - 1} node(s) beside this host, "
                         f"{len(nodes)} given ({', '.join(n.name for n in nodes) or 'none'})")
    short = [f"{node.name} offers {node.gpus}" for node in nodes if on_gpu and node.gpus < per_node]
    if short:
        raise ValueError(f"--actor-num-gpus-per-node {per_node}: {'; '.join(short)} GPU(s); start its agent on a "
                         f"host with {per_node} GPUs, or pass a smaller --actor-num-gpus-per-node")
    slots = [RankSlot(rank, rank % per_node, None if rank < per_node else nodes[rank // per_node - 1].name,
                      store_host if rank < per_node else nodes[rank // per_node - 1].address_host)
             for rank in range(1, ranks)]
    return RankPlan(store_host, tuple(slots))


def rank_command(spec: str) -> list[str]:
    """The process of a trainer rank after 0, on the head and on a node alike: this Python, the rank's module, its
    spec (JSON: the run's config, its seed, its rank and where the store is) and the pid of the process that
    starts it (this one: rank 0's, or a node agent's), which the rank ends with."""
    return [sys.executable, "-m", RANK_MODULE, spec, str(os.getpid())]


class Follower(Protocol):
    """A started rank, as rank 0 watches it (``subprocess.Popen`` is one)."""

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


def start_here(slot: RankSlot, spec: str) -> Follower:
    """A rank on this host: a child of rank 0's process, its output in rank 0's (the trainer's log)."""
    return subprocess.Popen(rank_command(spec))


class _NodeFollower:
    """A rank a node agent runs: its exit comes as ActorExited (:meth:`NodeRanks.exited`), a kill goes as
    StopActor; both through the trainer actor's loop, from the engine's threads."""

    def __init__(self, ranks: NodeRanks, node: str, start: int) -> None:
        self.ranks, self.node, self.start = ranks, node, start
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.ranks.from_thread(self.ranks.actor.start_soon, self.ranks.actor.tell_quietly, self.node,
                                   StopActor(start=self.start, signal=int(signal.SIGKILL)))

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"trainer rank on {self.node}", timeout or 0.0)
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class NodeRanks:
    """Rank 0's launcher in the trainer actor: a slot on the head is started here (:func:`start_here`), one on a
    node through its agent (StartRank), waiting for the agent's answer. Its
    :meth:`__call__` runs in a worker thread of the actor's loop (the engine is built in one) and reaches the
    loop; a kill may come from any thread."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._token: trio.lowlevel.TrioToken | None = None  # the actor's loop, once a rank is on a node
        self._followers: dict[str, _NodeFollower] = {}  # by the rank's name on its node
        self._starts = 0

    def from_thread(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def __call__(self, slot: RankSlot, spec: str) -> Follower:
        if slot.node is None:
            return start_here(slot, spec)
        if self._token is None:  # for the engine's own threads (its watch), which reach the loop later
            self._token = trio.from_thread.run_sync(trio.lowlevel.current_trio_token)
        self._starts += 1
        name = f"trainer-rank-{slot.rank}"
        follower = self._followers[name] = _NodeFollower(self, slot.node, self._starts)
        order = StartRank(name=name, start=follower.start, spec=spec)
        trio.from_thread.run(self.actor.ask, slot.node, order)
        return follower

    def exited(self, node: str, msg: ActorExited) -> None:
        """A node reports that one of our ranks exited (the trainer actor's handler calls this)."""
        follower = self._followers.get(msg.name)
        if follower is not None and follower.node == node and follower.start == msg.start:
            follower.exit(msg.code)

    def node_gone(self, node: str) -> None:
        """A node the driver counts lost (its agent dead or cut off) took our ranks there with it (each exits with
        its agent): they count as killed, as no agent is left to report their exit."""
        for name, follower in self._followers.items():
            if follower.node == node and follower.returncode is None:
                self.actor.log.error("a trainer rank's node was lost", rank=name, node=node)
                follower.exit(-int(signal.SIGKILL))

    def output(self, node: str, msg: LogLines) -> None:
        """What a rank on a node wrote goes where a local rank's goes: the trainer's own output (its log)."""
        if msg.name in self._followers and self._followers[msg.name].node == node:
            sys.stderr.buffer.write(msg.data)
            sys.stderr.buffer.flush()
