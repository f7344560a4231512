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
the count per actor kind. The frames are made in ``bench/fuzz_frames.py``, shared with the fuzzing over
real sockets (``tests/test_fuzz_wire.py``, ``bench/fuzz.py``).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from fuzz_frames import TOKEN, attack  # noqa: E402 (the frames bench/fuzz.py sends over the wire)

from vime.messages.runtime import ErrorReply  # noqa: E402
from vime.roles import resolve_role  # noqa: E402
from vime.runtime import ActorSettings  # noqa: E402
from vime.scenarios import arithmetic  # noqa: E402
from vime.transports.codec import Envelope  # noqa: E402

FRAMES = int(os.environ.get("FUZZ_FRAMES", "100000"))
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # bytes frames are read-only


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
