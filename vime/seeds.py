"""Every seed of a run comes from its one ``--seed`` (``JobConfig.seed``), here.

What each random stream of a training run is seeded with:

* each actor's ``rng`` and engine -- :func:`actor_seed`, which the driver
  gives the actor as ``ActorSettings.seed`` (``--seed`` of ``vime.actor``):
  the buffer's seeds the prompt order, the trainer's the model init, a
  rollout worker's the draws of sequences that bring no seed of their own
  (an OpenAI-endpoint request: an external agent's turns are not replayed
  either way);
* each response's sampling -- :func:`sampling_seed`, from the run's seed, the
  prompt group, the response's index and, after a tool call, its turn, so
  that which worker generates it, beside which other sequences, and whether
  the worker is the one that started the run or one started by a resume or a
  restart, does not change what it samples: no worker holds sampling state a
  resume would have to restore;
* a benchmark's forced response lengths -- the run's seed and the group
  (``vime.groups.forced_lengths``), for the same reason.

A rollout worker that joins by hand (``python -m vime.actor rollout --join``)
takes its ``--seed`` as given (0 by default).
"""

from __future__ import annotations

import hashlib

# rollout worker i's seed is the run's + this + i: workers draw apart from each other and from the other actors
ROLLOUT_SEED_OFFSET = 1000


def actor_seed(run_seed: int, role: str, index: int = 0) -> int:
    """The seed of an actor of ``role`` (``index``: which rollout worker) in a run seeded ``run_seed``."""
    return run_seed + ROLLOUT_SEED_OFFSET + index if role == "rollout" else run_seed


def sampling_seed(run_seed: int, group_id: int, index: int, turn: int = 0) -> int:
    """The seed of turn ``turn`` (0: the first; n: the one after the n-th round of tool calls) of response
    ``index`` of prompt group ``group_id``: a function of the run's seed and the response alone, so that what
    a response samples does not depend on which other sequences shared its engine's batches (the order
    requests arrive in, other workers, a re-issue), nor on what the worker drew before (a resumed run's
    workers start afresh). An engine drawing for a whole batch from one stream made the same seed give
    different rewards from the first step on; a worker's own stream made a resumed run draw its tool turns
    again as the run's first ones."""
    key = f"{run_seed}:{group_id}:{index}" + (f":{turn}" if turn else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
