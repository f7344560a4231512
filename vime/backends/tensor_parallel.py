"""A Megatron trainer of several ranks (tensor, data and pipeline parallel) that the trainer actor drives as if
it were one engine.

Rank 0 lives in the trainer actor's process; it starts ranks 1..N-1 as
processes of their own (``python -m vime.backends.tensor_parallel SPEC``)
where the trainer's plan puts them (``vime.trainer_ranks``): on its own host,
on the next GPUs of the trainer's placement (or on CPU, over gloo), or on
another host, through that host's node agent; the process and its spec are
the same either way. Every rank
builds the same :class:`~vime.backends.megatron.MegatronTrainEngine` and must
make the same collective calls in the same order, so rank 0 leads: before
each call it gives an order (which call, and its argument: a folder, say),
and the other ranks follow it. Orders go through the process group's
key-value store (rank 0's c10d store, on loopback, or on the address the other
hosts reach when ranks span hosts), as msgpack (:class:`Orders`), so that a rank
waiting for the next one runs nothing on its GPU; a step's batch follows
over the process group, integer headers and raw tensors, nothing pickled.
One lock keeps the orders in sequence when the actor calls from several
threads.

A follower that dies is noticed before the next order (its process has an
exit code, or its node agent reported one), and the trainer stops with the
rank, its host and the code, rather than
waiting on a collective that will never complete. One that dies during a
call ends the trainer's process a few seconds later, saying which rank, if
the call has not failed by then (NCCL on one host would wait for the
group's timeout); followers die with the process that started them (the
trainer's, or the node agent's for a rank on another host: ``vime.trainer_ranks``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import structlog
import torch
import torch.distributed as dist

from vime.backends.base import TensorBatch, TrainEngine
from vime.backends.plain_collectives import gather_plain
from vime.config import RunConfig
from vime.trainer_ranks import HEAD, Follower, RankPlan, RankSlot, start_here
from vime.transports.gpu import Spec, address_towards, dtype_named, gpu_uuid

DTYPES = (torch.int64, torch.float32, torch.int16)  # the dtypes of TensorBatch's fields
FIELDS = [field.name for field in dataclasses.fields(TensorBatch)]
MAX_DIMS = 4
GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # ranks load a whole checkpoint between collectives
# How long a follower tries to reach rank 0's store, which is up before any follower starts: past this, the
# address is one its host cannot reach, and saying so beats 30 minutes of silence.
STORE_REACH = datetime.timedelta(seconds=60)
IDLE = datetime.timedelta(days=7)  # how long a follower waits for its next order: a rollout may take hours
STUCK_S = 10.0  # a call still running this long after a follower died is waiting on that follower for good
EXIT_NEWS_S = 8.0  # how long a failed call waits for news of a rank's exit, to name it (a lost node: heartbeats)
LOCAL_EXIT_NEWS_S = 1.0  # the same when every rank is a child of this process: their exits are seen at once
PARENT_POLL_S = 0.5  # how often a follower checks that its parent still runs


class Orders:
    """Rank 0's messages to the other ranks, in sequence: the calls it orders, and whether they go on to the next
    weight bucket. They go through the process group's key-value store (TCP, on the host), not through a
    collective: a follower waiting in a collective would keep a kernel spinning on its GPU, which a colocated
    rollout engine shares, for the whole rollout, and would be ended by the group's timeout if the trainer
    had nothing to do for longer. A follower waits on a connection of its own (``store``), since a store
    connection serves one request at a time and torch's process group uses its own. Each message is
    deleted by the last rank to read it; an order has two items and a bucket answer one, so a follower that
    lost its place fails at once instead of taking one for the other."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.followers = dist.get_world_size() - 1
        self.count = 0  # messages sent (rank 0) or read (the others)

    def send(self, *items: Any) -> None:
        self.store.set(self._key(), msgpack.packb(items))

    def receive(self) -> list[Any]:
        key = self._key()
        self.store.wait([key], IDLE)
        items = msgpack.unpackb(self.store.get(key))
        if self.store.add(f"{key}/read", 1) == self.followers:
            self.store.delete_key(key)
            self.store.delete_key(f"{key}/read")
        return items

    def _key(self) -> str:
        self.count += 1
        return f"vime/order/{self.count}"


