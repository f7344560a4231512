"""The RL pipeline's message kinds: prompts becoming scored samples becoming batches, who sends what to whom.

The flow (see DESIGN.md)::

    buffer --GenerateGroup--> router --GenerateGroup--> rollout --RolloutGroup--> reward --ScoredGroup--> buffer
    trainer --WantBatch--> buffer --TrainBatch--> trainer --WeightsPublished--> buffer
    rollout --WorkerReady--> router (once it holds the trainer's weights)   rollout --GroupDone--> router
    rollout --WorkerLeaving--> router (when told to stop)
    trainer --SnapshotQuery--> buffer --BufferState--> trainer (at a checkpoint)
    buffer --EvalResult--> trainer (once every eval group of a weight version is scored)
    anyone --InjectPrompts--> buffer --Injected--> asker

A worker's ask for its weights (WantWeights) and the weights themselves are ``vime.weights``' kinds; GPU
turn-taking's (build turns, sleep) are in ``vime.messages.gpu_turns``.

Token ids, log-probs and versions travel as lists: msgpack keeps float64, so
fp32 log-probs arrive bit-exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vime.transports.records import message

if TYPE_CHECKING:  # the schema reads Sample.routed_experts without torch (vime.transports.records)
    import torch


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
    prompt_text: str = ""  # prompt_ids decoded, special tokens kept: slime's sample.prompt (--custom-rm-path)
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
    """rollout worker -> router, once it holds the weights the trainer said were coming (WeightsComing): give me
    work. Said again by a restarted worker under the same name."""

    capacity: int  # groups it takes at once
    weight_version: int


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
    # the wall clock (time.time()) at its last token, from which the buffer spans a batch's generation; None in
    # a message log or checkpoint written before it was sent
    finished_at: float | None = None


@message
class ScoredGroup:
    """reward -> buffer: the group with a reward on every sample."""

    group_id: int
    samples: list[Sample]
    worker: str
    generate_s: float
    reward_s: float
    reward_timeouts: int = 0  # samples scored 0 because their reward call ran past --reward-timeout
    finished_at: float | None = None  # as RolloutGroup's; None too after a resume (the span restarts)


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
class WeightsPublished:
    """trainer -> buffer, after every optimizer step: version ``version`` is on its way to every rollout worker
    (the buffer's staleness bound moves with it)."""

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
