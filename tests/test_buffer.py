"""The buffer on its own: issuing under the staleness bound, batches, filters, hooks.

The actor runs in-process with its sends captured (as replay does), so each
rule is checked message by message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vime.actors.buffer import Buffer, generation_span
from vime.messages.pipeline import (
    EvalResult,
    GenerateGroup,
    InjectPrompts,
    Sample,
    ScoredGroup,
    TrainBatch,
    WantBatch,
    WeightsPublished,
)
from vime.runtime import ActorSettings
from vime.scenarios import arithmetic
from vime.transports.codec import Envelope
from vime.transports.records import build, to_fields

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("model")
    arithmetic.build_model(folder, seed=0, hidden_size=32, layers=1)
    return str(folder)


async def started_buffer(model_path: str, **overrides) -> tuple[Buffer, list[Envelope]]:
    settings = {"model_path": model_path, "rollout_batch_size": 4, "group_size": 2, **overrides}
    config = arithmetic.defaults().replace(**settings)
    buffer = Buffer(ActorSettings(name="buffer", listen="ipc:///nonexistent", seed=5), config.to_dict())
    sent: list[Envelope] = []
    buffer._send_hook = sent.append
    await buffer.on_start()
    return buffer, sent


def issued(sent: list[Envelope]) -> list[GenerateGroup]:
    return [e.payload for e in sent if isinstance(e.payload, GenerateGroup)]


def scored(request: GenerateGroup, rewards: list[float], version: int) -> ScoredGroup:
    samples = [Sample(group_id=request.group_id, index=i, prompt_ids=request.prompt_ids, response_ids=[3],
                      logprobs=[-1.0], versions=[version], finish_reason="stop", label=request.label,
                      metadata=request.metadata, reward=reward) for i, reward in enumerate(rewards)]
    return ScoredGroup(group_id=request.group_id, samples=samples, worker="rollout-0", generate_s=0.1,
                       finished_at=0.0, reward_s=0.01)


def envelope(payload) -> Envelope:
    return Envelope(type(payload).__name__, "peer", "buffer", 1, None, 0.0, None, False, payload)


async def deliver(buffer: Buffer, payload) -> None:
    handler = getattr(buffer, buffer._handlers[type(payload).__name__])
    await handler(payload, envelope(payload))


async def test_on_policy_issues_one_batch_ahead_and_waits_for_weights(model_path):
    buffer, sent = await started_buffer(model_path, max_staleness=0)
    first = issued(sent)
    assert len(first) == 4 and all(g.min_weight_version == 0 and g.group_size == 2 for g in first)
    for request in first:
        await deliver(buffer, scored(request, [0.0, 1.0], version=0))
    assert issued(sent) == first  # nothing more until version 1 is out
    await deliver(buffer, WantBatch(step=0))
    batch = [e.payload for e in sent if isinstance(e.payload, TrainBatch)]
    assert len(batch) == 1 and len(batch[0].samples) == 8 and batch[0].stats["staleness_max"] == 0
    await deliver(buffer, WeightsPublished(version=1))
    second = issued(sent)[4:]
    assert len(second) == 4 and all(g.min_weight_version == 1 for g in second)


async def test_staleness_bound_issues_k_batches_ahead_and_drops_what_breaks_it(model_path):
    buffer, sent = await started_buffer(model_path, max_staleness=1)
    requests = issued(sent)
    assert [g.min_weight_version for g in requests] == [0] * 8  # batches 0 and 1 may use version 0
    await deliver(buffer, WeightsPublished(version=2))  # the trainer raced ahead (e.g. other groups)
    await deliver(buffer, WantBatch(step=2))
    for request in requests[:4]:
        await deliver(buffer, scored(request, [0.0, 1.0], version=0))  # 0 < 2 - 1: stale
    assert buffer.counters["dropped_stale"] == 4
    assert not [e for e in sent if isinstance(e.payload, TrainBatch)]
    refills = issued(sent)[8:]
    assert refills and all(g.min_weight_version >= 1 for g in refills)


async def test_dynamic_sampling_drops_uniform_groups_and_refills(model_path):
    buffer, sent = await started_buffer(model_path, dynamic_sampling=True)
    first = issued(sent)
    await deliver(buffer, scored(first[0], [1.0, 1.0], version=0))
    await deliver(buffer, scored(first[1], [0.0, 1.0], version=0))
    assert buffer.counters["dropped_filtered"] == 1
    assert len(issued(sent)) == 5  # one replacement prompt
    await deliver(buffer, scored(first[0], [0.0, 1.0], version=0))
    assert buffer.counters["duplicates"] == 1


async def test_dynamic_sampling_stops_a_run_that_never_keeps_a_group(model_path):
    buffer, sent = await started_buffer(model_path, dynamic_sampling=True, dynamic_sampling_patience=2)
    crashes = []
    buffer.crash = crashes.append
    for count in range(7):  # 2 batches' worth is 8 groups; a kept one starts the count again
        await deliver(buffer, scored(issued(sent)[count], [0.0, 0.0], version=0))
    await deliver(buffer, scored(issued(sent)[7], [0.0, 1.0], version=0))
    for count in range(8, 15):
        await deliver(buffer, scored(issued(sent)[count], [1.0, 1.0], version=0))
    assert not crashes
    await deliver(buffer, scored(issued(sent)[15], [0.0, 0.0], version=0))
    assert len(crashes) == 1 and "dropped 8 groups in a row" in str(crashes[0])
    assert "--no-dynamic-sampling" in str(crashes[0])


async def test_eval_rounds_score_held_out_prompts_apart_from_training(model_path, tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"q": f"{a}+1=", "a": str(a + 1), "data_source": "s"}) + "\n"
                                for a in range(3)))
    buffer, sent = await started_buffer(model_path, eval_data=str(held_out), eval_every=2, eval_samples=3,
                                        eval_input_key="q", eval_label_key="a", eval_top_k=1, eval_max_new_tokens=5,
                                        steps=3)
    requests = issued(sent)
    evals, train = requests[:3], requests[3:]  # version 0's eval goes out first
    assert [g.group_size for g in evals] == [3, 3, 3] and len(train) == 4
    assert evals[0].sampling["top_k"] == 1 and evals[0].sampling["max_new_tokens"] == 5
    assert evals[0].sampling["stop_token_ids"] == train[0].sampling["stop_token_ids"] != []
    assert buffer.counters["issued"] == 4
    for request, rewards in zip(evals, ([1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])):
        await deliver(buffer, scored(request, rewards, version=0))
    results = [e.payload for e in sent if isinstance(e.payload, EvalResult)]
    assert len(results) == 1 and results[0].version == 0
    assert results[0].metrics["eval/pass@1"] == pytest.approx((1 / 3 + 1 + 0) / 3)
    assert results[0].metrics["eval/pass@3"] == pytest.approx(2 / 3)
    assert not buffer.ready and buffer.counters["scored"] == 0 and buffer.counters["duplicates"] == 0
    await deliver(buffer, WeightsPublished(version=1))  # not scheduled
    assert len(issued(sent)) == 3 + 4 + 4
    await deliver(buffer, WeightsPublished(version=2))
    again = issued(sent)[11:14]
    assert [g.min_weight_version for g in again] == [2, 2, 2] and all(g.group_size == 3 for g in again)


async def test_injected_prompts_go_first_with_their_metadata(model_path):
    buffer, sent = await started_buffer(model_path, rollout_batch_size=1)
    await deliver(buffer, InjectPrompts(prompts=[{"prompt": "4+4=", "label": "8", "source": "ops"}]))
    await deliver(buffer, WeightsPublished(version=1))
    request = issued(sent)[1]
    assert request.label == "8" and request.metadata == {"source": "ops"}
    assert request.prompt_ids == buffer.tokenizer("4+4=")["input_ids"]
    with pytest.raises(ValueError, match=r"a 'prompt' \(a string"):
        await deliver(buffer, InjectPrompts(prompts=[{"text": "no prompt key"}]))


async def test_custom_rollout_hook_rewrites_and_skips(model_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    buffer, sent = await started_buffer(model_path, custom_rollout="buffer_hooks:shout_and_skip_sevens",
                                        rollout_batch_size=40)
    requests = issued(sent)
    assert requests and all(g.label != "7" for g in requests)
    assert all(g.group_size == 3 and g.sampling["top_k"] == 3 and g.metadata == {"hooked": True}
               for g in requests)
    assert buffer.counters["skipped_by_hook"] > 0


async def test_same_seed_same_prompts(model_path):
    _, first = await started_buffer(model_path)
    _, again = await started_buffer(model_path)
    assert [g.prompt_ids for g in issued(first)] == [g.prompt_ids for g in issued(again)]


async def test_rows_the_rollout_side_could_not_serve_are_refused_before_issue(model_path, monkeypatch):
    buffer, sent = await started_buffer(model_path)
    for row, said in [({"prompt": "1+1=", "label": "2", "group_size": 0}, "group_size must be an int >= 1"),
                      ({"prompt": "1+1=", "label": "2", "sampling": {"temperature": 0.5}},
                       "may not change the temperature"),
                      ({"prompt": "1+1=", "label": "2", "sampling": {"top_p": 2.0}}, "top_p must be in")]:
        with pytest.raises(ValueError, match=said):
            await deliver(buffer, InjectPrompts(prompts=[{"prompt": "2+2=", "label": "4"}, row]))
    assert buffer.counters["injected"] == 0 and not buffer.injected  # all or nothing
    monkeypatch.syspath_prepend(str(TESTS))
    buffer, sent = await started_buffer(model_path, custom_rollout="buffer_hooks:breaks_sampling",
                                        rollout_batch_size=30)
    assert buffer.counters["bad_rows"] > 0 and all(g.label != "5" for g in issued(sent))


async def test_an_exhausted_source_stops_the_run_saying_what_to_do(model_path):
    buffer, sent = await started_buffer(model_path, epochs=1, rollout_batch_size=40)
    crashes = []
    buffer.crash = crashes.append
    requests = issued(sent)
    assert len(requests) == 40
    await deliver(buffer, WantBatch(step=0))
    for request in requests:
        await deliver(buffer, scored(request, [0.0, 1.0], version=0))
    await deliver(buffer, WeightsPublished(version=1))  # 15 prompts left of 55: step 1 can never fill
    for request in issued(sent)[40:]:
        await deliver(buffer, scored(request, [0.0, 1.0], version=1))
    await deliver(buffer, WantBatch(step=1))
    assert len(crashes) == 1 and "--epochs 0" in str(crashes[0])


async def test_groups_stop_at_the_eos_of_the_tokenizer_unless_told_otherwise(model_path):
    buffer, sent = await started_buffer(model_path, stop_token_ids=())
    assert issued(sent)[0].sampling["stop_token_ids"] == [buffer.tokenizer.eos_token_id]


def test_a_batch_spans_its_groups_generation_and_leaves_out_groups_without_a_finish_time() -> None:
    """Groups written before ``finished_at`` existed (a checkpoint's ready groups, an old message log) still
    decode, and a batch's generation span leaves them out, as it leaves out groups kept over a resume."""
    old = to_fields(ScoredGroup(group_id=1, samples=[], worker="rollout-0", generate_s=2.0, reward_s=0.1))
    del old["finished_at"]
    assert build(ScoredGroup, old).finished_at is None
    timed = [ScoredGroup(group_id=i, samples=[], worker="rollout-0", generate_s=2.0 + i, finished_at=100.0 + i,
                         reward_s=0.1) for i in range(3)]
    span = generation_span([*timed, build(ScoredGroup, old)])
    assert span == {"generate_from": 98.0, "generate_until": 102.0, "time_generate_span_s": 4.0}
    assert generation_span([build(ScoredGroup, old)]) == {}
