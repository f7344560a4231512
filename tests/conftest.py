"""Shared fixtures: a running job (driver + real actor processes) in a temp folder."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from vime import Cluster
from vime.logs import configure

configure("warning")


@contextlib.asynccontextmanager
async def open_job(run_dir: Path, transport: str = "ipc", **kwargs: Any) -> AsyncIterator[Cluster]:
    async with Cluster.open(run_dir, transport=transport, **kwargs) as cluster:
        yield cluster


@pytest.fixture(params=["ipc", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests are real tests; on a machine without CUDA they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine (see ../shared/device/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
