"""A rollout worker: an inference engine fed with groups, fed with weights.

Generation runs in a loop beside the message handlers: between two engine
steps the worker applies the newest complete set of weights, admits the
groups whose ``min_weight_version`` it now holds, and sends each finished
group to the reward actor (and tells the router it is done). Weights arrive
from the trainer in chunks; a version is applied only once all of its
chunks are in, and a newer complete version supersedes an older one.

The engine runs in a worker thread, one step at a time, so the actor keeps
answering messages (status, weights, new groups) while it generates.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import trio

from vime.backends.base import SamplingParams, Sequence
from vime.backends.hf import load_tokenizer
from vime.backends.torch_rollout import TorchRolloutEngine
from vime.config import RunConfig
from vime.protocol import GenerateGroup, GroupDone, RolloutGroup, Sample, WeightsChunk, WorkerReady
from vime.runtime import Actor, ActorSettings, handles
from vime.transports.codec import Envelope


class _Group:
    """A group being generated: its request, its sequences, when it started."""

    def __init__(self, request: GenerateGroup, sequences: list[Sequence], started: float) -> None:
        self.request = request
        self.sequences = sequences
        self.started = started
        self.unfinished = len(sequences)


class RolloutWorker(Actor):
    role = "rollout"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.run = RunConfig.from_dict(self.config)
        self.engine = TorchRolloutEngine(self.run.model.model_path, dtype=self.run.model.dtype,
                                         max_batch_size=self.run.rollout.rollout_max_batch_size, seed=settings.seed)
        self.tokenizer = load_tokenizer(self.run.model.model_path)
        self.waiting: list[GenerateGroup] = []  # for newer weights, or for the engine
        self.groups: dict[int, _Group] = {}
        self.by_request: dict[int, _Group] = {}  # engine request id -> its group
        self.next_request = 0
        self.chunks: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # version -> index -> tensors
        self.complete: tuple[int, dict[str, torch.Tensor]] | None = None  # newest full set not yet applied
        self.wake = trio.Event()

    async def on_start(self) -> None:
        ready = WorkerReady(capacity=self.run.rollout.rollout_capacity, weight_version=self.engine.weight_version)
        await self.tell("trainer", ready)
        await self.tell("router", ready)
        self.start_soon(self._generate_loop)

    @handles(GenerateGroup)
    async def _on_group(self, msg: GenerateGroup, envelope: Envelope) -> None:
        self.waiting.append(msg)
        self.wake.set()

    @handles(WeightsChunk)
    async def _on_weights(self, msg: WeightsChunk, envelope: Envelope) -> None:
        if msg.version <= self.engine.weight_version:
            return
        parts = self.chunks.setdefault(msg.version, {})
        parts[msg.index] = msg.tensors
        if len(parts) == msg.count:
            merged = {name: tensor for index in sorted(parts) for name, tensor in parts[index].items()}
            self.chunks = {v: p for v, p in self.chunks.items() if v > msg.version}
            if self.complete is None or self.complete[0] < msg.version:
                self.complete = (msg.version, merged)
            self.wake.set()

    async def _generate_loop(self) -> None:
        while True:
            self._apply_weights()
            self._admit()
            if not self.engine.busy:
                await self.wake.wait()
                self.wake = trio.Event()
                continue
            finished = await trio.to_thread.run_sync(self.engine.step)
            for sequence in finished:
                await self._finish(sequence)

    def _apply_weights(self) -> None:
        if self.complete is None:
            return
        version, tensors = self.complete
        self.complete = None
        self.engine.load_weights(tensors, version)
        self.counters["weight_updates"] += 1
        self.log.debug("weights applied", weight_version=version)

    def _admit(self) -> None:
        """Start the waiting groups whose weight version the engine now holds."""
        ready = [g for g in self.waiting if g.min_weight_version <= self.engine.weight_version]
        if not ready:
            return
        self.waiting = [g for g in self.waiting if g.min_weight_version > self.engine.weight_version]
        now = time.monotonic()
        for request in ready:
            params = SamplingParams(**{**request.sampling, "stop_token_ids": tuple(request.sampling.get(
                "stop_token_ids", ()))})
            sequences = []
            for _ in range(request.group_size):
                sequences.append(Sequence(self.next_request, list(request.prompt_ids), params))
                self.next_request += 1
            group = self.groups[request.group_id] = _Group(request, sequences, now)
            for sequence in sequences:
                self.by_request[sequence.request_id] = group
            self.engine.add(sequences)

    async def _finish(self, sequence: Sequence) -> None:
        group = self.by_request.pop(sequence.request_id)
        group.unfinished -= 1
        if group.unfinished:
            return
        request = group.request
        del self.groups[request.group_id]
        samples = [Sample(group_id=request.group_id, index=index, prompt_ids=request.prompt_ids,
                          response_ids=s.response_ids, logprobs=s.logprobs, versions=s.versions,
                          finish_reason=s.finish_reason or "length", label=request.label, metadata=request.metadata,
                          response_text=self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
                   for index, s in enumerate(group.sequences)]
        self.counters["groups"] += 1
        self.counters["tokens"] += sum(len(s.response_ids) for s in samples)
        await self.tell("reward", RolloutGroup(group_id=request.group_id, samples=samples, worker=self.name,
                                               generate_s=time.monotonic() - group.started))
        await self.tell("router", GroupDone(group_id=request.group_id))