class LeadingEngine(TrainEngine):
    """Rank 0 of a Megatron trainer of several ranks: each call is ordered to every rank, then made here.

    ``plan`` says where the other ranks run (default: all on this host, over loopback); ``launch`` starts one
    (default: as a child of this process; ``vime.trainer_ranks.NodeRanks`` in the trainer actor, through a node
    agent for a rank on another host). Either way the rank is the same process, given the same spec."""

    def __init__(self, run: RunConfig, seed: int, plan: RankPlan | None = None,
                 launch: Callable[[RankSlot, str], Follower] = start_here) -> None:
        size = run.job.trainer_ranks
        self.plan = plan or RankPlan.local(size)
        store = _store(self.plan.store_host, 0, size, leader=True)
        os.environ.update(MASTER_ADDR=self.plan.store_host, MASTER_PORT=str(store.port), WORLD_SIZE=str(size),
                          RANK="0", LOCAL_RANK="0")
        structlog.get_logger().info("trainer ranks meet", store=f"{self.plan.store_host}:{store.port}",
                                    ranks=[slot.describe() for slot in self.plan.slots])
        self.followers: list[Follower] = []
        self._lock = threading.Lock()  # held for the length of each call, and of the build
        self._polling = threading.Lock()  # Popen.poll in two threads at once can miss an exit
        self._closing = False
        # watched from the first start: the group's forming and the engine's build wait on every rank as a call
        # does, and a rank that dies meanwhile (out of memory, a model folder missing on its host) stops them
        threading.Thread(target=self._watch, name="vime-trainer-ranks", daemon=True).start()
        try:
            with self._lock:
                for slot in self.plan.slots:
                    spec = {"config": run.to_dict(), "seed": seed, "rank": slot.rank, "local_rank": slot.local_rank,
                            "world_size": size, "store": [self.plan.store_host, store.port]}
                    self.followers.append(launch(slot, json.dumps(spec)))
                _join(store, 0, size)
                self.engine = _engine(run, seed)
                self._orders = Orders(store)
        except BaseException:
            self._closing = True
            for follower in self.followers:  # else they wait in the group for its timeout
                follower.kill()
            raise

    @property
    def device(self) -> str:  # type: ignore[override]
        return self.engine.device

    @property
    def weight_version(self) -> int:  # type: ignore[override]
        return self.engine.weight_version

    def train_step(self, batch: TensorBatch) -> dict[str, Any]:
        with self._call("train_step"):
            _send_batch(batch, self.device)
            return self.engine.train_step(batch)

    def named_weights(self, device: str | None = None) -> dict[str, torch.Tensor]:
        with self._call("named_weights"):
            return self.engine.named_weights(device)

    def save_hf(self, folder: Path) -> None:
        with self._call("save_hf", str(folder)):
            self.engine.save_hf(folder)

    def save(self, folder: Path) -> None:
        with self._call("save", str(folder)):
            self.engine.save(folder)

    def load(self, folder: Path) -> None:
        with self._call("load", str(folder)):
            self.engine.load(folder)

    def shared_buckets(self, bucket_bytes: int,
                       dtype: torch.dtype) -> Iterator[tuple[list[Spec], list[dict[str, Any]]]]:
        """Every rank gathers each bucket on its own GPU and offers it there: the descriptors of a bucket are
        those of all ranks, so that each GPU of a colocated engine copies from its own. The engine is held
        until the iterator ends or is closed: no other call may be made meanwhile."""
        with self._call("shared_buckets", json.dumps([bucket_bytes, str(dtype).removeprefix("torch.")])):
            yield from _shared_in_step(self.engine, self._orders, bucket_bytes, dtype)

    def gpus(self) -> list[str]:
        """The GPUs of the ranks on this host (those on other hosts are no engine's here to share)."""
        here = 1 + sum(slot.node is None for slot in self.plan.slots)
        return [gpu_uuid(rank) for rank in range(here)] if self.device == "cuda" else []

    def release_memory(self) -> None:
        """Returns once every rank has (a barrier: the engines about to wake count on it)."""
        with self._call("release_memory"):
            self.engine.release_memory()
            dist.barrier()

    def close(self) -> None:
        """Order the followers to stop and wait for them; with one of them dead, the others cannot finish a
        call either, and are killed."""
        with self._lock:
            self._closing = True
            if not self._dead():
                self._order("stop")
            else:
                for follower in self.followers:
                    follower.kill()
            for follower in self.followers:
                follower.wait(timeout=60)

    def _watch(self) -> None:
        """End this process when a follower has died and a call has run for :data:`STUCK_S` since without
        failing. The call's collectives wait on the dead rank: gloo notices the closed connection and fails
        them, but NCCL on one host waits for the group's timeout (30 minutes), holding the actor. The trainer
        actor's supervisor then reports the trainer's death, and the other followers die with this process."""
        since = None
        while not self._closing:
            dead = self._dead()
            since = (since or time.monotonic()) if dead and self._lock.locked() else None
            if since is not None and time.monotonic() - since > STUCK_S:
                slot, code = dead[0]
                structlog.get_logger().error(
                    "a trainer rank died during a call that waits on it; stopping the trainer", rank=slot.rank,
                    node=slot.node or HEAD, host=slot.host, exit_code=code, waited_s=STUCK_S,
                    hint="its own error is in the trainer's log; restart the run from its last checkpoint")
                # the line the driver reports as the trainer's last words (vime.pipeline.last_error)
                print(f"vime.actor: {slot.describe()} exited with code {code} during a call that waits on it; the "
                      "trainer stopped. Restart the run from its last checkpoint", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(1)

    def _dead(self) -> list[tuple[RankSlot, int]]:
        """``(slot, exit code)`` of each follower that has exited."""
        with self._polling:
            return [(slot, code) for slot, follower in zip(self.plan.slots, self.followers)
                    if (code := follower.poll()) is not None]

    @contextlib.contextmanager
    def _call(self, name: str, argument: str = "") -> Iterator[None]:
        """Hold the engine, order call ``name`` to every rank, and make it here (the body). A call that fails
        once a rank has died (gloo fails a collective whose peer closed its connection) fails naming the rank
        and its host: the collective's own error names only an address. The news of a rank on a node comes
        from its agent, a moment after its connections close: it is waited for up to ``EXIT_NEWS_S``; with every
        rank on this host, up to ``LOCAL_EXIT_NEWS_S`` (a call failing for a reason of its own is not held 8 s)."""
        with self._lock:
            self._order(name, argument)
            try:
                yield
            except Exception as err:
                remote = any(slot.node for slot in self.plan.slots)
                dead = self._dead_within(EXIT_NEWS_S if remote else LOCAL_EXIT_NEWS_S)
                if not dead:
                    raise
                raise _lost(*dead[0], f"during {name}") from err

    def _dead_within(self, seconds: float) -> list[tuple[RankSlot, int]]:
        deadline = time.monotonic() + seconds
        while not (dead := self._dead()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return dead

    def _order(self, name: str, argument: str = "") -> None:
        dead = self._dead()
        if dead:
            raise _lost(*dead[0], f"before {name}")
        self._orders.send(name, argument)


def _lost(slot: RankSlot, code: int, when: str) -> RuntimeError:
    """The error for a rank that exited, naming it and its host; logged as well, since the driver reports the
    trainer's last logged error when it dies."""
    lost = RuntimeError(f"{slot.describe()} exited with code {code} {when}; its output is in the trainer's log. "
                        "Restart the run from its last checkpoint")
    structlog.get_logger().error("a trainer rank exited", rank=slot.rank, node=slot.node or HEAD, host=slot.host,
                                 exit_code=code, exc_info=lost)
    return lost


def _engine(run: RunConfig, seed: int) -> Any:
    from vime.backends.megatron import MegatronTrainEngine

    return MegatronTrainEngine(**run.train_engine_arguments(seed))


def _store(host: str, port: int, size: int, *, leader: bool) -> dist.TCPStore:
    """The group's meeting point, at ``host`` (an address every rank reaches: loopback on one host). Rank 0
    binds a port the kernel picks (``port`` 0) and holds it until the group has formed (a port found free,
    released and bound again later could be taken in between); the other ranks connect to the port it got,
    which their spec names, and fail within ``STORE_REACH`` saying what to check when it cannot be reached."""
    if leader:
        return dist.TCPStore(host, port, size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    try:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=STORE_REACH)
    except RuntimeError as err:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
        raise RuntimeError(
            f"this trainer rank could not reach rank 0's store at {host}:{port} within "
            f"{STORE_REACH.total_seconds():.0f} s ({err}). Rank 0 listens on the run's --host: give it an address "
            "this host reaches (not a loopback or a private address of the head's own network), and let TCP "
            "through from the trainer's nodes to the head on any port") from err
    store.set_timeout(GROUP_TIMEOUT)
    return store


def _join(store: dist.TCPStore, rank: int, size: int) -> None:
    """Every rank forms the default group the same way, over ``store`` as it is (``init_parallel`` then finds
    it formed); torch's ``env://`` would add a key prefix that a group over a given store lacks. Gloo and
    NCCL's bootstrap listen on the interface that reaches the store (``interface_towards``): by default they
    take the address the host name resolves to, which other hosts may not reach. A user's own
    ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` stays."""
    interface = interface_towards(os.environ["MASTER_ADDR"])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)  # on GPUs too: megatron-core makes gloo groups beside
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if interface != "lo":  # NCCL on one host needs no socket: leave its own choice
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=rank,
                            world_size=size, timeout=GROUP_TIMEOUT)


