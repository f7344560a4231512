"""Tensors by the GPU's paths (transports/gpu.py): buckets packed and unpacked, bucketed broadcast between
real processes (gloo on CPU, NCCL on GPUs) and CUDA IPC descriptors (GPU only)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing

import msgpack
import pytest
import torch

from vime.backends.base import TrainEngine
from vime.transports import gpu
from vime.transports.gpu import (
    BroadcastGroup,
    BucketMemory,
    SharedBuckets,
    buckets,
    dtype_named,
    open_shared,
    packed,
    share,
    specs,
    unpack,
)


def _tensors(device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(5, 7, generator=generator),
        "b": torch.randn(200, generator=generator).to(torch.bfloat16),
        "c": torch.randn(2, 3, 4, generator=generator).to(torch.bfloat16).transpose(0, 2),  # non-contiguous
        "big": torch.randn(1000, generator=generator),  # larger than a bucket: a bucket of its own
        "ids": torch.arange(11),
        "scalar": torch.tensor(2.5),
    }
    return {name: t.to(device) for name, t in tensors.items()}


def _receive(address: str, spec_list: list, bucket_bytes: int, device: str) -> dict:
    """A receiver process: every tensor it got, as lists, and how many buckets carried them."""
    if device == "cuda":
        torch.cuda.set_device(torch.cuda.device_count() - 1)
    group = BroadcastGroup(address, 1, 2, device=device, timeout_s=60)
    got, count = {}, 0
    for bucket in group.receive(spec_list, bucket_bytes):
        count += 1
        got |= {name: (t.float().cpu().tolist(), str(t.dtype)) for name, t in bucket}
    return {"tensors": got, "buckets": count}


def test_buckets_cut_by_size_and_a_larger_tensor_goes_alone() -> None:
    spec_list = specs(_tensors())  # 140, 400, 48, 4000, 88 and 4 bytes: 256-byte slots, 4096 for "big"
    grouped = buckets(spec_list, bucket_bytes=1024)
    assert [[name for name, _, _ in bucket] for bucket in grouped] == [["a", "b", "c"], ["big"], ["ids", "scalar"]]
    assert [spec for bucket in grouped for spec in bucket] == spec_list
    assert len(buckets(spec_list, 1)) == len(spec_list)


@pytest.mark.parametrize("bucket_bytes", [1, 1024, 1 << 20])
def test_packed_buckets_unpack_bit_exact_where_the_receiver_cuts_them(bucket_bytes: int) -> None:
    """Mixed dtypes, a non-contiguous tensor and a scalar go through one byte buffer, reused bucket after
    bucket; the receiver's cut (from the specs alone) is the sender's."""
    tensors = _tensors()
    got, cut, buffers = {}, [], set()
    for flat, bucket in packed(tensors.items(), bucket_bytes):
        got |= {name: view.clone() for name, view in unpack(flat, bucket)}  # before the next bucket overwrites it
        cut.append(bucket)
        buffers.add(flat.untyped_storage().data_ptr())
    assert cut == buckets(specs(tensors), bucket_bytes)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    if bucket_bytes > 1:  # a buffer is made again only where a tensor outgrows it ("big"), then reused
        assert len(buffers) == {1024: 2, 1 << 20: 1}[bucket_bytes]


def _unpacked(tensors: dict[str, torch.Tensor], bucket_bytes: int, memory: BucketMemory) -> dict[str, torch.Tensor]:
    got = {}
    for flat, bucket in packed(tensors.items(), bucket_bytes, memory):
        got |= {name: view.clone() for name, view in unpack(flat, bucket)}
    return got


def test_the_memory_buckets_are_packed_into_is_made_once_at_the_size_it_carries() -> None:
    """Every call (a weight version) writes into the memory the first one made: one allocation for the run,
    of exactly the set's size when it fits in one bucket (not a whole bucket for a model of a few bytes), of
    one bucket otherwise. A larger set grows it once, keeping what the bucket being filled had already
    written there. Mutation checked: allocating a buffer per call fails the first assertion on ``made``."""
    tensors = _tensors()
    total = sum(gpu._spec_bytes(spec) for spec in specs(tensors))
    memory, made = BucketMemory(), set()
    for version in range(30):
        moved = {name: tensor + version if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}
        got = _unpacked(moved, 1 << 20, memory)
        assert all(torch.equal(got[name], tensor) for name, tensor in moved.items()), version
        made.add(id(memory.buffer))
    assert len(made) == 1 and memory.buffer.numel() == total
    larger = {"first": torch.ones(3), **tensors, "last": torch.arange(700.0)}  # outgrows it in mid-bucket
    for _ in range(3):
        got = _unpacked(larger, 1 << 20, memory)
        assert all(torch.equal(got[name], tensor) for name, tensor in larger.items())
        made.add(id(memory.buffer))
    assert len(made) == 2 and memory.buffer.numel() == sum(gpu._spec_bytes(s) for s in specs(larger))
    cut = BucketMemory()
    for _ in range(3):
        got = _unpacked(tensors, 1024, cut)  # several buckets: one bucket's memory ("big" alone outgrows it)
        assert all(torch.equal(got[name], tensor) for name, tensor in tensors.items())
    assert cut.buffer.numel() == 4096


def test_weights_offered_over_cuda_ipc_are_shared_once_for_the_run(monkeypatch) -> None:
    """The bookkeeping of the CUDA IPC sender, on CPU (share and release stood in): one share for every bucket
    of every version, whether the publication ran to its end or stopped early (the receivers failed or
    died: the caller closes the iterator); the sender gives up its hold only on memory it replaced. Before,
    each version's buffer was shared anew and never freed once a receiver had opened it."""
    shares, released = [], []
    monkeypatch.setattr(gpu, "share", lambda tensor: shares.append(tensor) or {"buffer": len(shares)})
    monkeypatch.setattr(gpu, "release", released.append)
    offered = SharedBuckets()
    tensors = _tensors()
    for version in range(40):
        publication = offered.offer(tensors.items(), 4096)
        for index, (bucket, descriptor) in enumerate(publication):
            assert descriptor == {"buffer": 1, "event_sync": False}  # written before it is offered: no event
            got = dict(unpack(offered.memory.buffer, bucket))
            assert all(torch.equal(got[name], tensors[name]) for name, _, _ in bucket)
            if version % 3 == 1 and index == 1:
                publication.close()
    assert offered.shares == 1 and len(shares) == 1 and shares[0] is offered.memory.buffer and released == []
    more = {**tensors, "huge": torch.zeros(5000)}  # a bucket larger than the buffer: replaced, once
    for _ in range(3):
        list(offered.offer(more.items(), 4096))
    assert offered.shares == 2 and released == [{"buffer": 1, "event_sync": False}]


