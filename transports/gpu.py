"""Named tensors between processes by the GPU's own paths: CUDA IPC on one GPU, bucketed broadcast across GPUs.

Only plain data describes the tensors (msgpack-safe: names, shapes, dtype names, handle bytes); the
bytes themselves never cross an nng socket.

* CUDA IPC (sender and receiver on the same GPU): :func:`share` turns CUDA tensors into
  descriptors of their memory; :func:`open_shared` maps them in the receiving process, no copy.
  torch's IPC reference counts keep the sender's memory alive until the receiver drops its views,
  and its event makes the receiver wait for the sender's pending writes. A descriptor names its
  GPU by UUID, because device indices differ between processes with different
  ``CUDA_VISIBLE_DEVICES``.
* Broadcast (different GPUs or hosts): :class:`BroadcastGroup` is a process group of its own
  (NCCL on GPUs, gloo on CPU), independent of any ``torch.distributed`` world the trainer or the
  inference engine already runs. One sender (rank 0) packs tensors into buckets of about
  ``bucket_bytes``: one collective per bucket instead of one per tensor, and receivers hold at
  most a bucket at a time. Both sides derive the same buckets from the same specs
  (:func:`specs`), which the sender ships over nng beforehand.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from vime.transports.codec import TORCH_DTYPES

Spec = tuple[str, list[int], str]  # name, shape, dtype name


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype called ``name`` ("bfloat16"), from the codec's table of dtypes that may travel."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"{name!r} is not a torch dtype that travels; one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gpu_uuid(device: int | None = None) -> str:
    """The GPU's UUID: the same in every process, whatever ``CUDA_VISIBLE_DEVICES`` says."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).uuid)


def share(tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Descriptors another process on the same GPU opens with :func:`open_shared`."""
    from torch.multiprocessing.reductions import reduce_tensor

    shared = []
    uuids: dict[int, str] = {}
    for name, tensor in tensors.items():
        if not tensor.is_cuda:
            raise ValueError(f"{name} is on {tensor.device}: CUDA IPC shares CUDA tensors only")
        _, (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset, _, counter,
            counter_offset, event, event_sync) = reduce_tensor(tensor.detach())
        if device not in uuids:
            uuids[device] = gpu_uuid(device)
        shared.append({"name": name, "shape": list(size), "stride": list(stride), "offset": offset,
                       "dtype": _dtype_name(dtype), "gpu": uuids[device], "handle": handle,
                       "storage_bytes": storage_bytes, "storage_offset": storage_offset, "counter": counter,
                       "counter_offset": counter_offset, "event": event, "event_sync": event_sync})
    return shared


def open_shared(descriptors: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Views of another process's CUDA tensors; a descriptor from another GPU is refused with what to do."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = torch.cuda.current_device()
    here = gpu_uuid(device)
    opened = []
    for d in descriptors:
        if d["gpu"] != here:
            raise ValueError(f"{d['name']} lives on GPU {d['gpu']}, this process uses {here}: CUDA IPC needs "
                             "sender and receiver on the same GPU; across GPUs, send weights by broadcast")
        opened.append((d["name"], rebuild_cuda_tensor(
            torch.Tensor, torch.Size(d["shape"]), tuple(d["stride"]), d["offset"], torch.storage.TypedStorage,
            dtype_named(d["dtype"]), device, d["handle"], d["storage_bytes"], d["storage_offset"], False,
            d["counter"], d["counter_offset"], d["event"], d["event_sync"])))
    return opened


def specs(tensors: dict[str, torch.Tensor]) -> list[Spec]:
    """What a receiver needs to know, before a broadcast, to receive ``tensors``."""
    return [(name, list(t.shape), _dtype_name(t.dtype)) for name, t in tensors.items()]


def buckets(spec_list: list[Spec], bucket_bytes: int) -> list[list[Spec]]:
    """Consecutive specs of one dtype, up to ``bucket_bytes`` each (a larger tensor gets a bucket alone)."""
    grouped: list[list[Spec]] = []
    size = 0
    for spec in spec_list:
        nbytes = math.prod(spec[1]) * dtype_named(spec[2]).itemsize
        if not grouped or grouped[-1][0][2] != spec[2] or size + nbytes > bucket_bytes:
            grouped.append([])
            size = 0
        grouped[-1].append(spec)
        size += nbytes
    return grouped


class BroadcastGroup:
    """A process group of its own between one sender (rank 0) and receivers (ranks 1..n-1).

    ``address`` is ``tcp://HOST:PORT``: the sender listens there (torch's TCPStore; port 0 picks a
    free one, then :attr:`address` names it) and the receivers connect. Constructing returns at
    once; the group itself forms at the first broadcast, which every member must enter."""

    def __init__(self, address: str, rank: int, world_size: int, *, device: str | None = None,
                 timeout_s: float = 600.0) -> None:
        url = urlsplit(address)
        if url.scheme != "tcp" or not url.hostname or url.port is None or (url.port == 0 and rank != 0):
            raise ValueError(f"a broadcast group meets at tcp://HOST:PORT (port 0 for the sender), not {address!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(url.hostname, url.port, world_size, rank == 0, timeout=self.timeout,
                                   wait_for_workers=False)
        self.address = f"tcp://{url.hostname}:{self.store.port}"
        self.rank, self.world_size = rank, world_size
        if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._group: dist.ProcessGroup | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        """NCCL on a GPU, gloo on CPU; made at first use, because gloo's blocks until every member is there."""
        if self._group is None:
            if self.device.type == "cuda":
                self._group = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size)
            else:
                self._group = dist.ProcessGroupGloo(self.store, self.rank, self.world_size, self.timeout)
        return self._group

    def abort(self) -> None:
        """Tear the group down, so that a collective waiting on a dead member stops waiting (on NCCL, it
        would otherwise hold the stream every later kernel queues behind)."""
        if self._group is not None:
            self._group.abort()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """One broadcast from rank 0; returns once ``tensor`` holds the data here (NCCL: on this stream)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def send(self, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> None:
        """Broadcast ``tensors`` (on this group's device) in the buckets :func:`buckets` makes of their specs."""
        for bucket in buckets(specs(tensors), bucket_bytes):
            flat = torch.cat([tensors[name].reshape(-1) for name, _, _ in bucket]) if len(bucket) > 1 \
                else tensors[bucket[0][0]].reshape(-1).contiguous()
            self.broadcast(flat)

    def receive(self, spec_list: list[Spec], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The broadcast tensors, a bucket at a time (each bucket a tensor of its own, views into it)."""
        for bucket in buckets(spec_list, bucket_bytes):
            flat = torch.empty(sum(math.prod(shape) for _, shape, _ in bucket), dtype=dtype_named(bucket[0][2]),
                               device=self.device)
            self.broadcast(flat)
            sizes = [math.prod(shape) for _, shape, _ in bucket]
            yield [(name, part.view(shape)) for (name, shape, _), part in zip(bucket, flat.split(sizes))]