def interface_towards(address: str) -> str:
    """The name of this host's network interface that packets to ``address`` leave by (the one holding
    :func:`~vime.transports.gpu.address_towards` it)."""
    import psutil

    local = address_towards(address)
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.family == socket.AF_INET and entry.address == local for entry in addresses):
            return name
    raise RuntimeError(f"no network interface of this host has {local}, the address it reaches the trainer's "
                       f"store at {address} from; set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) to the one "
                       "other hosts reach")


def follow(spec: dict[str, Any], parent: int) -> None:
    """A follower rank, on rank 0's host or another (its spec says which rank, and where the store is): join
    the group, build the engine, then carry out rank 0's orders until it says stop. ``parent``: the pid of the
    process that started it, which it ends with."""
    _exit_with_parent(parent)
    rank, size = spec["rank"], spec["world_size"]
    host, port = spec["store"]
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), WORLD_SIZE=str(size), RANK=str(rank),
                      LOCAL_RANK=str(spec["local_rank"]))
    _join(_store(host, port, size, leader=False), rank, size)
    engine = _engine(RunConfig.from_dict(spec["config"]), spec["seed"])
    orders = Orders(_store(host, port, size, leader=False))
    while True:
        name, argument = orders.receive()
        if name == "stop":
            break
        if name == "train_step":
            engine.train_step(_receive_batch(engine.device))
        elif name == "named_weights":
            engine.join_weight_gather()
        elif name == "shared_buckets":
            bucket_bytes, dtype = json.loads(argument)
            for _ in _shared_in_step(engine, orders, bucket_bytes, dtype_named(dtype)):
                pass
        elif name == "release_memory":
            engine.release_memory()
            dist.barrier()
        elif name in ("save", "load", "save_hf"):
            getattr(engine, name)(Path(argument))
        else:
            raise ValueError(f"rank 0 gave an order this rank does not know: {name!r}; are all ranks one vime version?")
    dist.destroy_process_group()


