"""Token in, token out: a multi-turn tool episode trains on exactly the engine's tokens, and on no others."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import trio

from vime.actors.rollout import RolloutWorker
from vime.agent import sandbox
from vime.agent.episode import Episode, parse_tool_calls, tool_messages, turn_ids
from vime.agent.tools import Toolbox
from vime.backends.base import RolloutEngine, SamplingParams, Sequence, collate
from vime.backends.torch_train import TorchTrainEngine
from vime.config import RunConfig
from vime.data import prompt_ids
from vime.devtools.make_tiny_model import make_tiny_model
from vime.devtools.shared_data import shared_data
from vime.messages.pipeline import GenerateGroup, RolloutGroup
from vime.runtime import ActorSettings
from vime.scenarios import arithmetic
from vime.weights import WeightsShared

TOKENIZER = shared_data() / "qwen3-tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"the Qwen3 tokenizer is not at {TOKENIZER} (the shared data folder is absent on this machine)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def _engine_output(tokenizer, *pieces: str | list[str]) -> list[int]:
    """Token ids as an engine might sample them: text pieces tokenized apart, and lists of raw tokens
    (splits the tokenizer itself would never make)."""
    ids: list[int] = []
    for piece in pieces:
        ids += tokenizer.convert_tokens_to_ids(piece) if isinstance(piece, list) else tokenizer(piece)["input_ids"]
    return ids


def test_an_episode_keeps_the_engines_tokens_and_masks_what_it_inserted(tokenizer):
    eos = tokenizer.eos_token_id
    first = _engine_output(tokenizer, "<think>\nSixteen", ["Ġeg", "gs"], ", minus 3 and 4.\n</think>\n\n",
                           '<tool_call>\n{"name": "calculator", "arguments": {"expression": "16 - 3 - 4"}}\n'
                           "</tool_call>") + [eos]
    assert tokenizer(tokenizer.decode(first))["input_ids"] != first  # re-encoding would change what is trained
    episode = Episode(prompt_ids=tokenizer("What is 16 - 3 - 4?")["input_ids"])
    episode.add_generated(first, [-0.5] * len(first), [3] * len(first))
    calls = parse_tool_calls(tokenizer.decode(first))  # the text is read to find the call, never re-encoded
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "16 - 3 - 4"})]
    outcome = sandbox.run("vime.agent.calculator:calculator", calls[0].arguments)
    assert outcome.ok and outcome.output == "9"
    inserted = turn_ids(tokenizer, tool_messages([outcome.output]), ended_with_eos=True)
    episode.add_inserted(inserted)
    episode.turns.append({"call": dataclasses.asdict(calls[0]), "result": outcome.output})
    second = _engine_output(tokenizer, "<think>\n</think>\n\nThe answer is 9", ["Ġeg", "gs"], ".") + [eos]
    episode.add_generated(second, [-0.25] * len(second), [4] * len(second))

    assert tokenizer.decode(inserted) == ("\n<|im_start|>user\n<tool_response>\n9\n</tool_response><|im_end|>\n"
                                          "<|im_start|>assistant\n")
    assert episode.response_ids == first + inserted + second
    assert episode.loss_mask == [1] * len(first) + [0] * len(inserted) + [1] * len(second)
    assert episode.logprobs == [-0.5] * len(first) + [0.0] * len(inserted) + [-0.25] * len(second)
    assert episode.versions == [3] * len(first) + [-1] * len(inserted) + [4] * len(second)
    with pytest.raises(ValueError, match="need as many log-probs"):
        episode.add_generated([1, 2], [0.0], [0, 0])


def test_tool_calls_are_read_or_reported(tokenizer):
    text = ('<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}\n</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call><tool_call>{oops}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "2+2"}), ("search", {"q": "x"})]
    assert calls[2].name == "" and "could not read the tool call" in calls[2].error
    assert parse_tool_calls("no calls here") == []
    # without the model's own end token, the turn's closing is inserted whole; with thinking off, the next
    # prompt carries the empty thinking block Qwen3's template writes
    closing = turn_ids(tokenizer, tool_messages(["a", "b"]), ended_with_eos=False, thinking=False)
    assert tokenizer.decode(closing) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_inserted_tokens_take_no_part_in_the_loss_or_the_metrics(tmp_path, algo):
    """Whatever log-probs the inserted tokens carry, the step (metrics and new weights) is the same."""
    folder = tmp_path / "model"
    arithmetic.build_model(folder, seed=0, hidden_size=32, layers=1)
    run = RunConfig()

    def step(inserted_logprob: float) -> tuple[dict, dict]:
        engine = TorchTrainEngine(str(folder), algo=algo, optim=run.optim, loss=run.loss, grpo_config=run.grpo,
                                  ppo_config=run.ppo, temperature=1.0, seed=0)
        responses = [[5, 6, 7, 8, 9], [6, 7, 8, 9, 10]]
        masks = [[1, 1, 0, 0, 1], [1, 0, 0, 1, 1]]
        logprobs = [[-2.0 if m else inserted_logprob for m in mask] for mask in masks]
        batch = collate([[1, 4], [1, 5]], responses, logprobs, [[0] * 5, [0] * 5], [1.0, 0.0], [0, 0], 0,
                        loss_masks=masks)
        metrics = engine.train_step(batch)
        return metrics, {name: p.detach().clone() for name, p in engine.policy.named_parameters()}

    metrics, weights = step(0.0)
    other_metrics, other_weights = step(-30.0)
    assert metrics == other_metrics
    assert all(torch.equal(weights[name], other_weights[name]) for name in weights)


class ScriptedEngine(RolloutEngine):
    """Answers every request with its turn of a script, whole, in one step. The turn is the number of
    tool responses already in the prompt, so a response's next turn follows its tool messages."""

    def __init__(self, script: list[list[int]], tool_response_id: int) -> None:
        self.script, self.tool_response_id = script, tool_response_id
        self.weight_version, self.vocab_size = 7, 151_936
        self.queue: list[Sequence] = []

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def add(self, sequences: list[Sequence]) -> None:
        self.queue += sequences

    def step(self) -> list[Sequence]:
        finished, self.queue = self.queue, []
        for sequence in finished:
            turn = self.script[sequence.prompt_ids.count(self.tool_response_id)]
            sequence.response_ids = list(turn)
            sequence.logprobs = [-(index + 1) / 64 for index in range(len(turn))]
            sequence.versions = [self.weight_version] * len(turn)
            sequence.finish_reason = "stop"
        return finished

    def abort(self, request_ids: list[int]) -> None:
        self.queue = [s for s in self.queue if s.request_id not in request_ids]

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.weight_version = version


