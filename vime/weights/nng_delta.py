"""Weights over nng as deltas (``--weight-sync nng-delta``): per tensor, only what changed since the version the
worker holds, for engines on other hosts where the link, not the copy, is what an update costs.

Each tensor goes one of three ways: unchanged (its name only), changed (the bitwise XOR of its new bytes with the
base's, byte planes apart, compressed with zstd) or whole (no base). XOR is exact for any dtype, NaNs included,
and at RL learning rates most bf16 elements do not move at all, so the XOR is mostly zero bytes. The worker
rebuilds every tensor from its own copy of the base as its part arrives, and answers the last part of a version
with DeltaHeld. The trainer encodes each part while the one before is on its way.

Which base: the version the worker last acknowledged (DeltaHeld). A worker with none (first weights, joined late,
restarted: the trainer forgets a worker that asks WantWeights again) gets the whole version. A delta against a
base the worker does not hold is refused by the worker and sent again whole; if that fails too, the worker's
weights go over the ``nng`` path from then on.

Memory: the trainer keeps a host copy of each version some worker holds as its base, and of the current one (the
next base); every worker at the same version shares one copy, and only :data:`KEPT_VERSIONS` are kept (a worker
whose base was dropped gets the whole version next). In the steady state, where every worker acknowledged the
previous version, that is two copies while a version is published and one after (1.2 GB each at Qwen3-0.6B in
bf16), plus the encoded parts of the current version (its bytes on the wire). Each worker keeps one host copy of
the version it holds (and, while one arrives, the parts rebuilt so far). What it leaves out: compressing whole
sends (random-looking bf16 gains little), and the broadcast path (deltas would need both ends of the group to
agree on a base).

Needs the ``zstandard`` package (``pip install zstandard``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import trio

from vime.runtime import RemoteError
from vime.transports.records import message
from vime.weights.base import Gathered, WeightPath
from vime.weights.nng import grouped

if TYPE_CHECKING:
    import zstandard

KEPT_VERSIONS = 2  # host copies the trainer keeps: the base every worker holds, and the version being published
ZSTD_LEVEL = 1  # the XOR of a small step is mostly zeros: a higher level saves little and costs the trainer's CPU
WHOLE = -1  # WeightsDelta.base when the tensors travel whole
THREADS = min(8, os.cpu_count() or 1)  # tensors encoded or rebuilt at once


@message
class WeightsDelta:
    """trainer -> rollout worker (``--weight-sync nng-delta``): part ``index`` of ``count`` of the weights of
    ``version``, against the worker's copy of ``base`` (:data:`WHOLE`: none). The last part is an ask, answered
    with DeltaHeld once the worker rebuilt the whole version, or an error when it does not hold ``base``."""

    version: int
    base: int
    index: int
    count: int
    whole: dict[str, torch.Tensor]  # tensors as they are
    changed: dict[str, np.ndarray]  # name -> zstd frame of the XOR with the base's bytes, byte planes apart
    unchanged: list[str]  # tensors whose bytes equal the base's


@message
class DeltaHeld:
    """rollout worker -> trainer, the answer to the last WeightsDelta of a version: the worker holds ``version``
    bit for bit, and keeps it as the base of the next delta."""

    version: int


def _zstd() -> Any:
    """The zstandard module, or an error that says how to get it."""
    try:
        import zstandard
    except ImportError as err:
        raise RuntimeError("--weight-sync nng-delta needs the zstandard package: pip install zstandard "
                           "(or use --weight-sync nng)") from err
    return zstandard


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (any dtype, bf16 included, which numpy lacks)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def delta(new: torch.Tensor, old: torch.Tensor, compressor: zstandard.ZstdCompressor) -> np.ndarray | None:
    """The zstd frame of ``new``'s bytes XOR ``old``'s, the i-th byte of every element together (the sign and
    exponent bytes of a small step are zeros, its low mantissa bytes are not: apart, each compresses as it is,
    and zstd runs faster on them); None when the bytes are equal."""
    new_bytes, old_bytes = _bytes(new), _bytes(old)
    if torch.equal(new_bytes, old_bytes):
        return None
    xor = torch.bitwise_xor(new_bytes, old_bytes).numpy()
    itemsize = new.element_size()
    planes = np.concatenate([xor[i::itemsize] for i in range(itemsize)]) if itemsize > 1 else xor
    return np.frombuffer(compressor.compress(planes), dtype=np.uint8)


def undelta(old: torch.Tensor, frame: Any, decompressor: zstandard.ZstdDecompressor) -> torch.Tensor:
    """The tensor :func:`delta` was made from, in a new tensor: ``old`` XOR the frame's bytes."""
    itemsize, planes = old.element_size(), np.frombuffer(decompressor.decompress(frame), dtype=np.uint8)
    xor = np.empty_like(planes)
    count = planes.size // itemsize
    for i in range(itemsize):  # byte i of every element back in its place
        xor[i::itemsize] = planes[i * count:(i + 1) * count]
    return torch.bitwise_xor(_bytes(old), torch.from_numpy(xor)).view(old.dtype).reshape(old.shape)


