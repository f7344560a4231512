"""Fuzzing over real sockets, CI-sized: every actor kind on ipc, tcp and tls+tcp, the join path, the HTTP endpoint.

The machinery is bench/fuzz.py's (whose full run sends 100,000 frames per target); here each target gets
``FUZZ_WIRE_FRAMES`` (default 2,000) frames or requests, seeded, and runs in this process (a process per
target would spend the budget on imports), still behind its real listening socket. A target fails the
test when it accepts garbage, dies, stops answering a real request, or leaks: more trio tasks than the
stranger outboxes it may keep (16) plus a few, or RSS grown by more than ``RSS_BOUND_MIB``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import structlog
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fuzz  # noqa: E402
import fuzz_frames  # noqa: E402
from fuzz_http import TASK, claim, hang_up  # noqa: E402
from fuzz_http import request as http_request  # noqa: E402

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
    assert result.errors.get("http_5xx", 0) == 0 and result.errors.get("http_failed_connections", 0) == 0, result
    assert result.detail["vanished_streams"] >= 2  # streams that were answered 200 before their client left
    assert result.detail["slow_loris_closed_by_server"] == result.detail["slow_loris_opened"] > 0
    assert tasks_grown <= TASK_SLACK, f"the endpoint kept {tasks_grown} more tasks after the fuzz"
    assert result.rss_after_kib - result.rss_before_kib < RSS_BOUND_MIB << 10, result


def test_the_http_target_has_a_chat_template_without_the_shared_data_folder(tmp_path, monkeypatch):
    """Where the shared Qwen3 tokenizer is absent (CI's checkout), the endpoint was served the arithmetic model,
    whose tokenizer has no chat template: every completion, the vanishing streams' too, was a 500."""
    from vime.agent.endpoint import check_chat_template
    from vime.backends.hf import load_tokenizer
    from vime.config import RunConfig

    monkeypatch.setattr(fuzz, "QWEN3_TOKENIZER", tmp_path / "absent")
    configs = fuzz.prepare_configs(tmp_path / "job")
    models = {key: RunConfig.from_dict(json.loads(Path(path).read_text())).model.model_path
              for key, path in configs.items()}
    with pytest.raises(ValueError, match="has no chat template"):  # what a worker serving agents now says at start
        check_chat_template(load_tokenizer(models["actor"]), thinking=False)
    check_chat_template(load_tokenizer(models["http"]), thinking=False)


async def test_endpoint_clients_that_hang_up_get_no_5xx_and_their_generation_finishes(folder, configs, tls,
                                                                                     monkeypatch):
    """Real completions on the fuzz target's rollout worker: streams whose client leaves after the head or the
    first chunk (a close or a reset, at once or a little later), and plain completions whose client leaves
    before the answer. None is a 5xx or a logged failure; each generation finishes (the episode takes its next
    turn) and the worker goes on serving."""
    spec = {**spec_for("http", folder, configs, tls), "run_dir": str(folder / "http-hang-ups")}
    Path(spec["run_dir"]).mkdir()
    with structlog.testing.capture_logs() as logs:
        monkeypatch.setattr(http, "_log", structlog.get_logger())  # (the module's own is cached on first use)
        async with trio.open_nursery() as nursery:
            facts = await nursery.start(fuzz.serve_target, spec)
            url = urlsplit(facts["url"])
            async with fuzz.probe(facts["address"], facts["name"], spec["tls"], folder) as client:
                before = await fuzz.status_of(client)
                await client.tell(client.target, fuzz_frames.example_group(group_size=8))
                episodes = []
                with trio.fail_after(60):
                    while len(episodes) < 8:
                        task = await claim(facts["url"])
                        if task is None or task["id"] is None:
                            await trio.sleep(0.1)
                        else:
                            episodes.append(task["id"])

                async def complete(episode: str, messages: list, *, stream: bool, leave: dict | None) -> bytes:
                    """POST a completion; with ``leave`` the client hangs up (see ``hang_up``), else it reads the
                    whole answer, trying again while the episode's last generation is still running (409)."""
                    body = json.dumps({"model": "m", "messages": messages, "stream": stream, "max_tokens": 2}).encode()
                    data = http_request("POST", f"/episodes/{episode}/v1/chat/completions", body,
                                        {} if leave else {"connection": "close"})
                    while True:
                        received = await hang_up(url.hostname, url.port, data, **(leave or {"after": None}),
                                                 read_all=not leave)
                        if not received.startswith(b"HTTP/1.1 409"):
                            return received
                        await trio.sleep(0.02)

                ways = [{"after": after, "wait_s": wait_s, "reset": reset}
                        for after in (b"\r\n\r\n", b"data: ") for wait_s in (0.0, 0.02) for reset in (False, True)]
                for episode, leave in zip(episodes, ways):
                    messages = list(TASK)
                    answer = await complete(episode, messages, stream=True, leave=leave)
                    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
                    messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "1"}]
                    answer = await complete(episode, messages, stream=False, leave=None)  # the stream's turn ended
                    assert answer.startswith(b"HTTP/1.1 200") and b'"finish_reason"' in answer, answer[:300]
                    messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "2"}]
                    await complete(episode, messages, stream=False, leave={"after": None})
                    messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "3"}]
                    answer = await complete(episode, messages, stream=True, leave=None)  # so did the plain one's
                    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), (
                        answer[-300:])
                assert await claim(facts["url"]) == {"id": None}  # still serving (every episode is claimed)
                after = await fuzz.status_of(client)
            facts["stop"]()
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
    grown = {key: after.counters.get(key, 0) - before.counters.get(key, 0) for key in after.counters
             if key.startswith("http_")}
    assert grown.get("http_5xx", 0) == 0 and grown.get("http_failed_connections", 0) == 0, grown
    assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")], logs

