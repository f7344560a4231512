"""The OpenAI-compatible endpoint: an external agent, using the real openai client, drives episodes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from test_episode import TOKENIZER, ScriptedEngine, _engine_output

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from fuzz_http import hang_up  # noqa: E402
from fuzz_http import request as http_request  # noqa: E402

from vime.actors.rollout import RolloutWorker
from vime.agent.calculator import SCHEMA
from vime.agent.episode import tool_messages, turn_ids
from vime.backends.base import RolloutEngine, SamplingParams
from vime.config import RunConfig
from vime.devtools.make_tiny_model import make_tiny_model
from vime.messages.pipeline import GenerateGroup, RolloutGroup
from vime.runtime import ActorSettings

openai = pytest.importorskip("openai", reason="the endpoint tests drive it with the openai client: pip install openai")


@pytest.fixture(scope="module")
def tokenizer():
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"the Qwen3 tokenizer is not at {TOKENIZER} (the shared data folder is absent on this machine)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope="module")
def model(tokenizer, tmp_path_factory) -> Path:
    return make_tiny_model("qwen3", TOKENIZER, tmp_path_factory.mktemp("endpoint") / "model", seed=0)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)


def claim(endpoint: str) -> dict:
    """The next open episode, waiting for one."""
    for _ in range(600):
        task = post(f"{endpoint}/episodes", {})
        if task["id"] is not None:
            return task
        time.sleep(0.1)
    raise TimeoutError(f"no episode at {endpoint}")


def as_message(message) -> dict:
    """The reply as the agent sends it back (the SDK's own model, dumped)."""
    return message.model_dump(exclude_none=True)


TASK = [{"role": "user", "content": "What is 16 - 3 - 4?"}]


@contextlib.asynccontextmanager
async def serving(tokenizer, model: Path, run_dir: Path, script: list[list[int]], **settings):
    """A real rollout worker (in-process, its sends captured) serving agents, whose engine plays ``script``;
    one group of two responses to TASK is offered. Yields the endpoint's URL and the captured sends."""
    engine = ScriptedEngine(script, tokenizer.convert_tokens_to_ids("<tool_response>"))
    config = RunConfig().replace(model_path=str(model), chat_template=True, openai_endpoint="127.0.0.1:0", **settings)

    class Worker(RolloutWorker):
        def _build_engine(self) -> RolloutEngine:
            return engine

    worker = Worker(ActorSettings(name="rollout-0", listen="ipc:///nonexistent", run_dir=str(run_dir)),
                    config.to_dict())
    sent: list = []
    worker._send_hook = sent.append
    sampling = dataclasses.asdict(SamplingParams(temperature=1.0, max_new_tokens=200,
                                                 stop_token_ids=(tokenizer.eos_token_id,)))
    async with trio.open_nursery() as nursery:
        worker._nursery = nursery
        await worker.on_start()
        await worker._on_group(GenerateGroup(group_id=0, prompt_ids=[1, 2, 3], messages=TASK, label="9", metadata={},
                                             group_size=2, min_weight_version=0, sampling=sampling), None)
        yield (run_dir / "endpoints" / "rollout-0").read_text().strip(), sent
        nursery.cancel_scope.cancel()


async def test_an_openai_client_drives_episodes_token_in_token_out(tokenizer, model, tmp_path):
    eos = tokenizer.eos_token_id
    first = _engine_output(tokenizer, "<think>\nSixteen", ["Ġeg", "gs"], ".\n</think>\n\n", '<tool_call>\n{"name": '
                           '"calculator", "arguments": {"expression": "16 - 3 - 4"}}\n</tool_call>') + [eos]
    second = _engine_output(tokenizer, "The answer is 9", ["Ġeg", "gs"], ".") + [eos]
    task_messages = TASK
    seen: dict = {}

    def agent(endpoint: str) -> None:
        for reward, stream in ((1.0, False), (None, True)):
            task = claim(endpoint)
            assert task["messages"] == task_messages and task["label"] == "9"
            client = openai.OpenAI(base_url=task["base_url"], api_key="unused")
            messages = list(task["messages"])
            reply = client.chat.completions.create(model="vime", messages=messages, tools=[SCHEMA], logprobs=True)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.model_extra["token_ids"] == first
            call = choice.message.tool_calls[0]
            assert call.function.name == "calculator" and json.loads(call.function.arguments) == {
                "expression": "16 - 3 - 4"}
            assert [entry.logprob for entry in choice.logprobs.content] == [-(i + 1) / 64 for i in range(len(first))]
            messages += [as_message(choice.message), {"role": "tool", "tool_call_id": call.id, "content": "9"}]
            if stream:
                chunks = list(client.chat.completions.create(model="vime", messages=messages, stream=True))
                text = "".join(c.choices[0].delta.content or "" for c in chunks)
                assert chunks[-1].choices[0].finish_reason == "stop"
                seen["streamed"] = text
            else:
                with pytest.raises(openai.BadRequestError, match="temperature is the run's"):
                    client.chat.completions.create(model="vime", messages=messages, temperature=0.3)
                with pytest.raises(openai.BadRequestError, match="max_tokens must be a positive integer"):
                    client.chat.completions.create(model="vime", messages=messages, extra_body={"max_tokens": "x"})
                with pytest.raises(openai.BadRequestError, match="repeat the conversation so far"):
                    edited = [{"role": "user", "content": "something else"}, *messages[1:]]
                    client.chat.completions.create(model="vime", messages=edited)
                answer = client.chat.completions.create(model="vime", messages=messages)
                seen["answer"] = answer.choices[0].message.content
            post(f"{endpoint}/episodes/{task['id']}/end", {} if reward is None else {"reward": reward})
            with pytest.raises(urllib.error.HTTPError, match="404"):
                post(f"{endpoint}/episodes/{task['id']}/end", {})
        assert post(f"{endpoint}/episodes", {}) == {"id": None}

    async with serving(tokenizer, model, tmp_path, [first, second]) as (endpoint, sent):
        with trio.fail_after(120):
            await trio.to_thread.run_sync(agent, endpoint)
            while not any(isinstance(e.payload, RolloutGroup) for e in sent):
                await trio.sleep(0.01)

    group = next(e.payload for e in sent if isinstance(e.payload, RolloutGroup))
    prompt = tokenizer.apply_chat_template(task_messages, tools=[SCHEMA], add_generation_prompt=True)
    inserted = turn_ids(tokenizer, tool_messages(["9"]), ended_with_eos=True)
    assert seen["answer"] == seen["streamed"] == "The answer is 9 eggs."
    assert [s.reward for s in group.samples] == [1.0, None]  # the second is left to the run's reward function
    for sample in group.samples:
        assert sample.prompt_ids == list(prompt if isinstance(prompt, list) else prompt["input_ids"])
        assert sample.response_ids == first + inserted + second  # the engine's tokens, never re-encoded
        assert sample.loss_mask == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
        assert sample.versions == [7] * len(first) + [-1] * len(inserted) + [7] * len(second)


async def test_an_external_agent_completes_episodes_that_are_trained_on(tokenizer, model, tmp_path):
    """A whole run whose responses come from an agent outside it (the real openai client in a thread):
    the rewards it reports are the rewards trained on."""
    from vime.metrics import MetricsFollower
    from vime.pipeline import train

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?", "label": str(2 * a)}) + "\n"
                            for a in range(8)))
    run_dir = tmp_path / "run"
    config = RunConfig().replace(model_path=str(model), data=str(data), chat_template=True, steps=2,
                                 rollout_batch_size=2, group_size=2, max_new_tokens=8, openai_endpoint="127.0.0.1:0",
                                 micro_batch_size=4, updates_per_step=1, rollout_threads=1, train_threads=1)
    rewards: list[float] = []
    finished = trio.Event()

    def agent() -> None:
        endpoint_file = run_dir / "endpoints" / "rollout-0"
        for _ in range(3000):  # the rollout worker starts in 13-23 s; on a loaded machine far more
            if endpoint_file.exists():
                break
            time.sleep(0.1)
        endpoint = endpoint_file.read_text().strip()
        for episode in range(8):  # two steps of two groups of two
            task = claim(endpoint)
            client = openai.OpenAI(base_url=task["base_url"], api_key="unused")
            reply = client.chat.completions.create(model="vime", messages=task["messages"], max_tokens=4,
                                                   stream=episode % 2 == 1)
            if episode % 2 == 1:
                list(reply)
            reward = float(episode % 2)
            rewards.append(reward)
            post(f"{endpoint}/episodes/{task['id']}/end", {"reward": reward})

    async def drive() -> None:
        await trio.to_thread.run_sync(agent)
        finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive)
        await train(config, run_dir, timeout_s=300)
    assert finished.is_set()
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["step"] for row in rows] == [1, 2]
    assert [row["raw_reward"] for row in rows] == [statistics.fmean(rewards[:4]), statistics.fmean(rewards[4:])]
    assert all(0 < row["response_tokens"] <= 4 * 4 for row in rows)