def _shared_in_step(engine: Any, orders: Orders, bucket_bytes: int,
                    dtype: torch.dtype) -> Iterator[tuple[list[Spec], list[dict[str, Any]]]]:
    """Every rank's part of :meth:`LeadingEngine.shared_buckets`: rank 0 yields each bucket with every rank's
    descriptor of it, then says whether the others go on to the next. They keep their buffer until it does
    (the consumer is done with it) and stop with it when it stops early, so no rank waits in a gather alone."""
    leader = dist.get_rank() == 0
    for specs, buffers in engine.shared_buckets(bucket_bytes, dtype):
        offered = gather_plain(buffers[0])
        if leader:
            stop = True
            try:
                yield specs, offered
                stop = False
            finally:
                orders.send(stop)
        else:
            (stop,) = orders.receive()
            if stop:
                return


def _broadcast(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """``tensor`` from rank 0 to every rank, through ``device`` (NCCL moves only GPU tensors); on the CPU after.
    It travels as its bytes: neither gloo nor NCCL reduces or sends int16 (routed experts) as such."""
    moved = tensor.to(device).contiguous()
    dist.broadcast(moved.view(torch.uint8), src=0)
    return moved.cpu()


def _send_batch(batch: TensorBatch, device: str) -> None:
    for name in FIELDS:
        value = getattr(batch, name)
        if value is None:
            _broadcast(torch.full((2 + MAX_DIMS,), -1, dtype=torch.int64), device)
            continue
        shape = list(value.shape) + [0] * (MAX_DIMS - value.dim())
        _broadcast(torch.tensor([DTYPES.index(value.dtype), value.dim(), *shape]), device)
        _broadcast(value, device)


def _receive_batch(device: str) -> TensorBatch:
    fields: dict[str, torch.Tensor | None] = {}
    for name in FIELDS:
        header = _broadcast(torch.zeros(2 + MAX_DIMS, dtype=torch.int64), device).tolist()
        if header[0] < 0:
            fields[name] = None
            continue
        dims = header[1]
        fields[name] = _broadcast(torch.empty(header[2:2 + dims], dtype=DTYPES[header[0]]), device)
    return TensorBatch(**fields)


def _exit_with_parent(parent: int) -> None:
    """In a follower, first thing: end it when its parent ends, however that ends: rank 0's process on its host,
    a node agent on another (a follower left waiting in a collective would otherwise wait for the process
    group's timeout). Polled, not the kernel's parent-death signal: that fires when the *thread* that started
    the process ends, and a node agent (trio) starts processes from worker threads that come and go. The parent
    is the pid its starter gave, not ``os.getppid()`` read now: a parent killed while this module's imports
    took their seconds has already left this process to another. Not an actor's two watches (``vime.actor``: a
    graceful stop, then a hard one): a follower has no event loop to stop gracefully, so it ends at once."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="vime-exit-with-parent", daemon=True).start()


if __name__ == "__main__":
    follow(json.loads(sys.argv[1]), int(sys.argv[2]))
