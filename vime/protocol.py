"""The RL pipeline's message kinds: who sends what to whom, and when.

The flow (see DESIGN.md)::

    buffer --GenerateGroup--> router --GenerateGroup--> rollout --RolloutGroup--> reward --ScoredGroup--> buffer
    trainer --WantBatch--> buffer --TrainBatch--> trainer --(weights, by their path: vime.weights)--> rollout
    trainer --WeightsPublished--> buffer          rollout --GroupDone--> router
    trainer --SnapshotQuery--> buffer --BufferState--> trainer (at a checkpoint)
    trainer --SleepEngine--> a colocated rollout worker --EngineAsleep--> trainer (before training, with sleep mode)
    buffer --EvalResult--> trainer (once every eval group of a weight version is scored)
    driver --EnginesStarted--> trainer (once the rollout workers it starts have built their engines)
    rollout --MayBuildEngine--> trainer --BuildTurn--> rollout (with --colocate, before it builds its engine)

Token ids, log-probs and versions travel as lists: msgpack keeps float64, so
fp32 log-probs arrive bit-exact.
"""

from __future__ import annotations

from typing import Any

import torch

from vime.transports.records import message


@message(kind_name=False)
class Sample:
    """One response to one prompt, from rollout through reward to the trainer."""

    group_id: int
    index: int  # within its group
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # rollout log-prob of each response token (temperature applied); 0 on inserted ones
    versions: list[int]  # weight version that produced each response token; -1 on inserted ones
    finish_reason: str  # "stop" or "length"
    label: str
    metadata: dict[str, Any]
    response_text: str = ""
    reward: float | None = None
    routed_experts: torch.Tensor | None = None  # routing replay: [prompt + response - 1, moe_layers, top_k] int16
    loss_mask: list[int] | None = None  # with tools: 1 on generated tokens, 0 on inserted tool messages

    @property
    def generated_versions(self) -> list[int]:
        """The versions of the tokens the model generated (inserted tokens have none)."""
        return [v for v in self.versions if v >= 0]

    @property
    def weight_version(self) -> int:
        """The oldest version that produced any of its tokens: what staleness is measured from."""
        return min(self.generated_versions, default=-1)


@message
class GenerateGroup:
    """buffer -> router -> a rollout worker: sample ``group_size`` responses to one prompt.

    The worker starts only once it holds weights of ``min_weight_version`` or
    newer: that is how the staleness bound reaches the rollout side.
    """

    group_id: int
    prompt_ids: list[int]
    messages: list[dict[str, Any]]  # the conversation prompt_ids render (an external agent starts from it)
    label: str
    metadata: dict[str, Any]
    group_size: int
    min_weight_version: int
    sampling: dict[str, Any]


@message
class WorkerReady:
    """rollout worker -> trainer (ask, answered with the WeightsPublished it is being sent),
    then -> router once it holds those weights: give me work."""

    capacity: int  # groups it takes at once
    weight_version: int
    gpus: list[str]  # UUIDs of its engine's GPUs; empty on CPU


@message
class WorkerLeaving:
    """rollout worker -> router, when told to stop (SIGTERM): these groups are handed back unfinished."""

    group_ids: list[int]


@message
class GroupDone:
    """rollout worker -> router: a group is finished (its samples went to reward)."""

    group_id: int


@message
class RolloutGroup:
    """rollout worker -> reward: a finished group, not yet scored."""

    group_id: int
    samples: list[Sample]
    worker: str
    generate_s: float  # wall time from the group's start to its last token


@message
class ScoredGroup:
    """reward -> buffer: the group with a reward on every sample."""

    group_id: int
    samples: list[Sample]
    worker: str
    generate_s: float
    reward_s: float


@message
class WantBatch:
    """trainer -> buffer: send the batch for ``step`` as soon as it is complete."""

    step: int


@message
class TrainBatch:
    """buffer -> trainer: the samples of one step, whole groups, and how they were gathered."""

    step: int
    samples: list[Sample]
    stats: dict[str, float]


@message
class EvalResult:
    """buffer -> trainer: the scores of weight version ``version`` on the held-out prompts (``eval/*`` metrics)."""

    version: int
    metrics: dict[str, float]


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


@message
class MayBuildEngine:
    """rollout worker -> trainer (ask, answered with BuildTurn), with ``--colocate``, before it builds its engine
    (at start and after every restart), saying where: vLLM sizes its KV cache from the GPU memory it sees in use
    while it profiles, so it must not profile beside a training step or another engine's profile. Refused while
    the trainer's GPU is busy, the worker keeps its place: the next step waits until it, asking again every
    ``BUILD_TURN_RETRY_S``, has been let build and has said WorkerReady (or is gone, or ``ENGINE_BUILD_S`` has
    passed). A worker on another host or other GPUs builds at once."""

    host: str
    gpus: list[str]  # CUDA_VISIBLE_DEVICES as the worker sees it (all of the host's when unset)


@message
class BuildTurn:
    """trainer -> rollout worker: build now (``granted``), or ask again in ``BUILD_TURN_RETRY_S``."""

    granted: bool


@message
class WeightsPublished:
    """trainer -> buffer: version ``version`` is on its way to every rollout worker
    (and trainer -> a worker that said WorkerReady: the version it is being sent)."""

    version: int


@message
class InjectPrompts:
    """anyone -> buffer (ask): prompts to issue before the source's next ones; answered with Injected.

    Each prompt is a map with ``prompt`` (text) and ``label``; other keys
    travel as metadata to the reward function.
    """

    prompts: list[dict[str, Any]]


@message
class Injected:
    """buffer -> asker: how many prompts were accepted, and how many wait to be issued."""

    accepted: int
    waiting: int


@message
class SnapshotQuery:
    """trainer -> buffer (ask), right after publishing version ``step``: your state, for a checkpoint."""

    step: int


@message
class BufferState:
    """buffer -> trainer: everything needed to continue after a crash with no prompt lost or repeated.

    Groups in flight travel as their requests (re-issued on resume); finished
    groups waiting for a batch travel whole.
    """

    batches_sent: int
    trainer_version: int
    next_group_id: int
    source_epoch: int
    source_index: int
    injected: list[dict[str, Any]]
    in_flight: list[GenerateGroup]
    ready: list[ScoredGroup]
    counters: dict[str, int]
