"""The two engine interfaces: what a rollout worker and a trainer need.

An actor talks to its engine only through these, so the CPU reference
engines and the GPU ones (vLLM, Megatron-core) are interchangeable.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy
import torch

from vime.backends.hf import checkpoint_names
from vime.config import SamplingParams
from vime.transports.gpu import BroadcastGroup, SharedBuckets, Spec, gpu_uuid, open_shared, unpack

if TYPE_CHECKING:
    from vime.messages.pipeline import Sample


@dataclasses.dataclass
class Sequence:
    """One sequence being generated, and what the engine produced for it."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once finished
    # its tokens reach response_ids as they are generated (a streamed reply); otherwise an engine may
    # hand them over only when the sequence ends, which is cheaper for large batches
    stream: bool = False
    # with routing replay: [prompt + response - 1, moe_layers, top_k] experts of every token fed to the model
    routed_experts: torch.Tensor | None = None
    # seeds this sequence's own sampling draws (vime.seeds.sampling_seed); None: the engine draws from its stream
    seed: int | None = None


class RolloutEngine(abc.ABC):
    """Generates responses step by step, so that weights can change between steps.

    Per-token log-probs are those of the temperature-scaled distribution the
    trainer computes (top-k/top-p truncation shapes sampling, not the reported
    log-prob), and every token carries the weight version that produced it.
    """

    weight_version: int
    vocab_size: int  # token ids a prompt may hold: 0 <= id < vocab_size

    @abc.abstractmethod
    def add(self, sequences: list[Sequence]) -> None:
        """Queue sequences; they join the running batch at the next step."""

    @abc.abstractmethod
    def step(self) -> list[Sequence]:
        """Advance every running sequence by one token; return those that finished. A sequence's tokens may
        reach it only when it finishes, unless it is marked ``stream``."""

    @property
    @abc.abstractmethod
    def busy(self) -> bool:
        """Whether any sequence is queued or running."""

    @abc.abstractmethod
    def abort(self, request_ids: list[int]) -> None:
        """Stop these sequences (unknown or finished ids are ignored); they are never returned by ``step``."""

    @abc.abstractmethod
    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Replace the named weights (a full set) and stamp later tokens with ``version``."""

    # What the GPU weight paths (vime.weights.cuda_ipc, vime.weights.nccl) have the engine load. These defaults
    # serve a single-process engine; an engine whose model lives in other processes (vLLM's workers) overrides them.

    def gpus(self) -> list[str]:
        """UUIDs of the GPUs holding the engine's model, one per rank; empty on CPU. The trainer picks
        the weight path from them (CUDA IPC on its own GPU, a broadcast group across GPUs)."""
        return []

    def load_shared(self, specs: list[Spec], buffers: list[dict[str, Any]], version: int, index: int,
                    last: bool) -> None:
        """Bucket ``index`` of the weights of ``version`` over CUDA IPC: ``buffers`` describe its bytes on each of
        the sender's GPUs (:func:`~vime.transports.gpu.share`), ``specs`` the tensors packed in them
        (:func:`~vime.transports.gpu.unpack`). The engine copies what it needs from the buffer on its own
        GPU before returning (the sender then reuses the memory), and holds ``version`` once the ``last``
        message is in (it may carry no bucket); until then it holds a mix of two versions and must not step."""
        if index == 0:
            self._arriving = (version, {})
        if specs:
            try:
                self._arriving[1].update((name, tensor.clone()) for name, tensor in unpack(open_shared(buffers), specs))
            except BaseException:
                self._arriving = None  # the set comes again, whole, another way
                raise
            torch.cuda.synchronize()
        if last:
            version, tensors = self._arriving
            self._arriving = None
            self.load_weights(tensors, version)

    _arriving: tuple[int, dict[str, torch.Tensor]] | None = None  # load_shared's buckets so far

    def join_broadcast(self, address: str, first_rank: int, world_size: int, device: str | None = None) -> None:
        """Join a sender's :class:`~vime.transports.gpu.BroadcastGroup` on ``device`` ("cuda" or "cpu", as the
        sender's), taking the ranks from ``first_rank`` on."""
        self.broadcast_group = BroadcastGroup(address, first_rank, world_size, device=device)

    def receive_broadcast(self, spec_list: list[Spec], bucket_bytes: int, version: int) -> None:
        """A full set broadcast by the group's sender, in :func:`vime.transports.gpu.specs` order."""
        tensors: dict[str, torch.Tensor] = {}
        for bucket in self.broadcast_group.receive(spec_list, bucket_bytes):
            tensors.update(bucket)
        self.load_weights(tensors, version)

    asleep = False  # whether the engine has given its GPU memory back (see sleep)

    def sleep(self, level: int) -> None:
        """Give the GPU memory back while a colocated trainer uses the GPU, until the next weights arrive."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode: only vLLM's engine sleeps "
                                  "(--rollout-backend vllm --vllm-enable-sleep-mode true)")


@dataclasses.dataclass
class TensorBatch:
    """A padded training batch: prompts and responses of ``samples`` sequences."""

    input_ids: torch.Tensor  # [samples, prompt + response], right-padded
    attention_mask: torch.Tensor  # [samples, prompt + response]
    response_start: torch.Tensor  # [samples]: index of the first response token
    response_mask: torch.Tensor  # [samples, max_response]: 1 on real response tokens
    response_ids: torch.Tensor  # [samples, max_response]
    rollout_logprobs: torch.Tensor  # [samples, max_response]
    versions: torch.Tensor  # [samples, max_response]: weight version that produced each token
    rewards: torch.Tensor  # [samples]
    group_ids: torch.Tensor  # [samples]
    routed_experts: torch.Tensor | None = None  # [samples, prompt + response, moe_layers, top_k]; -1: route freely

    def to(self, device: str | torch.device) -> TensorBatch:
        """A copy on ``device`` (the trainer's): batches are collated on the CPU, wherever the policy lives."""
        return dataclasses.replace(self, **{
            field.name: value.to(device) for field in dataclasses.fields(self)
            if isinstance(value := getattr(self, field.name), torch.Tensor)})


def collate_samples(samples: list[Sample], pad_token_id: int) -> TensorBatch:
    """A step's scored samples as the trainer trains on them: :func:`collate` of their fields."""
    return collate([s.prompt_ids for s in samples], [s.response_ids for s in samples], [s.logprobs for s in samples],
                   [s.versions for s in samples], [s.reward for s in samples], [s.group_id for s in samples],
                   pad_token_id, [s.routed_experts for s in samples], [s.loss_mask for s in samples])


def collate(prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]],
            versions: list[list[int]], rewards: list[float], group_ids: list[int], pad_token_id: int,
            routed_experts: list[torch.Tensor | None] | None = None,
            loss_masks: list[list[int]] | None = None) -> TensorBatch:
    """Pad samples into a TensorBatch (right padding; positions come from the mask). Routed experts,
    when any sample has them, are padded with -1 (free routing) where a sample has none. ``loss_masks``
    (1: a token the model generated; 0: one inserted, like a tool result) keep inserted tokens out of
    the loss and the metrics; without them (or where a sample's is None) every response token is trained on."""
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    response_lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
    filled = _filled(prompt_lengths + response_lengths)  # [samples, width]: True on a sample's own tokens
    answered = _filled(response_lengths)  # [samples, longest]: True on its response tokens
    batch = TensorBatch(
        input_ids=torch.full(filled.shape, pad_token_id, dtype=torch.long),
        attention_mask=filled.long(),
        response_start=prompt_lengths,
        response_mask=answered.float(),
        response_ids=torch.zeros(answered.shape, dtype=torch.long),
        rollout_logprobs=torch.zeros(answered.shape, dtype=torch.float32),
        versions=torch.full(answered.shape, -1, dtype=torch.long),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
    )
    # One tensor per field from the rows end to end, placed through the masks (row-major, as the rows are
    # concatenated): a copy per row and field cost ~0.1 s for TRL's 512 x 600 tokens, on every step.
    batch.input_ids[filled] = _flat(row for pair in zip(prompts, responses) for row in pair)
    responding = filled & (torch.arange(filled.shape[1]) >= prompt_lengths[:, None])  # the response tokens' places
    batch.response_ids[answered] = batch.input_ids[responding]  # already converted once, in input_ids
    batch.rollout_logprobs[answered] = _flat(logprobs, numpy.float32)
    batch.versions[answered] = _flat(versions)
    if loss_masks and any(mask is not None for mask in loss_masks):
        batch.response_mask[answered] = _flat((([1] * len(response) if mask is None else mask)
                                               for mask, response in zip(loss_masks, responses)), numpy.float32)
    recorded = [experts for experts in routed_experts or () if experts is not None]
    if recorded:
        batch.routed_experts = torch.full((*filled.shape, *recorded[0].shape[1:]), -1, dtype=torch.int16)
        for row, experts in enumerate(routed_experts):
            if experts is not None:
                batch.routed_experts[row, :experts.shape[0]] = experts
    return batch