def scripted_worker(engine: RolloutEngine, config: RunConfig) -> tuple[RolloutWorker, list]:
    """A real rollout worker, in-process, on ``engine``; the list collects what it sends."""

    class Worker(RolloutWorker):
        def _build_engine(self) -> RolloutEngine:
            return engine

    worker = Worker(ActorSettings(name="rollout-0", listen="ipc:///nonexistent"), config.to_dict())
    sent: list = []
    worker._send_hook = sent.append
    return worker, sent


async def rollout_group(tokenizer, folder: Path, script: list[list[int]], **settings) -> tuple[RolloutGroup, dict]:
    """One group of two responses through a real rollout worker (in-process, its sends captured) whose
    engine plays ``script``; its tool calls run in the sandbox."""
    config = RunConfig().replace(model_path=str(folder), chat_template=True, **settings)
    worker, sent = scripted_worker(ScriptedEngine(script, tokenizer.convert_tokens_to_ids("<tool_response>")), config)
    tools = Toolbox(config.agent.tool).schemas if config.agent.tool else None
    prompt = prompt_ids(tokenizer, "What is 16 - 3 - 4?", chat=True, tools=tools)
    sampling = dataclasses.asdict(SamplingParams(max_new_tokens=200, stop_token_ids=(tokenizer.eos_token_id,)))
    async with trio.open_nursery() as nursery:
        worker._nursery = nursery
        await worker.on_start()
        await worker._on_group(GenerateGroup(group_id=0, prompt_ids=prompt, label="9", metadata={}, group_size=2,
                                             messages=[{"role": "user", "content": "What is 16 - 3 - 4?"}],
                                             min_weight_version=0, sampling=sampling), None)
        with trio.fail_after(60):
            while not any(isinstance(e.payload, RolloutGroup) for e in sent):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return next(e.payload for e in sent if isinstance(e.payload, RolloutGroup)), dict(worker.counters)


@pytest.fixture(scope="module")
def tool_model(tokenizer, tmp_path_factory) -> Path:
    return make_tiny_model("qwen3", TOKENIZER, tmp_path_factory.mktemp("tools") / "model", seed=0)


