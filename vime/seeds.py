"""Every seed of a run comes from its one ``--seed`` (``JobConfig.seed``), here.

What each random stream of a training run is seeded with:

* each actor's ``rng`` and engine -- :func:`actor_seed`, which the driver
  gives the actor as ``ActorSettings.seed`` (``--seed`` of ``vime.actor``):
  the buffer's seeds the prompt order, the trainer's the model init, a
  rollout worker's the draws of sequences that bring no seed of their own
  (a tool call's next turn, an OpenAI-endpoint request);
* each response's sampling -- :func:`sampling_seed`, from the run's seed, the
  prompt group and the response's index, so that which worker generates it,
  and beside which other sequences, does not change what it samples;
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


def sampling_seed(run_seed: int, group_id: int, index: int) -> int:
    """The seed of response ``index`` of prompt group ``group_id``: a function of the run's seed and the
    response alone, so that what a response samples does not depend on which other sequences shared its
    engine's batches (the order requests arrive in, other workers, a re-issue). An engine drawing for a whole
    batch from one stream made the same seed give different rewards from the first step on."""
    digest = hashlib.blake2b(f"{run_seed}:{group_id}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