async def test_the_http_server_answers_what_clients_get_wrong_and_keeps_serving():
    from vime.transports import http

    async def handler(request: http.Request) -> http.Response:
        if request.path == "/boom":
            raise RuntimeError("a bug")
        if request.path == "/missing":
            raise http.HTTPError(404, "nothing here")
        if request.path == "/bytes":
            return http.Response({"blob": b"\x00"})  # JSON cannot carry it
        return http.Response({"path": request.path, "body": request.body})

    async def exchange(port: int, raw: bytes) -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(raw)
        received = b""
        with trio.move_on_after(5):
            while chunk := await stream.receive_some(65536):
                received += chunk
                if b"\r\n\r\n" in received and (b"}" in received.split(b"\r\n\r\n", 1)[1]):
                    break
        await stream.aclose()
        return received

    def post(path: str, body: bytes) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body

    async with trio.open_nursery() as nursery:
        port = await nursery.start(lambda task_status: http.serve(handler, "127.0.0.1", 0, max_body=1000,
                                                                  task_status=task_status))
        answers = {
            "garbage": await exchange(port, b"\x16\x03\x01 not http at all\r\n\r\n"),
            "ok": await exchange(port, post("/x", b'{"a": 1}')),
            "not json": await exchange(port, post("/x", b"{oops")),
            "not an object": await exchange(port, post("/x", b"[1, 2]")),
            "too big": await exchange(port, post("/x", b"{" + b" " * 2000 + b"}")),
            "missing": await exchange(port, post("/missing", b"")),
            "bug": await exchange(port, post("/boom", b"")),
            "unsendable": await exchange(port, post("/bytes", b"")),
        }
        assert answers["garbage"].startswith(b"HTTP/1.1 400") and b"not an HTTP/1.1 request" in answers["garbage"]
        assert answers["ok"].startswith(b"HTTP/1.1 200") and b'"body": {"a": 1}' in answers["ok"]
        assert answers["not json"].startswith(b"HTTP/1.1 400") and b"not JSON" in answers["not json"]
        assert answers["not an object"].startswith(b"HTTP/1.1 400") and b"JSON object" in answers["not an object"]
        assert answers["too big"].startswith(b"HTTP/1.1 413")
        assert answers["missing"].startswith(b"HTTP/1.1 404") and b"nothing here" in answers["missing"]
        assert answers["bug"].startswith(b"HTTP/1.1 500") and b"RuntimeError: a bug" in answers["bug"]
        assert answers["unsendable"].startswith(b"HTTP/1.1 500") and b"could not be sent" in answers["unsendable"]
        assert (await exchange(port, post("/x", b"{}"))).startswith(b"HTTP/1.1 200")  # still serving
        nursery.cancel_scope.cancel()


