"""Weights by broadcast: rollout engines on GPUs other than the trainer's (NCCL, also across hosts), or both on
CPU (gloo, with ``--weight-sync broadcast``).

When a worker joins, the trainer forms a group of their own with it (:class:`~vime.transports.gpu.BroadcastGroup`:
the trainer rank 0, the engine's GPUs the next ranks), meeting on the trainer's host (its ``--host``; gloo
listens on each member's address towards it); a group that cannot form (a port the worker cannot reach, say)
leaves the worker on nng, and the trainer logs the path that serves each worker ("weight path"). Each
version, the trainer names the tensors (WeightsBroadcast) and broadcasts them in buckets of
``--weight-bucket-mb``; the worker's engine receives them between two steps and answers once it has loaded
them.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import torch
import trio

from vime.runtime import PeerGone, RemoteError
from vime.transports.gpu import BroadcastGroup, specs
from vime.transports.records import message
from vime.weights.base import WeightPath


@message
class BroadcastJoin:
    """trainer -> a rollout worker on other GPUs or hosts (ask, answered with BroadcastJoined): join the trainer's
    broadcast group at ``address`` (the trainer is rank 0, the engine's GPUs the next)."""

    address: str
    world_size: int
    device: str  # "cuda" (NCCL) or "cpu" (gloo): the members must agree


@message
class WeightsBroadcast:
    """trainer -> a worker in its broadcast group (ask, answered with BroadcastLoaded): the full weights of
    ``version`` are being broadcast now, in the buckets ``vime.transports.gpu.buckets`` makes of ``specs``."""

    version: int
    specs: list[list[Any]]  # [name, shape, dtype name] per tensor
    bucket_bytes: int


@message
class BroadcastJoined:
    """rollout worker -> trainer, the answer to BroadcastJoin: the engine is in the group; it holds ``version``."""

    version: int


@message
class BroadcastLoaded:
    """rollout worker -> trainer, the answer to WeightsBroadcast: the engine received and loaded ``version``."""

    version: int


class Broadcast(WeightPath):
    name = "broadcast"
    kinds = (BroadcastJoin, WeightsBroadcast)
    priority = 1

    groups: dict[str, BroadcastGroup]  # sender: worker -> its group

    def __init__(self, **halves) -> None:
        super().__init__(**halves)
        self.groups = {}

    @staticmethod
    def suits(ours: set[str], theirs: set[str]) -> bool:
        return bool(ours) and bool(theirs) and not ours & theirs

    @staticmethod
    def refuses(ours: set[str], theirs: set[str]) -> str | None:
        if Broadcast.suits(ours, theirs) or not (ours or theirs):
            return None
        return "the rollout engine on GPUs other than the trainer's (NCCL) or both on CPU (gloo)"

    async def attach(self, worker: str, gpus: list[str]) -> bool:
        """A group between us (rank 0) and the worker's engine, meeting on our host; False when it cannot form."""
        actor, engine = self.sender.actor, self.sender.engine
        world_size = 1 + max(len(gpus), 1)
        listen = actor.settings.listen
        host = urlsplit(listen).hostname if listen.startswith(("tcp", "tls")) else None
        device = torch.device(engine.device).type
        group = BroadcastGroup(f"tcp://{host or '127.0.0.1'}:0", 0, world_size, device=device, timeout_s=600.0)
        try:
            await actor.ask(worker, BroadcastJoin(address=group.address, world_size=world_size, device=device),
                            timeout=120.0)
        except (RemoteError, TimeoutError) as err:
            actor.log.warning("no broadcast group with this worker: its weights go over nng", worker=worker,
                              address=group.address, error=str(err))
            return False
        self.groups[worker] = group
        return True

    def detach(self, worker: str) -> None:
        self.groups.pop(worker, None)

    async def send(self, workers: list[str], tensors: dict[str, torch.Tensor]) -> list[str]:
        """Returns once the worker holds them; a failed load raises (RemoteError, TimeoutError)."""
        actor = self.sender.actor
        version = self.sender.engine.weight_version
        bucket_bytes = self.sender.run.job.weight_bucket_mb << 20
        message = WeightsBroadcast(version=version, specs=[list(s) for s in specs(tensors)], bucket_bytes=bucket_bytes)
        for worker in workers:
            failure: Exception | None = None
            group = self.groups[worker]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_buckets, group, tensors, bucket_bytes)
                try:
                    await actor.ask(worker, message, timeout=600.0)
                except (PeerGone, LookupError, RemoteError, TimeoutError) as err:
                    failure = err
                    group.abort()  # a collective stuck on a dead peer must not hold our GPU stream
                    nursery.cancel_scope.cancel()
            if failure is not None:
                raise failure
        return []

    async def _send_buckets(self, group: BroadcastGroup, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> None:
        """The sender's half of a broadcast. If the group breaks, the receiver's half fails too, and its
        answer (or its absence) is what the caller acts on."""
        try:
            await trio.to_thread.run_sync(group.send, tensors, bucket_bytes, abandon_on_cancel=True)
        except Exception as err:
            self.sender.actor.log.warning("weight broadcast failed", error=f"{type(err).__name__}: {err}")

    async def receive(self, msg: BroadcastJoin | WeightsBroadcast) -> BroadcastJoined | BroadcastLoaded:
        engine = self.receiver.engine
        if isinstance(msg, BroadcastJoin):
            await self.receiver.between_steps(engine.join_broadcast, msg.address, 1, msg.world_size, msg.device)
            return BroadcastJoined(version=engine.weight_version)
        await self.receiver.between_steps(engine.receive_broadcast, msg.specs, msg.bucket_bytes, msg.version)
        return BroadcastLoaded(version=msg.version)
