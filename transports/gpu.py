"""Named tensors between processes by the GPU's own paths: CUDA IPC on one GPU, bucketed broadcast across GPUs.

Only plain data describes the tensors (msgpack-safe: names, shapes, dtype names, handle bytes); the
bytes themselves never cross an nng socket. Both paths move weights in buckets: :func:`packed` copies
consecutive tensors into one flat byte buffer of about ``bucket_bytes``, and the receiver cuts the same
buffer back into tensors (:func:`unpack`) from their specs. A bucket at a time bounds what either side
holds beside the model to about one bucket (the sender's buffer, :class:`BucketMemory`, no larger than
what it carries), and a transfer is one operation per bucket, not one per tensor.

* CUDA IPC (sender and receiver on the same GPU): :func:`share` turns a CUDA tensor into a
  descriptor of its memory; :func:`open_shared` maps it in the receiving process, no copy. The
  sender writes every bucket of every version into one buffer, shared once for the run
  (:class:`SharedBuckets`). A descriptor names its
  GPU by UUID, because device indices differ between processes with different
  ``CUDA_VISIBLE_DEVICES``; a tensor-parallel trainer offers each bucket on every one of its GPUs,
  and each receiver opens the one on its own.
* Broadcast (different GPUs or hosts): :class:`BroadcastGroup` is a process group of its own
  (NCCL on GPUs, gloo on CPU), independent of any ``torch.distributed`` world the trainer or the
  inference engine already runs. One sender (rank 0) broadcasts the buckets; receivers derive the
  same cut from the specs (:func:`buckets`), which the sender ships over nng beforehand.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from vime.transports.codec import TORCH_DTYPE_NAMES

Spec = tuple[str, list[int], str]  # name, shape, dtype name
ALIGN = 256  # bytes: each tensor in a bucket starts at a multiple, so that its bytes view as any dtype


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype called ``name`` ("bfloat16"), from the codec's table of dtypes that may travel."""
    if name not in TORCH_DTYPE_NAMES:
        raise ValueError(f"{name!r} is not a torch dtype that travels; one of {sorted(TORCH_DTYPE_NAMES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """How a dtype travels: its name without ``torch.`` ("bfloat16"), which :func:`dtype_named` reads back."""
    return str(dtype).removeprefix("torch.")


def gpu_uuid(device: int | None = None) -> str:
    """The GPU's UUID: the same in every process, whatever ``CUDA_VISIBLE_DEVICES`` says."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).uuid)


def share(tensor: torch.Tensor) -> dict[str, Any]:
    """A descriptor another process on the same GPU opens with :func:`open_shared`."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"a tensor on {tensor.device}: CUDA IPC shares CUDA tensors only")
    _, (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset, _, counter,
        counter_offset, event, event_sync) = reduce_tensor(tensor.detach())
    return {"shape": list(size), "stride": list(stride), "offset": offset, "dtype": dtype_name(dtype),
            "gpu": gpu_uuid(device), "handle": handle, "storage_bytes": storage_bytes,
            "storage_offset": storage_offset, "counter": counter, "counter_offset": counter_offset,
            "event": event, "event_sync": event_sync}


def open_shared(descriptors: list[dict[str, Any]]) -> torch.Tensor:
    """A view of the tensor, among those ``descriptors`` offer (one per GPU), that lives on this process's GPU;
    when none does, a ValueError says what to do."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = torch.cuda.current_device()
    here = gpu_uuid(device)
    for d in descriptors:
        if d["gpu"] == here:
            return rebuild_cuda_tensor(
                torch.Tensor, torch.Size(d["shape"]), tuple(d["stride"]), d["offset"], torch.storage.TypedStorage,
                dtype_named(d["dtype"]), device, d["handle"], d["storage_bytes"], d["storage_offset"], False,
                d["counter"], d["counter_offset"], d["event"], d["event_sync"])
    raise ValueError(f"nothing was shared on this process's GPU {here} (only on {[d['gpu'] for d in descriptors]}): "
                     "CUDA IPC needs sender and receiver on the same GPU; across GPUs, send weights by broadcast")


def release(descriptor: dict[str, Any]) -> None:
    """The sender's own hold on memory it shared and no longer offers. torch counts one reader per
    :func:`share` and frees the memory once the count is back to exactly zero (each opening takes one
    off, once closed): memory nobody opened (no engine on that GPU) is then freed with the sender's last
    reference; memory that was opened is not (the count has gone below zero), which is why
    :class:`SharedBuckets` shares one buffer for the run."""
    torch.UntypedStorage._release_ipc_counter_cuda(descriptor["counter"], descriptor["counter_offset"])


def specs(tensors: dict[str, torch.Tensor]) -> list[Spec]:
    """What a receiver needs to know, before a broadcast, to receive ``tensors``."""
    return [_spec(name, tensor) for name, tensor in tensors.items()]


def _spec(name: str, tensor: torch.Tensor) -> Spec:
    return name, list(tensor.shape), dtype_name(tensor.dtype)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _spec_bytes(spec: Spec) -> int:
    return _padded(math.prod(spec[1]) * dtype_named(spec[2]).itemsize)


def buckets(spec_list: list[Spec], bucket_bytes: int) -> list[list[Spec]]:
    """Consecutive specs, up to ``bucket_bytes`` each (a larger tensor gets a bucket alone): the cut
    :func:`packed` makes, tensor by tensor, on the sending side."""
    grouped: list[list[Spec]] = []
    size = 0
    for spec in spec_list:
        nbytes = _spec_bytes(spec)
        if not grouped or size + nbytes > bucket_bytes:
            grouped.append([])
            size = 0
        grouped[-1].append(spec)
        size += nbytes
    return grouped


class BucketMemory:
    """The buffer :func:`packed` writes buckets into, kept from one call to the next: every publication of a run
    reuses it. It is allocated when a bucket first needs it, at that bucket's size when nothing follows (a set
    that fits in one bucket gets a buffer of exactly its size) and otherwise at the bucket size, and replaced
    only by a larger one when a later bucket outgrows it (a single tensor larger than every bucket so far).

    Why it is kept: memory offered over CUDA IPC is shared once for the run. torch frees shared memory only
    once its count of readers is back to exactly zero, and readers that open one buffer bucket after bucket
    take that count below zero; memory shared anew for each weight version was never freed (a bucket per
    version, until the GPU was full)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def holds(self, nbytes: int, device: torch.device) -> bool:
        """Whether the buffer has room for ``nbytes`` on ``device``."""
        return self.buffer is not None and self.buffer.device == device and self.buffer.numel() >= nbytes

    def grow(self, nbytes: int, device: torch.device, kept: int) -> None:
        """A buffer of ``nbytes`` on ``device`` in place of the current one, whose first ``kept`` bytes it keeps."""
        if device.type == "cuda":  # a segment of its own, not a piece of one the training step left cached,
            torch.cuda.empty_cache()  # which the buffer would keep from ever going back to the device
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if kept:
            buffer[:kept].copy_(self.buffer[:kept])
        self.buffer = buffer


def packed(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
           memory: BucketMemory | None = None) -> Iterator[tuple[torch.Tensor, list[Spec]]]:
    """The tensors of ``named`` copied into flat byte buffers cut as :func:`buckets` cuts their specs, each
    buffer with its specs. Tensors are taken one at a time (a tensor-parallel trainer gathers each as it
    is asked for) and copied into ``memory`` (a new :class:`BucketMemory` when None) as they come; only
    while the memory has no room yet for the bucket being filled (the first bucket ever, or one that outgrows
    it) are its tensors held until the bucket is complete and its size known. The next bucket is written
    into the same memory once the consumer asks for it: the consumer must be done with a buffer by then."""
    memory = BucketMemory() if memory is None else memory
    bucket: list[Spec] = []
    waiting: list[tuple[int, torch.Tensor]] = []  # (offset, tensor) of this bucket's tensors not yet written
    used = 0
    for name, tensor in named:
        spec = _spec(name, tensor)
        nbytes = _spec_bytes(spec)
        if bucket and used + nbytes > bucket_bytes:
            yield _written(memory, waiting, used, bucket_bytes), bucket
            bucket, waiting, used = [], [], 0
        if waiting or not memory.holds(used + nbytes, tensor.device):
            waiting.append((used, tensor))
        else:
            _write(memory.buffer, used, tensor)
        bucket.append(spec)
        used += nbytes
    if bucket:
        yield _written(memory, waiting, used, used), bucket


def _write(buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
    buffer[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)


def _written(memory: BucketMemory, waiting: list[tuple[int, torch.Tensor]], used: int,
             size: int) -> torch.Tensor:
    """The first ``used`` bytes of ``memory`` once the ``waiting`` tensors are in it; memory without room for
    them grows to ``size`` (or ``used``, if more)."""
    if waiting:
        kept, first = waiting[0]
        if not memory.holds(used, first.device):
            memory.grow(max(used, size), first.device, kept)
        for offset, tensor in waiting:
            _write(memory.buffer, offset, tensor)
    return memory.buffer[:used]


class SharedBuckets:
    """Buckets offered over CUDA IPC from one buffer (a :class:`BucketMemory`) kept for the run: shared once,
    when first offered, whatever the number of buckets and versions written into it. The sender waits for
    its own writes before offering a bucket (so the descriptor asks no receiver to wait on the share's event),
    and writes the next into the same memory once the consumer asks for it, after every receiver has
    answered. A buffer replaced by a larger one gives up the sender's hold on the old (:func:`release`);
    the memory is the process's until it ends."""

    def __init__(self) -> None:
        self.memory = BucketMemory()
        self.shares = 0  # how many buffers were shared: one per run, unless a later set outgrew the first
        self._buffer: torch.Tensor | None = None  # the buffer self.descriptor describes
        self.descriptor: dict[str, Any] | None = None

    def offer(self, named: Iterable[tuple[str, torch.Tensor]],
              bucket_bytes: int) -> Iterator[tuple[list[Spec], dict[str, Any]]]:
        """Each bucket :func:`packed` makes of ``named``, with the descriptor of the buffer it is in."""
        for flat, specs in packed(named, bucket_bytes, self.memory):
            if self._buffer is not self.memory.buffer:
                replaced = self.descriptor
                # no event to wait for: each bucket is offered once its writes are done (below), and a receiver
                # opening the share's event would open one more CUDA event per bucket, never destroyed
                self._buffer, self.descriptor = self.memory.buffer, dict(share(self.memory.buffer), event_sync=False)
                self.shares += 1
                if replaced is not None:
                    release(replaced)
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()
            yield specs, self.descriptor


def unpack(flat: torch.Tensor, spec_list: list[Spec]) -> list[tuple[str, torch.Tensor]]:
    """The tensors :func:`packed` wrote at the start of ``flat`` (the bucket, or the whole buffer it was written
    into), as views of it."""
    needed = sum(map(_spec_bytes, spec_list))
    if needed > flat.numel():
        raise ValueError(f"a buffer of {flat.numel()} bytes cannot hold the {len(spec_list)} tensors described "
                         f"({needed} bytes): sender and receiver disagree on the weights")
    views = []
    offset = 0
    for spec in spec_list:
        name, shape, dtype = spec[0], spec[1], dtype_named(spec[2])
        views.append((name, flat[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)))
        offset += _spec_bytes(spec)
    return views


def address_towards(host: str) -> str:
    """This host's address that packets to ``host`` leave from (a UDP socket connected there, which sends
    nothing, shows the local address the kernel routes from): ``host`` itself when it is one of ours."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


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
        self.host = url.hostname
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
                self._group = self._gloo()
        return self._group

    def _gloo(self) -> dist.ProcessGroup:
        """Gloo listening on this host's address towards the store (the sender's own, where the group meets).
        By default gloo takes the address the host name resolves to, often 127.0.0.1, which a member on
        another host cannot reach. A user's own ``GLOO_SOCKET_IFNAME`` stays."""
        if os.environ.get("GLOO_SOCKET_IFNAME"):
            return dist.ProcessGroupGloo(self.store, self.rank, self.world_size, self.timeout)
        options = dist.ProcessGroupGloo._Options()  # torch's only way to give a group its device (its tests' too)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address_towards(self.host))]
        options._timeout = self.timeout
        return dist.ProcessGroupGloo(self.store, self.rank, self.world_size, options)

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
        """Broadcast ``tensors`` (on this group's device) in the buckets :func:`packed` makes of them."""
        for flat, _ in packed(tensors.items(), bucket_bytes):
            self.broadcast(flat)

    def receive(self, spec_list: list[Spec], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The broadcast tensors, a bucket at a time (each bucket a buffer of its own, views into it)."""
        for bucket in buckets(spec_list, bucket_bytes):
            flat = torch.empty(sum(map(_spec_bytes, bucket)), dtype=torch.uint8, device=self.device)
            self.broadcast(flat)
            yield unpack(flat, bucket)
