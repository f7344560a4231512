"""A rollout worker's book of groups in flight (vime.groups.InFlight): which response each engine request is a turn
of, through first turns, a tool follow-up, a group's end and a worker leaving mid-group."""

from __future__ import annotations

import dataclasses

from vime.backends.base import SamplingParams
from vime.groups import InFlight
from vime.messages.pipeline import GenerateGroup


def _request(group_id: int, size: int) -> GenerateGroup:
    return GenerateGroup(group_id=group_id, prompt_ids=[3, 4], messages=[], label="7", metadata={}, group_size=size,
                         min_weight_version=0, sampling={})


def _ended(sequence, tokens: list[int]):
    return dataclasses.replace(sequence, response_ids=tokens, logprobs=[-0.5] * len(tokens),
                               versions=[1] * len(tokens), finish_reason="stop")


def test_turns_are_booked_to_their_response_and_a_group_leaves_with_its_last_response():
    book = InFlight()
    params = SamplingParams(max_new_tokens=4)
    group = book.start(_request(10, 2), params, forced="", run_seed=5, now=0.0, booked=True)
    first, second = group.sequences
    assert sorted(book.by_request) == [first.request_id, second.request_id]

    assert book.turn_ended(_ended(first, [8])) == (group, 0)
    group.episodes[0].turns.append({"calls": [], "results": []})  # what the tools record (vime.agent.tools)
    follow = book.next_turn(group, 0, params, run_seed=5)  # the response goes on after its tool call
    assert follow.prompt_ids == [3, 4, 8] and book.by_request[follow.request_id] == (group, 0)
    assert follow.seed != first.seed

    book.turn_ended(_ended(follow, [9]))
    assert not book.response_ended(group) and 10 in book.groups
    book.turn_ended(_ended(second, [6, 6]))
    assert book.response_ended(group) and not book.groups and not book.by_request
    assert [e.response_ids for e in group.episodes] == [[8, 9], [6, 6]]


def test_a_leaving_worker_abandons_each_booked_request_once_and_external_turns_are_not_booked():
    book = InFlight()
    params = SamplingParams(max_new_tokens=4)
    booked = book.start(_request(1, 2), params, forced="", run_seed=5, now=0.0, booked=True)
    external = book.start(_request(2, 2), params, forced="", run_seed=5, now=0.0, booked=False)
    book.turn_ended(_ended(booked.sequences[0], [8]))
    assert book.abandon() == [booked.sequences[1].request_id]
    assert book.abandon() == [] and not book.by_request
    assert sorted(book.groups) == [1, 2] and external.unfinished == 2  # handed back by the worker, not here