def matches(new: torch.Tensor, old: torch.Tensor | None) -> bool:
    """Whether ``new`` can go as a delta against ``old``: the same dtype and shape (a resized vocabulary, say,
    goes whole)."""
    return old is not None and old.dtype == new.dtype and old.shape == new.shape


def encode_part(version: int, base_version: int, base: dict[str, torch.Tensor] | None,
                tensors: dict[str, torch.Tensor], index: int, count: int) -> WeightsDelta:
    """Part ``index`` of ``count`` of version ``version``: ``tensors`` against ``base`` (version ``base_version``),
    or whole when ``base`` is None; its tensors on a pool of threads (numpy, torch and zstd let go of the GIL)."""
    zstd = _zstd()
    part = WeightsDelta(version=version, base=WHOLE if base is None else base_version, index=index, count=count,
                        whole={}, changed={}, unchanged=[])

    def frame_of(name: str) -> np.ndarray | None:
        return delta(tensors[name], base[name], zstd.ZstdCompressor(level=ZSTD_LEVEL))  # one per thread

    deltas = [name for name, tensor in tensors.items() if matches(tensor, None if base is None else base.get(name))]
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        frames = dict(zip(deltas, pool.map(frame_of, deltas)))
    for name, tensor in tensors.items():
        if name not in frames:
            part.whole[name] = tensor
        elif frames[name] is None:
            part.unchanged.append(name)
        else:
            part.changed[name] = frames[name]
    return part


def encode(version: int, base_version: int, base: dict[str, torch.Tensor] | None,
           tensors: dict[str, torch.Tensor], limit_bytes: int) -> list[WeightsDelta]:
    """Every part of a version: ``tensors`` in groups of at most ``limit_bytes`` before encoding (so the count is
    known before the first part is encoded, and the sender can send each part as it is made), each against
    ``base``."""
    groups = grouped(tensors, limit_bytes)
    return [encode_part(version, base_version, base, group, index, len(groups)) for index, group in enumerate(groups)]


def decode(parts: list[WeightsDelta], base: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The tensors of ``parts`` (in index order: a whole version, or one part as it arrives) from the base they
    were made against."""
    zstd = _zstd()
    tensors: dict[str, torch.Tensor] = {}
    changed = {name: frame for part in parts for name, frame in part.changed.items()}

    def rebuilt(name: str) -> torch.Tensor:
        return undelta(base[name], changed[name], zstd.ZstdDecompressor())  # one per thread

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        rebuilt_tensors = dict(zip(changed, pool.map(rebuilt, changed)))
    for part in parts:  # in the order they were sent
        tensors.update(part.whole)
        tensors.update((name, rebuilt_tensors[name]) for name in part.changed)
        tensors.update((name, base[name]) for name in part.unchanged)
    return tensors


def wire_bytes(part: WeightsDelta) -> int:
    """The tensor bytes a part carries (its names and msgpack framing aside)."""
    return sum(t.nbytes for t in part.whole.values()) + sum(frame.nbytes for frame in part.changed.values())


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's name, dtype, shape and bytes: two state dicts bit for bit the same have the same."""
    hasher = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name]
        hasher.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}".encode())
        hasher.update(_bytes(tensor).numpy().data)
    return hasher.hexdigest()


