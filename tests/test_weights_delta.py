"""Delta weight sync (``--weight-sync nng-delta``): every worker ends bit-identical to the trainer after each
version, whatever base it held: from the start, joined late, restarted, or holding a base the trainer did not
assume. The two halves talk through the real codec (msgpack and raw bytes), without sockets."""

from __future__ import annotations

import types
import typing

import numpy as np
import pytest
import torch

from vime.config import WeightSync
from vime.messages.runtime import ErrorReply
from vime.runtime import RemoteError
from vime.transports.codec import Envelope, decode_frame, encode, encode_frame
from vime.weights import PATHS, DeltaHeld, Nng, NngDelta, WeightReceiver, WeightsChunk, WeightsDelta, WeightSender
from vime.weights.nng_delta import WHOLE, delta, digest, undelta
from vime.weights.nng_delta import encode as encode_delta

zstandard = pytest.importorskip("zstandard")


def test_every_weight_path_is_a_weight_sync_choice():
    assert set(typing.get_args(WeightSync)) == {"auto", *PATHS}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8])
def test_a_delta_rebuilds_the_exact_bytes_of_any_dtype(dtype):
    """NaNs, infinities and negative zeros too: the XOR is of bytes, never of values."""
    generator = torch.Generator().manual_seed(0)
    old = torch.randint(0, 255, (4, 264), dtype=torch.uint8, generator=generator)
    old = old.view(dtype) if dtype != torch.uint8 else old
    new = old.clone()
    new.view(torch.uint8).view(-1)[::7] ^= 0x5A
    if dtype.is_floating_point:
        new.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)
    frame = delta(new, old, zstandard.ZstdCompressor())
    rebuilt = undelta(old, frame, zstandard.ZstdDecompressor())
    assert rebuilt.dtype == dtype and rebuilt.shape == new.shape
    assert torch.equal(rebuilt.view(torch.uint8), new.view(torch.uint8))
    assert delta(old.clone(), old, zstandard.ZstdCompressor()) is None


class _TrainEngine:
    """The trainer's engine as the weight paths see it: a version and its bf16 weights, kept in fp32 as a
    mixed-precision optimizer keeps them, stepped like Adam's first step (``lr`` times the sign of a random
    gradient): most bf16 elements do not move at a small learning rate."""

    device = "cpu"

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_version = 0
        self.master = {f"layers.{i}.weight": torch.randn(64, 48, generator=self.generator) * 0.02 for i in range(6)}
        self.master["norm.weight"] = torch.ones(48)

    def step(self, lr: float = 1e-5) -> None:
        self.weight_version += 1
        for name, weight in self.master.items():
            if name != "norm.weight":  # one tensor that never changes
                weight.sub_(lr * torch.randn(weight.shape, generator=self.generator).sign())

    def rollout_weights(self, dtype: torch.dtype, device: str | None = None):
        return ((name, weight.to(torch.bfloat16)) for name, weight in self.master.items())


class _RolloutEngine:
    def __init__(self) -> None:
        self.weight_version = 0
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.weights = {name: tensor.clone() for name, tensor in tensors.items()}
        self.weight_version = version


def _over_the_wire(payload):
    """``payload`` encoded and decoded as a socket would carry it: msgpack and raw bytes, no pickle."""
    envelope = Envelope(type(payload).__name__, "trainer", "worker", 1, None, 0.0, None, False, payload)
    frame = encode_frame("tcp://trainer", None, [encode(envelope)])
    return decode_frame(frame, max_message_bytes=1 << 30).messages[0].payload


class _Actor:
    """The trainer actor's tell and ask, delivered to the workers' receivers at once; the bytes of each kind of
    message told or asked are counted."""

    def __init__(self, workers: dict[str, WeightReceiver]) -> None:
        self.workers = workers
        self.sent: list[tuple[str, object]] = []
        self.log = types.SimpleNamespace(warning=lambda *args, **kwargs: None, info=lambda *args, **kwargs: None)

    async def tell(self, worker: str, payload, weight_version: int | None = None) -> None:
        await self.ask(worker, payload)

    async def ask(self, worker: str, payload, timeout: float = 30.0, weight_version: int | None = None):
        self.sent.append((worker, payload))
        try:
            return await self.workers[worker].receive(_over_the_wire(payload))
        except ValueError as err:
            raise RemoteError(worker, ErrorReply(reason="handler", error=str(err))) from err


def _sender(engine: _TrainEngine, workers: dict[str, WeightReceiver]) -> WeightSender:
    run = types.SimpleNamespace(job=types.SimpleNamespace(weight_sync="nng-delta", weight_chunk_mb=1),
                                model=types.SimpleNamespace(dtype="bf16"))
    return WeightSender(_Actor(workers), engine, run, gone=lambda worker: None)


def _worker() -> WeightReceiver:
    return WeightReceiver(_RolloutEngine(), between_steps=None, wake=lambda: None)


def _holds(receiver: WeightReceiver) -> str:
    """The digest of what the worker's engine loaded."""
    assert receiver.apply() or receiver.complete is None
    return digest(receiver.engine.weights)


def _expected(engine: _TrainEngine) -> str:
    return digest(dict(engine.rollout_weights(torch.bfloat16)))


