"""Plain data between the trainer's ranks (``vime.backends.plain_collectives``): what is sent comes back as msgpack
gives it, and what is not plain data is refused at the sender instead of pickled. Several ranks exchange through
it in the pipeline-stage tests (``tests/test_megatron.py``, under torchrun); here, a world of one in-process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from vime.backends.plain_collectives import broadcast_plain, gather_bytes, gather_plain
from vime.transports.gpu import dtype_name, dtype_named


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    if not dist.is_initialized():  # as vime.backends.megatron.parallel.init_parallel makes it without a launcher
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_plain_data_comes_back_as_msgpack_gives_it():
    metrics = {"loss": -0.25, "entropy": 2.5, "tis": math.nan, "steps": 3, "name": "policy", "none": None}
    got = broadcast_plain(metrics, src=0)
    assert math.isnan(got.pop("tis")) and got == {k: v for k, v in metrics.items() if k != "tis"}
    shapes = [{"decoder.layers.0.mlp.linear_fc1.weight": (256, 64)}]
    assert gather_plain(shapes) == [[{"decoder.layers.0.mlp.linear_fc1.weight": [256, 64]}]]  # a tuple comes a list
    assert gather_bytes(b"") == [b""] and gather_bytes(b"\x00\xff" * 3) == [b"\x00\xff" * 3]


def test_what_is_not_plain_data_is_refused_not_pickled():
    for value in (torch.zeros(2), torch.bfloat16, {1, 2}, object()):
        with pytest.raises(TypeError):
            broadcast_plain(value, src=0)
    assert dtype_named(dtype_name(torch.bfloat16)) is torch.bfloat16
    with pytest.raises(ValueError, match="is not a torch dtype that travels"):
        dtype_named("__class__")  # a received name is looked up in a table, not with getattr on torch