class NngDelta(WeightPath):
    name = "nng-delta"
    kinds = (WeightsDelta,)
    priority = -1  # only when named: --weight-sync auto keeps the plain nng path

    held: dict[str, int]  # sender: worker -> the version it acknowledged (its base)
    versions: dict[int, dict[str, torch.Tensor]]  # sender: host copies of bases and of the current version
    encoded: dict[int, list[WeightsDelta]]  # sender: base version -> the current version's parts against it
    base: tuple[int, dict[str, torch.Tensor]] | None  # receiver: the version it holds, bit for bit
    # receiver: version -> part index -> its tensors rebuilt (None: a delta against a base it does not hold)
    arriving: dict[int, dict[int, dict[str, torch.Tensor] | None]]

    def __init__(self, **halves: Any) -> None:
        super().__init__(**halves)
        self.held, self.versions, self.encoded, self.base, self.arriving = {}, {}, {}, None, {}

    @staticmethod
    def suits(ours: set[str], theirs: set[str]) -> bool:
        return True

    # The sender half.

    def detach(self, worker: str) -> None:
        """A worker that asks again (restarted, say) holds no base we know of: its next version goes whole."""
        self.held.pop(worker, None)
        self._prune()

    def wants(self) -> Gathered | None:
        return None if self.sender.engine.weight_version in self.versions else "host"

    def _current(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host copy of the current version, made once per version (the optimizer will write the trainer's own
        tensors in place, and this copy is the next version's base)."""
        engine = self.sender.engine
        version = engine.weight_version
        if version not in self.versions:
            self.versions[version] = {name: tensor.to("cpu", copy=engine.device == "cpu").contiguous()
                                      for name, tensor in tensors.items()}
            self.encoded = {}
            self._prune()
        return self.versions[version]

    def _prune(self) -> None:
        """Keep the current version and the newest bases workers hold, :data:`KEPT_VERSIONS` in all; a worker
        whose base goes gets the whole version next time."""
        current = self.sender.engine.weight_version
        wanted = sorted({current, *self.held.values()} & set(self.versions), reverse=True)[:KEPT_VERSIONS]
        self.versions = {version: self.versions[version] for version in wanted}

    def _kept(self, base_version: int) -> int:
        """``base_version`` if its copy is kept (and it is not the current version), else :data:`WHOLE`."""
        current = self.sender.engine.weight_version
        return base_version if base_version in self.versions and base_version != current else WHOLE

    async def _send_parts(self, worker: str, base_version: int) -> None:
        """The current version against ``base_version`` (kept, or WHOLE): each part encoded in a thread while the
        outbox sends the one before, and kept for the next worker at that base; every part but the last told,
        the last asked: returns once the worker holds the version."""
        actor, engine = self.sender.actor, self.sender.engine
        version, current = engine.weight_version, self.versions[engine.weight_version]
        groups = grouped(current, self.sender.run.job.weight_chunk_mb << 20)
        parts = self.encoded.setdefault(base_version, [])
        for index, group in enumerate(groups):
            if index == len(parts):
                parts.append(await trio.to_thread.run_sync(encode_part, version, base_version,
                                                           self.versions.get(base_version), group, index, len(groups)))
            if index + 1 < len(groups):
                await actor.tell(worker, parts[index], weight_version=version)
        await actor.ask(worker, parts[-1], timeout=600.0, weight_version=version)
        actor.log.info("weights sent", worker=worker, weight_version=version, base=base_version,
                       wire_mb=round(sum(map(wire_bytes, parts)) / 2**20, 3))

    async def send(self, workers: list[str], tensors: dict[str, torch.Tensor]) -> list[str]:
        """Against the base each worker acknowledged, or whole; a delta the worker refuses goes again whole, and a
        worker that refuses that too is returned (it gets the ``nng`` path from then on)."""
        self._current(tensors)
        version, failed = self.sender.engine.weight_version, []
        for worker in workers:
            base = self._kept(self.held.get(worker, WHOLE))
            try:
                await self._send_parts(worker, base)
            except RemoteError as err:
                self.held.pop(worker, None)
                if base == WHOLE:
                    failed.append(worker)
                    continue
                self.sender.actor.log.warning("delta refused: sending this version whole", worker=worker,
                                              weight_version=version, base=base, error=str(err))
                try:
                    await self._send_parts(worker, WHOLE)
                except RemoteError:
                    failed.append(worker)
                    continue
            self.held[worker] = version
        self._prune()
        return failed

    # The receiver half.

    async def receive(self, msg: WeightsDelta) -> DeltaHeld | None:
        """A part, rebuilt from the base as it arrives (in a thread: the next parts keep arriving meanwhile); once
        all of a version are in, the version is kept as the next base and handed to the engine. A delta against
        a base this worker does not hold raises once all its parts are in: the trainer sends that version whole."""
        parts = self.arriving.setdefault(msg.version, {})
        base = self.base[1] if self.base is not None and self.base[0] == msg.base else None
        if msg.base == WHOLE or base is not None:
            parts[msg.index] = await trio.to_thread.run_sync(decode, [msg], base)
        else:
            parts[msg.index] = None
        if len(parts) < msg.count:
            return None
        self.arriving = {version: older for version, older in self.arriving.items() if version > msg.version}
        if any(rebuilt is None for rebuilt in parts.values()):
            held = self.base[0] if self.base is not None else None
            raise ValueError(f"weights of version {msg.version} came as a delta against version {msg.base}, but this "
                             f"worker holds {held}; the trainer sends them whole next")
        tensors = {name: tensor for index in sorted(parts) for name, tensor in parts[index].items()}
        self.base = (msg.version, tensors)
        if msg.version > self.receiver.engine.weight_version:
            self.receiver.arrived(msg.version, tensors)
        return DeltaHeld(version=msg.version)
