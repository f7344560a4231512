"""GPU turn-taking's message kinds: a colocated rollout engine and the trainer sharing GPUs, who sends what.

The flow::

    driver --EnginesStarted--> trainer (once the rollout workers it starts have built their engines)
    rollout --MayBuildEngine--> trainer --BuildTurn--> rollout (with --colocate, before it builds its engine)
    trainer --SleepEngine--> a colocated rollout worker --EngineAsleep--> trainer (before training, with sleep mode)

The timing constants are part of the exchange: both sides read them.
"""

from __future__ import annotations

from vime.transports.records import message


@message
class SleepEngine:
    """trainer -> a rollout worker on the trainer's GPU (ask, answered with EngineAsleep), before each training
    step when vLLM's sleep mode is on: finish the running responses, start no new ones, and give the engine's GPU
    memory back (vLLM sleep ``level``); the next weights wake it. Not if the engine already holds weights newer
    than ``version`` (the trainer's newest when it asked): they came after the trainer stopped waiting."""

    level: int
    version: int


@message
class EngineAsleep:
    """rollout worker -> trainer: the engine sleeps; finishing its running responses took ``drain_s``."""

    drain_s: float


@message
class EnginesStarted:
    """driver -> trainer: every rollout worker the driver starts has built its engine or is gone for good. With
    ``--colocate`` the trainer starts training only then: a vLLM engine sizes its KV cache from the GPU memory it
    sees in use while it profiles, which a training step on the same GPU would change under it. A worker
    restarted later waits for its turn instead (MayBuildEngine)."""


ENGINE_BUILD_S = 1800.0  # the longest anyone waits for one rollout worker to build its engine
BUILD_TURN_RETRY_S = 0.5  # a refused worker asks for its turn again this often
# how long a worker waits for the answer: the trainer answers once its own engine is built, which takes
# minutes for a large checkpoint or ranks on other hosts (it fails at once if the trainer dies: PeerGone)
BUILD_TURN_ASK_S = 1800.0
BUILD_TURN_KEPT_S = 30.0  # a refused worker's place is kept this long after it last asked


@message
class MayBuildEngine:
    """rollout worker -> trainer (ask, answered with BuildTurn), with ``--colocate``, before it builds its engine
    (at start and after every restart), saying where: vLLM sizes its KV cache from the GPU memory it sees in use
    while it profiles, so it must not profile beside a training step or another engine's profile. Refused while
    the trainer's GPU is busy, the worker keeps its place: the next step waits until it, asking again every
    ``BUILD_TURN_RETRY_S``, has been let build and has asked for its weights (WantWeights; or is gone, or
    ``ENGINE_BUILD_S`` has passed). A worker on another host or other GPUs builds at once."""

    host: str
    gpus: list[str]  # CUDA_VISIBLE_DEVICES as the worker sees it (all of the host's when unset)


@message
class BuildTurn:
    """trainer -> rollout worker: build now (``granted``), or ask again in ``BUILD_TURN_RETRY_S``."""

    granted: bool
