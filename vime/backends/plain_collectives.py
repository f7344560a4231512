"""Plain data between the trainer's ranks as msgpack bytes in tensors, never pickled.

torch.distributed's ``*_object`` collectives (``broadcast_object_list``, ``all_gather_object``) pickle what they
send and unpickle what they receive, so a peer of the group could make every rank run code of its choosing. The
trainer's ranks may span hosts, over connections that nothing authenticates (README, "Several hosts"); what
crosses between them is tensors and, through these two functions, msgpack: maps, lists, strings and numbers.
A tuple comes back a list.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist


def broadcast_plain(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """``value`` of global rank ``src``, on every rank of ``group`` (the others pass anything, None say)."""
    device = _device_of(group)
    payload = msgpack.packb(value) if dist.get_rank() == src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    data = _bytes_tensor(payload, int(length), device)
    dist.broadcast(data, src=src, group=group)
    return msgpack.unpackb(bytes(data.cpu().numpy()), strict_map_key=False)


def gather_plain(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value``, in the group's rank order, on every rank of ``group``."""
    return [msgpack.unpackb(data, strict_map_key=False) for data in gather_bytes(msgpack.packb(value), group)]


def gather_bytes(payload: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank (two all-gathers: the lengths, then the bytes)."""
    device = _device_of(group)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64, device=device), group=group)
    longest = max(int(length) for length in lengths)
    pieces = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(pieces, _bytes_tensor(payload, longest, device), group=group)
    return [bytes(piece[:int(length)].cpu().numpy()) for piece, length in zip(pieces, lengths)]


def _bytes_tensor(payload: bytes, length: int, device: torch.device) -> torch.Tensor:
    """``payload`` in a uint8 tensor of ``length`` (zeros after it) on ``device``."""
    data = torch.zeros(length, dtype=torch.uint8)
    if payload:
        data[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return data.to(device)


def _device_of(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take their tensors: NCCL moves only the current GPU's."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