async def test_the_rollout_worker_calls_tools_and_trains_only_the_engines_tokens(tokenizer, tool_model):
    eos = tokenizer.eos_token_id
    first = _engine_output(tokenizer, "<think>\nSixteen", ["Ġeg", "gs"], ".\n</think>\n\n", '<tool_call>\n{"name": '
                           '"calculator", "arguments": {"expression": "16 - 3 - 4"}}\n</tool_call>') + [eos]
    second = _engine_output(tokenizer, "<think>\n</think>\n\n<tool_call>\n", ["{\"", "name"],
                            '": "search", "arguments": {}}\n</tool_call>') + [eos]
    third = _engine_output(tokenizer, "The answer is 9", ["Ġeg", "gs"], ".") + [eos]
    group, counters = await rollout_group(tokenizer, tool_model, [first, second, third],
                                          tool=("vime.agent.calculator:calculator",))
    result = turn_ids(tokenizer, tool_messages(["9"]), ended_with_eos=True)
    unknown = turn_ids(tokenizer, tool_messages(["there is no tool named 'search'; the tools are calculator"]),
                       ended_with_eos=True)
    assert counters["tool_calls"] == 4  # two responses, two calls each
    for sample in group.samples:
        assert sample.response_ids == first + result + second + unknown + third
        assert sample.loss_mask == ([1] * len(first) + [0] * len(result) + [1] * len(second) + [0] * len(unknown)
                                    + [1] * len(third))
        generated = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
        assert generated == first + second + third
        assert [v for v, m in zip(sample.versions, sample.loss_mask) if not m] == [-1] * (len(result) + len(unknown))
        assert sample.weight_version == 7 and sample.finish_reason == "stop"
    samples = group.samples
    batch = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples], [s.logprobs for s in samples],
                    [s.versions for s in samples], [1.0, 0.0], [0, 0], 0, loss_masks=[s.loss_mask for s in samples])
    trained = batch.response_ids[0][batch.response_mask[0].bool()].tolist()
    assert trained == first + second + third  # what the engine produced, token for token
    assert batch.rollout_logprobs[0][batch.response_mask[0].bool()].tolist() == pytest.approx(
        [-(i + 1) / 64 for turn in (first, second, third) for i in range(len(turn))])


async def test_a_response_ends_at_the_turn_limit_without_running_the_call(tokenizer, tool_model):
    eos = tokenizer.eos_token_id
    call = _engine_output(tokenizer, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}'
                                     '\n</tool_call>') + [eos]
    group, counters = await rollout_group(tokenizer, tool_model, [call, call, call],
                                          tool=("vime.agent.calculator:calculator",), max_turns=1)
    inserted = group.samples[0].response_ids[len(call):-len(call)]
    assert tokenizer.decode(inserted).count("division by zero") == 1  # the error reached the model as text
    assert counters["tool_calls"] == 2 and all(len(s.response_ids) == 2 * len(call) + len(inserted)
                                               for s in group.samples)


def test_a_tools_schema_is_its_attribute_or_comes_from_its_signature(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    box = Toolbox(["vime.agent.calculator:calculator", "sandbox_tools:add"])
    assert [s["function"]["name"] for s in box.schemas] == ["calculator", "add"]
    parameters = box.schemas[1]["function"]["parameters"]
    assert parameters["properties"]["a"] == {"type": "integer", "description": "the first"}
    with pytest.raises(ValueError, match="no schema .* give the function a `schema` attribute"):
        Toolbox(["sandbox_tools:spin"])
    with pytest.raises(ValueError, match="already given"):
        Toolbox(["sandbox_tools:add", "sandbox_tools:add"])
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        Toolbox(["no_such_module:f"])


async def test_a_worker_generates_nothing_while_the_buckets_of_an_update_arrive(tmp_path):
    """Over CUDA IPC an update comes a bucket per message, and between the first and the last the engine holds
    two versions mixed: the worker neither steps it nor starts a group then, and once the last is in it goes on
    by itself (a group that came meanwhile starts with no other message to wake the worker)."""
    config = arithmetic.prepare(tmp_path, arithmetic.defaults())
    log: list[str] = []

    class Bucketed(ScriptedEngine):
        def step(self) -> list[Sequence]:
            log.append("step")
            return super().step()

        def load_shared(self, specs, buffers, version, index, last) -> None:
            log.append(f"bucket {index}")
            if last:
                self.weight_version = version

    worker, sent = scripted_worker(Bucketed([[5, 6, 2]], tool_response_id=-1), config)
    sampling = dataclasses.asdict(SamplingParams(max_new_tokens=8, stop_token_ids=(2,)))
    async with trio.open_nursery() as nursery:
        worker._nursery = nursery
        await worker.on_start()
        await worker._on_weights(WeightsShared(version=8, specs=[], buffers=[], index=0, last=False), None)
        await worker._on_group(GenerateGroup(group_id=0, prompt_ids=[1, 4], messages=[], label="x", metadata={},
                                             group_size=1, min_weight_version=7, sampling=sampling), None)
        await trio.sleep(0.3)
        assert log == ["bucket 0"]
        await worker._on_weights(WeightsShared(version=8, specs=[], buffers=[], index=1, last=True), None)
        with trio.fail_after(10):
            while not any(isinstance(e.payload, RolloutGroup) for e in sent):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert log == ["bucket 0", "bucket 1", "step"]
