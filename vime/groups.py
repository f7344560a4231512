"""A prompt group on a rollout worker: its responses, the lengths they are forced to, the samples it becomes.

Each response of a group is an :class:`~vime.agent.episode.Episode` (one turn, or several with tools or an
external agent); once every response has ended the group becomes one :class:`~vime.messages.pipeline.Sample` per
response, to be scored and trained on. :class:`InFlight` is a worker's book of its groups: which response each
engine request is a turn of.
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


class InFlight:
    """A rollout worker's groups being generated, and which response of which group each engine request is a turn
    of. Request ids are the worker's own, counted from 0. A group that external agents drive is kept here too,
    but its turns take ids from the same count without being booked to a response: the endpoint follows them
    (``vime.agent.endpoint``)."""

    def __init__(self) -> None:
        self.groups: dict[int, Group] = {}
        self.by_request: dict[int, tuple[Group, int]] = {}
        self.next_request = 0

    def sequence(self, prompt_ids: list[int], params: SamplingParams, stream: bool = False,
                 seed: int | None = None) -> Sequence:
        """A new engine request."""
        sequence = Sequence(self.next_request, prompt_ids, params, stream=stream, seed=seed)
        self.next_request += 1
        return sequence

    def start(self, request: GenerateGroup, params: SamplingParams, forced: str, run_seed: int, now: float,
              booked: bool) -> Group:
        """The group and each response's first turn (``first_turns``); ``booked``: the turns are the engine's to
        run here (not an external agent's)."""
        sequences = [self.sequence(list(request.prompt_ids), turn, seed=seed)
                     for turn, seed in first_turns(request, params, forced, run_seed)]
        group = self.groups[request.group_id] = Group(request, sequences, now)
        if booked:
            for index, sequence in enumerate(sequences):
                self.by_request[sequence.request_id] = (group, index)
        return group

    def turn_ended(self, sequence: Sequence) -> tuple[Group, int]:
        """A booked turn ended: its tokens join its response's episode; the response's group and index."""
        group, index = self.by_request.pop(sequence.request_id)
        group.sequences[index] = sequence
        group.episodes[index].add_generated(sequence.response_ids, sequence.logprobs, sequence.versions)
        return group, index

    def next_turn(self, group: Group, index: int, params: SamplingParams, run_seed: int) -> Sequence:
        """The next turn of a response that goes on (after its tool calls), with a seed of its own turn."""
        episode = group.episodes[index]
        seed = sampling_seed(run_seed, group.request.group_id, index, turn=len(episode.turns))
        follow = self.sequence(episode.prompt_ids + episode.response_ids, params, seed=seed)
        self.by_request[follow.request_id] = (group, index)
        return follow

    def abandon(self) -> list[int]:
        """The worker is leaving and its groups were handed back: the booked engine requests, to abort, and
        forgotten, so that a turn the engine still reports is not mistaken for work to go on with."""
        requests = list(self.by_request)
        self.by_request.clear()
        return requests

    def response_ended(self, group: Group) -> bool:
        """One response of the group is complete; True when it was the last (the group leaves the book)."""
        group.unfinished -= 1
        if group.unfinished:
            return False
        del self.groups[group.request.group_id]
        return True


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
