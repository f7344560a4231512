"""Frames an attacker could send a vime actor, for the fuzz tests (in-process and over the wire) and bench/fuzz.py.

Four families, in turn: random bytes (half of them behind the frame magic); valid frames of every
message kind signed with a wrong or no token, then mutated (bit flips, overwritten, inserted, deleted
bytes, truncation), twice; and frames with the right token whose messages are invalid for their kind
(a field of the wrong type, a missing or unknown field, an unknown kind, fields that are no map). Over
the wire the frames also claim reply addresses a stranger might give: ones nng refuses, one a plain
actor cannot dial (``tls+tcp://``), one Python cannot even parse (``tcp://[::1``).

Also here: the test certificates (a CA and one certificate for 127.0.0.1 and localhost, made with
``cryptography`` when it is installed, else the ``openssl`` command).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import msgpack
import torch

from vime.config import SamplingParams
from vime.devtools.certificates import make_tls_files
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
from vime.messages.runtime import StatusQuery
from vime.transports.codec import MAGIC, Envelope, encode, encode_frame
from vime.weights import WantWeights, WeightsChunk

TOKEN = "the-job-token"
REPLY_ADDRESS = "tcp://127.0.0.1:9"
STRANGE_REPLY_ADDRESSES = ("tls+tcp://127.0.0.1:9", "tcp://[::1", "ws://127.0.0.1:9", "bogus", "", "ipc://",
                           "inproc://x", "tcp://127.0.0.1:99999", "tcp://no-such-host.invalid:9")


def sample() -> Sample:
    return Sample(group_id=3, index=0, prompt_ids=[1, 5, 6], response_ids=[7, 2], logprobs=[-0.5, -0.1],
                  versions=[0, 1], finish_reason="stop", label="4", metadata={"k": 1}, response_text="4", reward=1.0)


def example_group(group_size: int = 2) -> GenerateGroup:
    """A valid request for a rollout worker (a worker serving agents offers its responses as episodes)."""
    sampling = dataclasses.asdict(SamplingParams(temperature=1.0, max_new_tokens=4))
    return GenerateGroup(group_id=3, prompt_ids=[1, 5, 6], messages=[{"role": "user", "content": "1+5="}], label="6",
                         metadata={}, group_size=group_size, min_weight_version=0, sampling=sampling)


EXAMPLES = [
    example_group(), WorkerReady(capacity=4, weight_version=0), WorkerLeaving(group_ids=[1, 2]), GroupDone(group_id=3),
    RolloutGroup(group_id=3, samples=[sample()], worker="rollout-0", generate_s=0.1, finished_at=0.0),
    ScoredGroup(group_id=3, samples=[sample()], worker="rollout-0", generate_s=0.1, finished_at=0.0,
                reward_s=0.01),
    WantBatch(step=0), TrainBatch(step=0, samples=[sample()], stats={"x": 1.0}),
    WantWeights(weight_version=0, gpus=[]),
    WeightsChunk(version=1, index=0, count=1, tensors={"w": torch.ones(4, 4)}), WeightsPublished(version=1),
    InjectPrompts(prompts=[{"prompt": "1+1=", "label": "2"}]), SnapshotQuery(step=1), StatusQuery(),
]


def frame(payload: object, token: str | None, msg_id: int, kind: str | None = None, fields: object = None,
          reply_address: str = REPLY_ADDRESS) -> bytes:
    """A frame carrying one message that asks for a reply; ``kind``/``fields`` override the payload's own."""
    envelope = Envelope(type(payload).__name__, "mallory", "victim", msg_id, None, 0.0, None, True, payload)
    encoded = encode(envelope)
    if kind is not None or fields is not None:
        header = msgpack.unpackb(encoded.header, raw=False, strict_map_key=False)
        header[0] = kind if kind is not None else header[0]
        header[8] = fields if fields is not None else header[8]
        encoded.header = msgpack.packb(header)
    return bytes(encode_frame(reply_address, token, [encoded]))


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


def broken(payload: object, rng: random.Random, msg_id: int, reply_address: str = REPLY_ADDRESS) -> bytes:
    """A frame with the right token whose message is invalid for its kind."""
    fields = {name: getattr(payload, name) for name in payload.__dataclass_fields__}
    choice = rng.randrange(5)

    def make(**changes: object) -> bytes:
        return frame(payload, TOKEN, msg_id, reply_address=reply_address, **changes)

    if choice == 0 and fields:  # a field of the wrong type
        name = rng.choice(sorted(fields))
        value = fields[name]
        wrong = 7 if isinstance(value, str) else "s" if isinstance(value, (dict, list)) else [1.5]
        return make(fields={**plain(fields), name: wrong})
    required = sorted(f.name for f in dataclasses.fields(payload)
                      if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if choice == 1 and required:  # a required field missing (one with a default may be left out)
        name = rng.choice(required)
        return make(fields={k: v for k, v in plain(fields).items() if k != name})
    if choice == 2:
        return make(fields={**plain(fields), "extra": 1})
    if choice == 3:
        return make(kind=rng.choice(["Nope", "", "__class__", "eval", "x" * 300]))
    return make(fields=rng.choice([None, 5, "fields", [1, 2], b"\x00"]) or 0)


def plain(fields: dict) -> dict:
    """Fields as they travel (records become maps; tensors are dropped: they are beside the header)."""
    def convert(value: object) -> object:
        if hasattr(value, "__dataclass_fields__"):
            return {k: convert(getattr(value, k)) for k in value.__dataclass_fields__}
        if isinstance(value, list):
            return [convert(v) for v in value]
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items() if not isinstance(v, torch.Tensor)}
        return value
    return {k: convert(v) for k, v in fields.items()}


def attack(rng: random.Random, index: int, wire: bool = False) -> bytes:
    """Frame number ``index`` of the attack; ``wire``: one in four claims a strange reply address."""
    family = index % 4
    if family == 0:
        body = rng.randbytes(rng.randint(0, 300))
        return MAGIC + body[4:] if rng.random() < 0.5 else body
    payload = rng.choice(EXAMPLES)
    reply = rng.choice(STRANGE_REPLY_ADDRESSES) if wire and rng.random() < 0.25 else REPLY_ADDRESS
    if family in (1, 2):
        token = rng.choice(["wrong", None, TOKEN[:-1]])
        signed = frame(payload, token, index, reply_address=reply)
        return signed if reply != REPLY_ADDRESS and rng.random() < 0.5 else mutate(signed, rng)
    return broken(payload, rng, index, reply)


def tls_files(folder: Path) -> dict[str, str]:
    """A throw-away CA and one certificate+key for 127.0.0.1 and localhost: {"cert_key", "ca"} PEM paths."""
    return make_tls_files(folder, "vime-fuzz-ca")