def test_a_bucket_that_does_not_match_its_specs_is_refused() -> None:
    flat, bucket = next(packed(_tensors().items(), 1 << 20))
    with pytest.raises(ValueError, match="sender and receiver disagree"):
        unpack(flat[:-1], bucket)


def test_nothing_is_packed_from_nothing() -> None:
    assert list(packed({}.items(), 1024)) == []


def test_dtype_names_are_checked_not_looked_up_freely() -> None:
    assert dtype_named("bfloat16") is torch.bfloat16
    for bad in ("Tensor", "load", "no_such_dtype"):
        with pytest.raises(ValueError, match="not a torch dtype that travels"):
            dtype_named(bad)


def test_a_group_needs_a_tcp_address_and_a_rank_inside_it() -> None:
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        BroadcastGroup("ipc:///tmp/x", 0, 2)
    with pytest.raises(ValueError, match="outside a group of 2"):
        BroadcastGroup("tcp://127.0.0.1:9", 2, 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_broadcast_in_buckets_reaches_another_process_bit_exact(device: str) -> None:
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL broadcast between two processes needs two GPUs (device kind nvidia-h200-x2)")
    tensors = _tensors(device)
    group = BroadcastGroup("tcp://127.0.0.1:0", 0, 2, device=device, timeout_s=60)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        received = child.submit(_receive, group.address, specs(tensors), 1024, device)
        group.send(tensors, bucket_bytes=1024)
        result = received.result(timeout=120)
    assert result["buckets"] == 3
    for name, tensor in tensors.items():
        values, dtype = result["tensors"][name]
        assert dtype == str(tensor.dtype)
        assert torch.equal(torch.tensor(values, dtype=tensor.dtype), tensor.cpu()), name


def _open_and_sum(descriptors: bytes, bucket: list) -> dict:
    """A process on the same GPU: open the shared bucket, report its tensors' sums, and write into one."""
    opened = dict(unpack(open_shared(msgpack.unpackb(descriptors)), bucket))
    sums = {name: float(t.double().sum()) for name, t in opened.items()}
    opened["a"].fill_(7.0)
    torch.cuda.synchronize()
    return sums


@pytest.mark.gpu
def test_a_bucket_shared_over_cuda_ipc_opens_in_another_process_without_a_copy() -> None:
    """The receiver takes, among the buffers offered on several GPUs, the one on its own."""
    tensors = _tensors("cuda")
    flat, bucket = next(packed(tensors.items(), 1 << 20))
    mine = share(flat)
    elsewhere = dict(mine, gpu="GPU-00000000-0000-0000-0000-000000000000")
    wire = msgpack.packb([elsewhere, mine])  # plain data: it crosses a socket as it is
    expected = {name: float(tensor.double().sum()) for name, tensor in tensors.items()}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        sums = child.submit(_open_and_sum, wire, bucket).result(timeout=120)
    for name, tensor in tensors.items():
        assert sums[name] == pytest.approx(expected[name], rel=1e-6), name
    assert bool((dict(unpack(flat, bucket))["a"] == 7.0).all()), "the receiver's views are the sender's memory"


@pytest.mark.gpu
def test_cuda_ipc_refuses_a_bucket_offered_only_on_another_gpu() -> None:
    descriptor = share(torch.ones(3, device="cuda"))
    descriptor["gpu"] = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(ValueError, match="nothing was shared on this process's GPU"):
        open_shared([descriptor])


def test_sharing_a_cpu_tensor_says_what_ipc_shares() -> None:
    with pytest.raises(ValueError, match="CUDA tensors only"):
        share(torch.ones(2))


class _Weights(TrainEngine):
    """A trainer engine reduced to what :meth:`TrainEngine.shared_buckets` reads: its weights."""

    device = "cuda"
    weight_version = 0

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def named_weights(self, device: str | None = None) -> dict[str, torch.Tensor]:
        return self.tensors

    def train_step(self, batch):
        raise NotImplementedError

    def save_hf(self, folder):
        raise NotImplementedError

    def save(self, folder):
        raise NotImplementedError

    def load(self, folder):
        raise NotImplementedError


@pytest.mark.gpu
def test_shared_buckets_keep_one_buffer_for_every_version() -> None:
    """Publication after publication, stopped early or not, the trainer's GPU memory stays where the first left
    it: one buffer, of the bucket size, shared once (torch's bookkeeping of 20,000 shares of one buffer
    overflowed the stack when it was freed)."""
    engine = _Weights({f"w{i}": torch.randn(256, 256, device="cuda") for i in range(16)})  # 256 KiB each
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert sum(1 for _ in engine.shared_buckets(1 << 18, torch.float32)) == 16
    after_first = torch.cuda.memory_allocated()
    assert after_first - before == 1 << 18
    for _ in range(50):
        stopped = engine.shared_buckets(1 << 18, torch.float32)
        next(stopped)
        stopped.close()
        assert sum(1 for _ in engine.shared_buckets(1 << 18, torch.float32)) == 16
    assert torch.cuda.memory_allocated() == after_first
    many = _Weights({f"w{i}": torch.full((1,), float(i), device="cuda") for i in range(25_000)})
    shares = {(descriptor["counter"], descriptor["counter_offset"])  # each share takes a counter of its own
              for _, buffers in many.shared_buckets(1, torch.float32) for descriptor in buffers}
    assert len(shares) == 1
