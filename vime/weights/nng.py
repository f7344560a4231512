"""Weights over nng, in chunks: the path that reaches every worker (CPU, tests, small models, hosts without a GPU
link), and the fallback when a GPU path fails.

The trainer cuts a CPU copy of the version into chunks of about ``--weight-chunk-mb``, once per version (the
outbox may still be sending them while the optimizer writes the next version), and tells them to the worker;
the worker applies a version only once all of its chunks are in, and a newer complete version supersedes an
older one.
"""

from __future__ import annotations

import torch

from vime.transports.records import message
from vime.weights.base import Gathered, WeightPath


@message
class WeightsChunk:
    """trainer -> rollout worker: part ``index`` of ``count`` of the weights of ``version``."""

    version: int
    index: int
    count: int
    tensors: dict[str, torch.Tensor]


def grouped(tensors: dict[str, torch.Tensor], limit_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive tensors in groups of at most ``limit_bytes`` each (a larger tensor alone): a version's
    chunks over nng, a broadcast's buckets."""
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if parts[-1] and size + tensor.nbytes > limit_bytes:
            parts.append({})
            size = 0
        parts[-1][name] = tensor
        size += tensor.nbytes
    return parts


class Nng(WeightPath):
    name = "nng"
    kinds = (WeightsChunk,)
    everywhere = True

    chunks: list[WeightsChunk]  # sender: a CPU copy of the newest version, made when first needed
    arriving: dict[int, dict[int, dict[str, torch.Tensor]]]  # receiver: version -> index -> tensors

    def __init__(self, **halves) -> None:
        super().__init__(**halves)
        self.chunks, self.arriving = [], {}

    @staticmethod
    def suits(ours: set[str], theirs: set[str]) -> bool:
        return True

    def chunked(self) -> bool:
        """Whether the chunks of the current version are made."""
        return bool(self.chunks) and self.chunks[0].version == self.sender.engine.weight_version

    def wants(self) -> Gathered | None:
        return None if self.chunked() else "host"

    def cut(self, tensors: dict[str, torch.Tensor]) -> list[WeightsChunk]:
        """A CPU copy of the current version cut into chunks of about ``weight_chunk_mb`` each, made once per
        version. Host tensors of a GPU trainer are such copies already (:meth:`WeightSender.outgoing`); a CPU
        trainer's are its own."""
        if self.chunked():
            return self.chunks
        engine = self.sender.engine
        parts = grouped(tensors, self.sender.run.job.weight_chunk_mb << 20)
        self.chunks = [WeightsChunk(version=engine.weight_version, index=i, count=len(parts),
                                    tensors={name: t.to("cpu", copy=engine.device == "cpu") for name, t in p.items()})
                       for i, p in enumerate(parts)]
        return self.chunks

    async def send(self, workers: list[str], tensors: dict[str, torch.Tensor]) -> list[str]:
        """Queued in the outbox, chunk by chunk."""
        version = self.sender.engine.weight_version
        for worker in workers:
            for chunk in self.cut(tensors):
                await self.sender.actor.tell(worker, chunk, weight_version=version)
        return []

    async def receive(self, msg: WeightsChunk) -> None:
        if msg.version <= self.receiver.engine.weight_version:
            return
        parts = self.arriving.setdefault(msg.version, {})
        parts[msg.index] = msg.tensors
        if len(parts) == msg.count:
            merged = {name: tensor for index in sorted(parts) for name, tensor in parts[index].items()}
            self.arriving = {v: p for v, p in self.arriving.items() if v > msg.version}
            self.receiver.arrived(msg.version, merged)
