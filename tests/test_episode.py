"""Token in, token out: a multi-turn tool episode trains on exactly the engine's tokens, and on no others."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vime.agent import sandbox
from vime.agent.episode import Episode, parse_tool_calls, tool_turn_ids
from vime.backends.base import collate
from vime.backends.torch_train import TorchTrainEngine
from vime.config import RunConfig
from vime.scenarios import arithmetic

TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "data" / "qwen3-tokenizer"


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
    inserted = tool_turn_ids(tokenizer, [outcome.output], ended_with_eos=True)
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
    closing = tool_turn_ids(tokenizer, ["a", "b"], ended_with_eos=False, thinking=False)
    assert tokenizer.decode(closing) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_inserted_tokens_take_no_part_in_the_loss_or_the_metrics(tmp_path):
    """Whatever log-probs the inserted tokens carry, the step (metrics and new weights) is the same."""
    folder = tmp_path / "model"
    arithmetic.build_model(folder, seed=0, hidden_size=32, layers=1)
    run = RunConfig()

    def step(inserted_logprob: float) -> tuple[dict, dict]:
        engine = TorchTrainEngine(str(folder), algo="grpo", optim=run.optim, loss=run.loss, grpo_config=run.grpo,
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
