"""A prompt group on a rollout worker: its responses, the lengths they are forced to, the samples it becomes.

Each response of a group is an :class:`~vime.agent.episode.Episode` (one turn, or several with tools or an
external agent); once every response has ended the group becomes one :class:`~vime.messages.pipeline.Sample` per
response, to be scored and trained on.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from vime.agent.episode import Episode
from vime.backends.base import SamplingParams, Sequence
from vime.messages.pipeline import GenerateGroup, Sample
from vime.seeds import sampling_seed


class Group:
    """A group being generated: its request, the latest turn and the episode of each response, when it started."""

    def __init__(self, request: GenerateGroup, sequences: list[Sequence], started: float) -> None:
        self.request = request
        self.sequences = sequences
        self.episodes = [Episode(request.prompt_ids) for _ in sequences]  # an episode never changes its prompt
        self.rewards: list[float | None] = [None] * len(sequences)  # an external agent's own scores
        self.started = started
        self.unfinished = len(sequences)

    def samples(self, tokenizer: Any, prompt_text: bool = False) -> list[Sample]:
        """One sample per response, the tokens the engine produced (and those inserted between its turns).
        ``prompt_text``: each sample carries the prompt decoded too (a ``--custom-rm-path`` reward reads it as
        slime's ``sample.prompt``); off, it is left empty rather than copied to the reward, buffer and trainer."""
        request = self.request
        prompt = tokenizer.decode(request.prompt_ids) if prompt_text else ""
        return [Sample(group_id=request.group_id, index=index, prompt_ids=e.prompt_ids,
                       response_ids=e.response_ids, logprobs=e.logprobs, versions=e.versions,
                       finish_reason=s.finish_reason or "length", label=request.label, metadata=request.metadata,
                       response_text=tokenizer.decode(e.response_ids, skip_special_tokens=True),
                       prompt_text=prompt,
                       routed_experts=s.routed_experts, loss_mask=e.loss_mask if 0 in e.loss_mask else None,
                       reward=reward)
                for index, (s, e, reward) in enumerate(zip(self.sequences, self.episodes, self.rewards))]


def first_turns(request: GenerateGroup, params: SamplingParams, forced: str,
                run_seed: int) -> list[tuple[SamplingParams, int]]:
    """The sampling parameters and seed of each response's first turn: the group's parameters, with the length
    ``--forced-response-lengths`` forces (``forced``; a forced response ignores its stop tokens), and a seed of
    the run's seed and the response alone (``vime.seeds.sampling_seed``)."""
    lengths = forced_lengths(forced, params.max_new_tokens, run_seed, request.group_id, request.group_size)
    return [(params if length is None else dataclasses.replace(params, max_new_tokens=length, stop_token_ids=()),
             sampling_seed(run_seed, request.group_id, index)) for index, length in enumerate(lengths)]


def forced_lengths(spec: str, max_new_tokens: int, seed: int, group_id: int, count: int) -> list[int | None]:
    """The length each of a group's ``count`` responses is forced to by ``--forced-response-lengths`` (None:
    not forced). Drawn from the run's seed and the group's id, so a group re-issued to another worker, or
    a replayed run, gets the same lengths."""
    if not spec:
        return [None] * count
    if spec == "max":
        return [max_new_tokens] * count
    low = min(int(spec.removeprefix("uniform:")), max_new_tokens)
    generator = random.Random(f"{seed}:{group_id}")
    return [generator.randint(low, max_new_tokens) for _ in range(count)]