async def test_clients_that_hang_up_before_or_during_the_answer_are_no_failure_of_the_server(monkeypatch):
    """Streaming clients that leave after the head or the first event (a close or a reset, at once or a little
    later, while the server writes flat out or paced), and clients that leave before a plain answer (a small one,
    or one too big to fit the socket's buffers): every answer counts as a 2xx, nothing is logged as a failure,
    every event stream is closed -- an endless one too -- and the server goes on serving."""
    import collections

    import structlog

    from vime.transports import http

    def post(path: str, body: dict) -> bytes:
        return http_request("POST", path, json.dumps(body).encode())

    streams = {"opened": 0, "closed": 0}

    async def endless(pace_s: float) -> AsyncIterator[dict]:
        streams["opened"] += 1
        try:
            while True:
                yield {"delta": "x" * 200}
                await trio.sleep(pace_s)
        finally:
            streams["closed"] += 1

    async def handler(request: http.Request) -> http.Response:
        if request.path == "/boom":
            raise RuntimeError("a bug")
        if request.path == "/stream":
            return http.Response(events=endless(request.body["pace_s"]))
        await trio.sleep(request.body.get("delay_s", 0.0))
        return http.Response({"blob": "x" * request.body.get("size", 0)})

    counters: collections.Counter[str] = collections.Counter()
    with structlog.testing.capture_logs() as logs:
        monkeypatch.setattr(http, "_log", structlog.get_logger())  # (the module's own is cached on first use)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(lambda task_status: http.serve(handler, "127.0.0.1", 0, counters=counters,
                                                                      task_status=task_status))
            for after in (b"\r\n\r\n", b"data: "):
                for wait_s in (0.0, 0.003, 0.02):
                    for reset in (False, True):
                        for pace_s in (0.0, 0.002):
                            received = await hang_up("127.0.0.1", port, post("/stream", {"pace_s": pace_s}),
                                                     after=after, wait_s=wait_s, reset=reset)
                            assert received.startswith(b"HTTP/1.1 200"), received[:100]
            for size in (10, 4 << 20):
                for reset in (False, True):
                    await hang_up("127.0.0.1", port, post("/answer", {"delay_s": 0.05, "size": size}), after=None,
                                  reset=reset)
            await trio.sleep(0.2)  # the last plain answers are written to clients that have gone
            with trio.fail_after(10):
                while streams["closed"] < streams["opened"]:
                    await trio.sleep(0.01)
            assert streams["opened"] == 24
            assert (await hang_up("127.0.0.1", port, post("/boom", {}), after=b"}")).startswith(
                b"HTTP/1.1 500")  # (the logs are caught: the bug's is)
            assert (await hang_up("127.0.0.1", port, post("/answer", {}), after=b"}")).startswith(
                b"HTTP/1.1 200")  # still serving
            nursery.cancel_scope.cancel()
    assert [entry["event"] for entry in logs if entry["log_level"] in ("error", "critical")] == [
        "a request's handler failed"]  # the bug's, only
    assert counters["http_5xx"] == 1 and counters["http_failed_connections"] == 0, counters
    assert counters["http_2xx"] == counters["http_requests"] - 1, counters