def _filled(lengths: torch.Tensor) -> torch.Tensor:
    """[rows, longest] booleans, True on the first ``lengths[row]`` places of each row."""
    return torch.arange(int(lengths.max())) < lengths[:, None]


def _flat(rows: Iterable[list[Any]], dtype: type = numpy.int64) -> torch.Tensor:
    """The rows end to end, as one 1-D tensor of ``dtype`` (numpy's ``fromiter``: six times torch.tensor's speed
    on a list of Python ints)."""
    return torch.from_numpy(numpy.fromiter(itertools.chain.from_iterable(rows), dtype))


class TrainEngine(abc.ABC):
    """Holds the policy (and a value model or reference when the algorithm needs one) and steps it."""

    weight_version: int
    device: str  # where the policy lives ("cpu", "cuda"): it decides which weight paths reach the rollout

    @abc.abstractmethod
    def train_step(self, batch: TensorBatch) -> dict[str, Any]:
        """One training step on ``batch``: recompute log-probs, loss, update. Returns metrics."""

    @abc.abstractmethod
    def named_weights(self, device: str | None = None) -> dict[str, torch.Tensor]:
        """The policy's live weights as the rollout engines name them (not a copy: copy
        before another thread may step the optimizer), on ``device`` (None: the policy's; a
        copy only where they move)."""

    @abc.abstractmethod
    def save_hf(self, folder: Path) -> None:
        """The policy as a Hugging Face model folder (config and safetensors) in ``folder``."""

    @abc.abstractmethod
    def save(self, folder: Path) -> None:
        """Everything training needs to continue: the policy as a Hugging Face folder in
        ``folder/model``, and the optimizer, schedule, value model, version and RNG."""

    @abc.abstractmethod
    def load(self, folder: Path) -> None:
        """Continue from what :meth:`save` wrote (the engine was built from the original model)."""

    def rollout_weights(self, dtype: torch.dtype, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights as rollout engines load them, one tensor at a time: checkpoint names, ``dtype``, on
        ``device`` (None: the policy's; views of the live weights where nothing converts them: use them before
        training goes on). Under tensor parallelism every rank takes them (each tensor is gathered whole)."""
        for name, tensor in checkpoint_names(self.named_weights(device)).items():
            yield name, tensor.to(dtype)

    def shared_buckets(self, bucket_bytes: int,
                       dtype: torch.dtype) -> Iterator[tuple[list[Spec], list[dict[str, Any]]]]:
        """:meth:`rollout_weights` packed into buckets of about ``bucket_bytes`` on the policy's GPU(s), each
        offered over CUDA IPC: its specs, and a descriptor of the buffer holding it on every GPU of the
        engine. A consumer is done with a bucket when it asks for the next (the buffer is reused, for the
        next bucket and the next version: :class:`~vime.transports.gpu.SharedBuckets`); one that stops early
        must close the iterator."""
        if self._offered is None:
            self._offered = SharedBuckets()
        for specs, descriptor in self._offered.offer(self.rollout_weights(dtype), bucket_bytes):
            yield specs, [descriptor]

    _offered: SharedBuckets | None = None  # the buffer shared_buckets offers, kept for the run

    def gpus(self) -> list[str]:
        """UUIDs of the GPUs the policy trains on, one per rank; empty on CPU. Rollout engines placed on them
        take the weights over CUDA IPC, and sleep while a step trains."""
        device = torch.device(self.device)
        return [gpu_uuid(device.index)] if device.type == "cuda" else []

    def release_memory(self) -> None:
        """Hand what the GPU's caching allocator keeps back to the device (every rank), for colocated engines
        about to wake."""
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Release what the engine holds outside this process (tensor-parallel ranks); nothing by default."""
