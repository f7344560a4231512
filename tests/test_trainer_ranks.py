"""How a trainer rank meets rank 0 (vime.backends.tensor_parallel): what it says when it cannot."""

from __future__ import annotations

import datetime
import socket
import time

import pytest

from vime.backends import tensor_parallel


def test_a_rank_that_cannot_reach_the_store_says_so_within_seconds(monkeypatch):
    """A node whose route to the head's --host is wrong used to wait the group's 30 minutes in silence. A port
    held bound and not listening refuses every connection, as a wrong address or a firewall does."""
    monkeypatch.setattr(tensor_parallel, "STORE_REACH", datetime.timedelta(seconds=3))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"could not reach rank 0's store at 127.0.0.1:{port} within 3 s"
                                                r".*--host"):
            tensor_parallel._store("127.0.0.1", port, 2, leader=False)
    assert time.monotonic() - started < 30


def test_a_rank_that_reaches_the_store_keeps_the_group_timeout():
    """The short wait is for reaching the store only: afterwards a rank waits on its keys as long as rank 0 may
    take between collectives (a whole checkpoint's load)."""
    leader = tensor_parallel._store("127.0.0.1", 0, 2, leader=True)
    follower = tensor_parallel._store("127.0.0.1", leader.port, 2, leader=False)
    assert follower.timeout == tensor_parallel.GROUP_TIMEOUT
    follower.set("k", "v")
    assert leader.get("k") == b"v"