async def test_an_episode_whose_agent_went_silent_is_offered_again_from_scratch(tokenizer, model, tmp_path):
    answer = _engine_output(tokenizer, "9") + [tokenizer.eos_token_id]
    async with serving(tokenizer, model, tmp_path, [answer], episode_timeout_s=3.0) as (endpoint, sent):  # > a GC pause

        def agents() -> None:
            gone = claim(endpoint)  # an agent that replies once, then dies
            openai.OpenAI(base_url=gone["base_url"], api_key="unused").chat.completions.create(
                model="vime", messages=gone["messages"])
            other = claim(endpoint)
            post(f"{endpoint}/episodes/{other['id']}/v1/chat/completions", {"messages": other["messages"]})
            post(f"{endpoint}/episodes/{other['id']}/end", {"reward": 0.0})
            again = claim(endpoint)  # waits until the silent one is offered again
            assert again["id"] != gone["id"] and again["messages"] == gone["messages"]
            with pytest.raises(urllib.error.HTTPError, match="404"):
                post(f"{endpoint}/episodes/{gone['id']}/end", {"reward": 1.0})
            post(f"{endpoint}/episodes/{again['id']}/v1/chat/completions", {"messages": again["messages"]})
            post(f"{endpoint}/episodes/{again['id']}/end", {"reward": 1.0})

        with trio.fail_after(60):
            await trio.to_thread.run_sync(agents)
            while not any(isinstance(e.payload, RolloutGroup) for e in sent):
                await trio.sleep(0.01)
    group = next(e.payload for e in sent if isinstance(e.payload, RolloutGroup))
    assert sorted(s.reward for s in group.samples) == [0.0, 1.0]
    assert all(s.response_ids == answer for s in group.samples)  # the silent agent's reply was dropped
