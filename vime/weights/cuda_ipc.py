"""Weights over CUDA IPC: rollout engines on the trainer's own GPUs ("colocate"); only descriptors cross the socket.

The version goes a bucket of ``--weight-bucket-mb`` at a time, each bucket to all the workers at once: every
tensor-parallel rank of the trainer packs it on its GPU (:meth:`TrainEngine.shared_buckets`, one buffer shared
once for the run: :class:`~vime.transports.gpu.SharedBuckets`), each engine copies from the one on its own GPU,
and the memory is reused for the next bucket once every receiver has answered. A last message, with no bucket,
ends the version. From the first bucket to the last the engine holds two versions mixed and generates nothing;
if a bucket fails, it stays so until a full set arrives another way (the fallback).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import trio

from vime.backends.hf import DTYPES
from vime.runtime import PeerGone, RemoteError
from vime.transports.records import message
from vime.weights.base import Gathered, WeightPath


@message
class WeightsShared:
    """trainer -> a rollout worker whose engine is on the trainer's GPUs (ask, answered with BucketLoaded):
    message ``index`` of the weights of ``version`` over CUDA IPC, a bucket each. ``buffers`` describe its bytes
    on each trainer GPU (``vime.transports.gpu.share``), ``specs`` the tensors packed in it ([name, shape, dtype
    name] each, ``vime.transports.gpu.unpack``); the trainer reuses the memory once answered. The ``last``
    message may carry no bucket: after it the engine holds ``version``; from the first to the last it
    generates nothing."""

    version: int
    specs: list[list[Any]]
    buffers: list[dict[str, Any]]
    index: int
    last: bool


@message
class BucketLoaded:
    """rollout worker -> trainer, the answer to WeightsShared: the engine has copied that bucket of ``version``
    (after the ``last`` message: it holds ``version``); the trainer may reuse the bucket's memory."""

    version: int


class CudaIpc(WeightPath):
    name = "ipc"
    kinds = (WeightsShared,)
    priority = 2
    together = True

    @staticmethod
    def suits(ours: set[str], theirs: set[str]) -> bool:
        return bool(theirs) and theirs <= ours  # every GPU of the engine has a trainer rank on it

    @staticmethod
    def refuses(ours: set[str], theirs: set[str]) -> str | None:
        return None if CudaIpc.suits(ours, theirs) else "the rollout engine on the trainer's GPUs and on no other"

    def wants(self) -> Gathered | None:
        return None

    async def send(self, workers: list[str], tensors: dict[str, torch.Tensor]) -> list[str]:
        """Bucket by bucket to every worker still answering; once none is left, the trainer's ranks stop
        gathering. With sleep mode the message that ends the version comes once every rank has given back
        what the publication used, so that a sleeping engine wakes its KV cache beside the trainer's steady
        memory only."""
        sender = self.sender
        actor, engine, run = sender.actor, sender.engine, sender.run
        version, failed, gone = engine.weight_version, [], set()

        async def load(worker: str, message: WeightsShared) -> None:
            try:
                await actor.ask(worker, message, timeout=600.0)
            except (PeerGone, LookupError):
                gone.add(worker)
                sender.gone(worker)
            except (RemoteError, TimeoutError) as err:
                actor.log.warning("weights over CUDA IPC failed", worker=worker, error=str(err))
                failed.append(worker)

        def receivers() -> list[str]:
            return [worker for worker in workers if worker not in failed and worker not in gone]

        async def to_receivers(specs: list[list[Any]], buffers: list[dict[str, Any]], index: int, last: bool) -> None:
            message = WeightsShared(version=version, specs=specs, buffers=buffers, index=index, last=last)
            async with trio.open_nursery() as nursery:
                for worker in receivers():
                    nursery.start_soon(load, worker, message)

        buckets = engine.shared_buckets(run.job.weight_bucket_mb << 20, DTYPES[run.model.dtype])
        count = 0
        with contextlib.closing(buckets):  # stopping early stops every rank after the same bucket
            for bucket, buffers in buckets:
                await to_receivers([list(spec) for spec in bucket], buffers, count, last=False)
                if not receivers():
                    break  # before the next bucket is gathered
                count += 1
        if run.rollout.sleep_mode:  # also before the failed ones get theirs by nng
            await trio.to_thread.run_sync(engine.release_memory)
        if receivers():
            await to_receivers([], [], count, last=True)
        return failed

    async def receive(self, msg: WeightsShared) -> BucketLoaded:
        receiver = self.receiver
        receiver.loading = msg.version

        def load() -> None:  # runs between two steps: the loop must see the update done when it goes on
            receiver.engine.load_shared(msg.specs, msg.buffers, msg.version, msg.index, msg.last)
            if msg.last:
                receiver.loading = None

        await receiver.between_steps(load)
        return BucketLoaded(version=msg.version)