def _kinds(sender: WeightSender, worker: str) -> list[str]:
    """How each version went to ``worker`` since last asked: "whole", "delta" or "nng" (the fallback)."""
    sent = [payload for to, payload in sender.actor.sent if to == worker and getattr(payload, "index", 1) == 0]
    sender.actor.sent = [(to, payload) for to, payload in sender.actor.sent if to != worker]
    return ["nng" if isinstance(p, WeightsChunk) else "whole" if p.base == WHOLE else "delta" for p in sent]


async def test_workers_from_the_start_joining_late_and_restarted_hold_the_trainers_bytes_after_each_version():
    engine = _TrainEngine()
    workers = {"rollout-0": _worker()}
    sender = _sender(engine, workers)
    sender.serve("rollout-0", NngDelta)
    delta_half = sender.half(NngDelta)
    for version in range(1, 9):
        engine.step()
        if version == 3:  # joins late: asks WantWeights, the trainer forgets what it knew and serves it
            workers["rollout-1"] = _worker()
            sender.detach("rollout-1")
            sender.serve("rollout-1", NngDelta)
        if version == 6:  # restarted: a new process, no base; its WantWeights makes the trainer forget it
            workers["rollout-0"] = _worker()
            sender.detach("rollout-0")
            sender.serve("rollout-0", NngDelta)
        await sender.publish(sorted(sender.paths))
        for name, receiver in workers.items():
            assert _holds(receiver) == _expected(engine), (version, name)
            assert receiver.engine.weight_version == version
        assert len(delta_half.versions) <= 2  # the bases kept on the trainer's host stay bounded
    assert _kinds(sender, "rollout-0") == ["whole", "delta", "delta", "delta", "delta", "whole", "delta", "delta"]
    assert _kinds(sender, "rollout-1") == ["whole", "delta", "delta", "delta", "delta", "delta"]
    assert set(delta_half.versions) == {8}  # every worker holds version 8: one copy shared by both


async def test_a_delta_is_smaller_than_the_whole_version_and_skips_unchanged_tensors():
    engine = _TrainEngine()
    workers = {"rollout-0": _worker()}
    sender = _sender(engine, workers)
    sender.serve("rollout-0", NngDelta)
    for _ in range(2):
        engine.step(lr=1e-6)
        await sender.publish(["rollout-0"])
    whole, step = [payload for _, payload in sender.actor.sent]
    whole_bytes = sum(t.nbytes for t in whole.whole.values())
    step_bytes = sum(frame.nbytes for frame in step.changed.values())
    assert "norm.weight" in step.unchanged and not step.whole
    assert step_bytes < whole_bytes / 4, (step_bytes, whole_bytes)
    assert isinstance(_over_the_wire(step).changed["layers.0.weight"], np.ndarray)


async def test_a_delta_against_a_base_the_worker_lacks_is_sent_again_whole():
    """The trainer assumes the base the worker acknowledged; a worker that holds another (its copy lost, say)
    refuses the delta, and the same version comes whole."""
    engine = _TrainEngine()
    workers = {"rollout-0": _worker()}
    sender = _sender(engine, workers)
    sender.serve("rollout-0", NngDelta)
    engine.step()
    await sender.publish(["rollout-0"])
    workers["rollout-0"].halves[WeightsDelta].base = None
    engine.step()
    await sender.publish(["rollout-0"])
    assert _holds(workers["rollout-0"]) == _expected(engine)
    assert _kinds(sender, "rollout-0") == ["whole", "delta", "whole"]
    assert sender.paths["rollout-0"] is NngDelta


async def test_a_worker_that_refuses_the_whole_version_too_falls_back_to_nng():
    engine = _TrainEngine()
    workers = {"rollout-0": _worker()}
    sender = _sender(engine, workers)
    sender.serve("rollout-0", NngDelta)

    async def refuse(msg: WeightsDelta) -> DeltaHeld:
        raise ValueError("no memory for a base")

    workers["rollout-0"].halves[WeightsDelta].receive = refuse
    engine.step()
    await sender.publish(["rollout-0"])
    assert sender.paths["rollout-0"] is Nng
    assert _kinds(sender, "rollout-0") == ["whole", "nng"]
    assert not sender.half(NngDelta).held


async def test_a_version_in_many_parts_is_rebuilt_part_by_part_and_a_wrong_base_refused_once_all_are_in():
    engine = _TrainEngine()
    old = dict(engine.rollout_weights(torch.bfloat16))
    engine.step()
    new = dict(engine.rollout_weights(torch.bfloat16))
    receiver = _worker()
    half = receiver.halves[WeightsDelta]
    half.base = (0, old)
    parts = encode_delta(1, 0, old, new, limit_bytes=64)  # a part per tensor
    assert len(parts) == 7 and parts[-1].unchanged == ["norm.weight"] and not parts[-1].changed
    for part in parts[:-1]:
        assert await half.receive(_over_the_wire(part)) is None
    assert await half.receive(_over_the_wire(parts[-1])) == DeltaHeld(version=1)
    assert _holds(receiver) == digest(new) and half.base[0] == 1
    for part in parts[:-1]:  # the same delta again: against version 0, which it no longer holds
        assert await half.receive(_over_the_wire(part)) is None
    with pytest.raises(ValueError, match="against version 0, but this worker holds 1"):
        await half.receive(_over_the_wire(parts[-1]))
    assert half.base[0] == 1 and not half.arriving
