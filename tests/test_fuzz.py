"""Fuzzing every pipeline actor kind with frames an attacker could send.

Each actor (buffer, router, rollout, reward, trainer) is built as in a job
with a join token and fed, in its own process's code path (``_accept_frame``,
the function its socket loop calls for every frame):

* random bytes, with and without the frame magic;
* valid frames of every message kind it handles, signed with a wrong token,
  then mutated (bit flips, overwritten, inserted, deleted bytes, truncation);
* frames with the right token whose messages are invalid: a field of the
  wrong type, a missing or unknown field, an unknown kind, an oversized one.

None may raise, none may reach a handler or the inbox, and every answer
the actor sends is an ErrorReply. ``FUZZ_FRAMES`` (default 100,000) sets
the count per actor kind.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import msgpack
import pytest
import torch
import trio

from vime.messages.pipeline import (
    GenerateGroup,
    GroupDone,
    InjectPrompts,
    RolloutGroup,
    Sample,
    ScoredGroup,
    SnapshotQuery,
    TrainBatch,
    WantBatch,
    WeightsPublished,
    WorkerLeaving,
    WorkerReady,
)
from vime.messages.runtime import ErrorReply, StatusQuery
from vime.roles import resolve_role
from vime.runtime import ActorSettings
from vime.scenarios import arithmetic
from vime.transports.codec import MAGIC, Envelope, encode, encode_frame
from vime.weights import WantWeights, WeightsChunk

FRAMES = int(os.environ.get("FUZZ_FRAMES", "100000"))
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # bytes frames are read-only
TOKEN = "the-job-token"


def sample() -> Sample:
    return Sample(group_id=3, index=0, prompt_ids=[1, 5, 6], response_ids=[7, 2], logprobs=[-0.5, -0.1],
                  versions=[0, 1], finish_reason="stop", label="4", metadata={"k": 1}, response_text="4", reward=1.0)


EXAMPLES = [
    GenerateGroup(group_id=3, prompt_ids=[1, 5, 6], messages=[{"role": "user", "content": "1+5="}], label="4",
                  metadata={}, group_size=2, min_weight_version=0,
                  sampling={"max_new_tokens": 2}),
    WorkerReady(capacity=4, weight_version=0), WorkerLeaving(group_ids=[1, 2]), GroupDone(group_id=3),
    RolloutGroup(group_id=3, samples=[sample()], worker="rollout-0", generate_s=0.1),
    ScoredGroup(group_id=3, samples=[sample()], worker="rollout-0", generate_s=0.1, reward_s=0.01),
    WantBatch(step=0), TrainBatch(step=0, samples=[sample()], stats={"x": 1.0}),
    WantWeights(weight_version=0, gpus=[]),
    WeightsChunk(version=1, index=0, count=1, tensors={"w": torch.ones(4, 4)}), WeightsPublished(version=1),
    InjectPrompts(prompts=[{"prompt": "1+1=", "label": "2"}]), SnapshotQuery(step=1), StatusQuery(),
]


def frame(payload: object, token: str | None, msg_id: int, kind: str | None = None, fields: object = None) -> bytes:
    """A frame carrying one message; ``kind``/``fields`` override the payload's own (to break it)."""
    envelope = Envelope(type(payload).__name__, "mallory", "victim", msg_id, None, 0.0, None, True, payload)
    encoded = encode(envelope)
    if kind is not None or fields is not None:
        header = msgpack.unpackb(encoded.header, raw=False, strict_map_key=False)
        header[0] = kind if kind is not None else header[0]
        header[8] = fields if fields is not None else header[8]
        encoded.header = msgpack.packb(header)
    return bytes(encode_frame("tcp://127.0.0.1:9", token, [encoded]))


def mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        choice = rng.random()
        position = rng.randrange(len(out) + 1)
        if choice < 0.4 and out:
            out[min(position, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif choice < 0.6 and out:
            out[min(position, len(out) - 1)] = rng.randrange(256)
        elif choice < 0.75:
            out[position:position] = rng.randbytes(rng.randint(1, 16))
        elif choice < 0.9:
            del out[position:position + rng.randint(1, 16)]
        else:
            del out[position:]
    return bytes(out)


def broken(payload: object, rng: random.Random, msg_id: int) -> bytes:
    """A frame with the right token whose message is invalid for its kind."""
    fields = {name: getattr(payload, name) for name in payload.__dataclass_fields__}
    choice = rng.randrange(5)
    if choice == 0 and fields:  # a field of the wrong type
        name = rng.choice(sorted(fields))
        value = fields[name]
        wrong = 7 if isinstance(value, str) else "s" if isinstance(value, (dict, list)) else [1.5]
        return frame(payload, TOKEN, msg_id, fields={**_plain(fields), name: wrong})
    required = sorted(f.name for f in dataclasses.fields(payload)
                      if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if choice == 1 and required:  # a required field missing (one with a default may be left out)
        name = rng.choice(required)
        return frame(payload, TOKEN, msg_id, fields={k: v for k, v in _plain(fields).items() if k != name})
    if choice == 2:
        return frame(payload, TOKEN, msg_id, fields={**_plain(fields), "extra": 1})
    if choice == 3:
        return frame(payload, TOKEN, msg_id, kind=rng.choice(["Nope", "", "__class__", "eval", "x" * 300]))
    return frame(payload, TOKEN, msg_id, fields=rng.choice([None, 5, "fields", [1, 2], b"\x00"]) or 0)


def _plain(fields: dict) -> dict:
    """Fields as they travel (records become maps; tensors are dropped: they are beside the header)."""
    def plain(value: object) -> object:
        if hasattr(value, "__dataclass_fields__"):
            return {k: plain(getattr(value, k)) for k in value.__dataclass_fields__}
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if not isinstance(v, torch.Tensor)}
        return value
    return {k: plain(v) for k, v in fields.items()}


def attack(rng: random.Random, index: int) -> bytes:
    family = index % 4
    if family == 0:
        body = rng.randbytes(rng.randint(0, 300))
        return MAGIC + body[4:] if rng.random() < 0.5 else body
    payload = rng.choice(EXAMPLES)
    if family in (1, 2):
        return mutate(frame(payload, rng.choice(["wrong", None, TOKEN[:-1]]), index), rng)
    return broken(payload, rng, index)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("fuzz")
    return arithmetic.prepare(run_dir, arithmetic.defaults()).to_dict()


@pytest.mark.parametrize("role", ["buffer", "router", "rollout", "reward", "trainer"])
async def test_no_fuzzed_frame_crashes_an_actor_or_is_accepted(role, config, tmp_path):
    settings = ActorSettings(name=role, listen=f"ipc://{tmp_path}/{role}", token=TOKEN, run_dir=str(tmp_path),
                             max_message_bytes=1 << 16)
    actor = resolve_role(role, allow_import=False)(settings, config)
    sent: list[Envelope] = []
    actor._send_hook = sent.append
    rng = random.Random(f"fuzz-{role}")
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        actor._nursery = nursery
        for index in range(FRAMES):
            actor._accept_frame(attack(rng, index), time.time())
            assert not actor._queue, f"frame {index} reached {role}'s inbox"
            if index % 512 == 0:
                await trio.sleep(0)  # let the error replies go out
    elapsed = time.perf_counter() - started
    assert actor.counters["handled"] == 0 and actor.counters["frames_in"] == FRAMES
    assert all(isinstance(e.payload, ErrorReply) for e in sent)
    errors = dict(actor.errors)
    assert errors.get("unauthorized", 0) > FRAMES // 10 and errors.get("schema", 0) > FRAMES // 10, errors
    print(f"{role}: {FRAMES} frames in {elapsed:.1f} s, errors {errors}, error replies {len(sent)}")
