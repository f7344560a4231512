"""The buffer: prompts out, scored groups in, training batches out.

It owns the prompt source (seeded epochs), prompts injected from outside
(InjectPrompts, ``python -m vime.inject``), the custom-rollout hook, and
every finished group until it is trained. It enforces the staleness bound
on both ends:

* issuing: groups for batch ``b`` are issued only once the trainer has
  published version ``b - k`` (k = ``max_staleness``), and they ask the
  rollout side for at least that version;
* batching: a group whose oldest token version is below ``step - k`` when
  its batch forms is dropped and counted (``dropped_stale``), and a new
  prompt replaces it.

With dynamic sampling on, a group whose rewards are all equal is dropped
(``dropped_filtered``) and replaced too. Everything here is driven by
messages and the message clock, so ``vime.replay`` can re-drive it.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

from vime.algorithms.dynamic_sampling import is_informative
from vime.backends.base import SamplingParams
from vime.backends.hf import load_tokenizer
from vime.config import RunConfig
from vime.data import PromptSource, check_row, load_rows
from vime.plugins import import_function
from vime.protocol import GenerateGroup, InjectPrompts, Injected, ScoredGroup, TrainBatch, WantBatch, WeightsPublished
from vime.messages import Status
from vime.runtime import Actor, ActorSettings, handles
from vime.transports.codec import Envelope


class Buffer(Actor):
    role = "buffer"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.run = RunConfig.from_dict(self.config)
        data = self.run.data
        self.tokenizer = load_tokenizer(self.run.model.model_path)
        self.source = PromptSource(load_rows(data.data, data.custom_data_source), seed=settings.seed,
                                   epochs=data.epochs)
        self.custom_rollout = import_function(data.custom_rollout, "--custom-rollout") if data.custom_rollout else None
        self.injected: collections.deque[dict[str, Any]] = collections.deque()
        self.trainer_version = 0
        self.next_group_id = 0
        self.in_flight: dict[int, float] = {}  # group id -> issue time
        self.ready: collections.deque[tuple[int, ScoredGroup]] = collections.deque()  # (weight version, group)
        self.trained_groups = 0
        self.wanted_step: int | None = None
        self.exhausted = False

    async def on_start(self) -> None:
        await self._issue()

    def status(self) -> Status:
        status = super().status()
        status.counters.update(in_flight=len(self.in_flight), ready=len(self.ready))
        return status

    # ------------------------------------------------------------- handlers

    @handles(WeightsPublished)
    async def _on_weights(self, msg: WeightsPublished, envelope: Envelope) -> None:
        self.trainer_version = max(self.trainer_version, msg.version)
        await self._issue()

    @handles(ScoredGroup)
    async def _on_scored(self, msg: ScoredGroup, envelope: Envelope) -> None:
        if self.in_flight.pop(msg.group_id, None) is None:
            self.counters["duplicates"] += 1
            return
        self.counters["scored"] += 1
        if self.run.data.dynamic_sampling and not is_informative([s.reward for s in msg.samples]):
            self.counters["dropped_filtered"] += 1
        else:
            self.ready.append((_version(msg), msg))
        await self._send_batch()
        await self._issue()

    @handles(WantBatch)
    async def _on_want(self, msg: WantBatch, envelope: Envelope) -> None:
        self.wanted_step = msg.step
        await self._send_batch()
        await self._issue()

    @handles(InjectPrompts)
    async def _on_inject(self, msg: InjectPrompts, envelope: Envelope) -> Injected:
        rows = [check_row(row, f"InjectPrompts[{i}]") for i, row in enumerate(msg.prompts)]
        self.injected.extend(rows)
        self.counters["injected"] += len(rows)
        await self._issue()
        return Injected(accepted=len(rows), waiting=len(self.injected))

    # ---------------------------------------------------------------- issue

    def _committed(self) -> int:
        """Groups that will make up batches: trained, ready, or being generated."""
        return self.trained_groups + len(self.ready) + len(self.in_flight)

    async def _issue(self) -> None:
        """Issue prompts until the staleness bound allows no more groups."""
        batch_size, bound = self.run.data.rollout_batch_size, self.run.data.max_staleness
        while self._committed() < (self.trainer_version + bound + 1) * batch_size:
            row = self._next_row()
            if row is None:
                return
            batch_index = self._committed() // batch_size
            await self._issue_group(row, min_weight_version=max(0, batch_index - bound))

    def _next_row(self) -> dict[str, Any] | None:
        while True:
            row = self.injected.popleft() if self.injected else self.source.next()
            if row is None:
                if not self.exhausted:
                    self.exhausted = True
                    self.log.warning("the prompt source is exhausted", epochs=self.source.epochs)
                return None
            if self.custom_rollout is not None:
                row = self.custom_rollout(dict(row))
                if row is None:
                    self.counters["skipped_by_hook"] += 1
                    continue
                check_row(row, self.run.data.custom_rollout)
                try:
                    SamplingParams(**{**_sampling_dict(self.run), **row.get("sampling", {})})
                except (TypeError, ValueError) as err:
                    self.counters["bad_rows"] += 1
                    self.log.error("custom rollout hook returned bad sampling settings; row skipped",
                                   hook=self.run.data.custom_rollout, error=str(err))
                    continue
            return row

    async def _issue_group(self, row: dict[str, Any], min_weight_version: int) -> None:
        group_id = self.next_group_id
        self.next_group_id += 1
        metadata = {k: v for k, v in row.items() if k not in ("prompt", "label", "sampling", "group_size")}
        sampling = {**_sampling_dict(self.run), **row.get("sampling", {})}
        request = GenerateGroup(group_id=group_id, prompt_ids=list(self.tokenizer(row["prompt"])["input_ids"]),
                                label=str(row["label"]), metadata=metadata,
                                group_size=int(row.get("group_size", self.run.data.group_size)),
                                min_weight_version=min_weight_version, sampling=sampling)
        self.in_flight[group_id] = self.now()
        self.counters["issued"] += 1
        await self.tell("router", request)

    # ---------------------------------------------------------------- batch

    async def _send_batch(self) -> None:
        """Send the wanted batch once enough fresh groups are ready."""
        step, batch_size = self.wanted_step, self.run.data.rollout_batch_size
        if step is None or len(self.ready) < batch_size:
            return
        oldest_allowed = step - self.run.data.max_staleness
        fresh = collections.deque(item for item in self.ready if item[0] >= oldest_allowed)
        self.counters["dropped_stale"] += len(self.ready) - len(fresh)
        self.ready = fresh
        if len(self.ready) < batch_size:
            return
        groups = [self.ready.popleft()[1] for _ in range(batch_size)]
        self.trained_groups += batch_size
        self.wanted_step = None
        samples = [s for g in groups for s in g.samples]
        staleness = [step - s.weight_version for s in samples]
        stats = {
            "staleness_mean": statistics.fmean(staleness),
            "staleness_max": float(max(staleness)),
            "time_generate_s": max(g.generate_s for g in groups),
            "time_reward_s": sum(g.reward_s for g in groups),
            "dropped_stale": float(self.counters["dropped_stale"]),
            "dropped_filtered": float(self.counters["dropped_filtered"]),
            "epoch": float(self.source.epoch),
        }
        self.counters["trained"] += batch_size
        await self.tell("trainer", TrainBatch(step=step, samples=samples, stats=stats))


def _version(group: ScoredGroup) -> int:
    """A group is as old as its oldest sample."""
    return min(sample.weight_version for sample in group.samples)


def _sampling_dict(run: RunConfig) -> dict[str, Any]:
    sampling = run.sampling
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids)}

