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

At a checkpoint the trainer asks for the buffer's whole state (SnapshotQuery);
started from a checkpoint, the buffer takes that state back and re-issues
the groups that were in flight, under their own ids (``resumed_in_flight``).

Evaluation (``--eval-data``, ``--eval-every``): when a version to evaluate
is published (and at the start, for version 0), the buffer issues one group
of ``--eval-samples`` responses per held-out prompt, ahead of the training
groups issued with it, asking for at least that version, with the eval
sampling settings. Eval groups share the id sequence but nothing else: they
never enter a batch, the counters or a checkpoint. Once all of a version's
groups are scored, the trainer gets their ``eval/*`` metrics (EvalResult).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Any

from vime import checkpoint
from vime.agent.tools import Toolbox
from vime.algorithms.dynamic_sampling import is_informative
from vime.backends.base import SamplingParams
from vime.backends.hf import load_tokenizer, stop_token_ids
from vime.config import ActorStart
from vime.data import PromptSource, check_row, load_rows, prompt_ids, prompt_messages
from vime.evaluation import eval_metrics, eval_rows
from vime.messages.pipeline import (
    BufferState,
    EvalResult,
    GenerateGroup,
    Injected,
    InjectPrompts,
    Sample,
    ScoredGroup,
    SnapshotQuery,
    TrainBatch,
    WantBatch,
    WeightsPublished,
)
from vime.messages.runtime import Status
from vime.plugins import import_function
from vime.runtime import Actor, ActorSettings, handles
from vime.transports.codec import Envelope


class Buffer(Actor):
    role = "buffer"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        start = ActorStart.from_dict(self.config)
        self.run, self.resume_from = start.run, start.resume_from
        data = self.run.data
        self.tokenizer = load_tokenizer(self.run.model.model_path)
        self.tool_schemas = Toolbox(self.run.agent.tool).schemas if self.run.agent.tool else None
        self.source = PromptSource(load_rows(data.data, data.custom_data_source, input_key=data.input_key,
                                             label_key=data.label_key), seed=settings.seed,
                                   epochs=data.epochs)
        sampling = dataclasses.asdict(self.run.sampling)
        if not sampling["stop_token_ids"]:  # a real model stops at its EOS
            sampling["stop_token_ids"] = stop_token_ids(self.run.model.model_path, self.tokenizer)
        self._sampling = {**sampling, "stop_token_ids": list(sampling["stop_token_ids"])}
        self.eval_rows = eval_rows(self.run)
        self.eval_prompt_ids = [self._prompt_ids(row) for row in self.eval_rows]  # every round asks the same
        self.eval_versions = set(self.run.eval.versions(self.run.job.steps))
        self._eval_sampling = {**dataclasses.asdict(self.run.eval.sampling(self.run.sampling)),
                               "stop_token_ids": self._sampling["stop_token_ids"]}
        self.eval_rounds: dict[int, dict[int, list[Sample]]] = {}  # version -> eval group id -> scored samples
        self.eval_version_of: dict[int, int] = {}  # eval group id -> the version it evaluates
        self.custom_rollout = import_function(data.custom_rollout, "--custom-rollout") if data.custom_rollout else None
        self.injected: collections.deque[dict[str, Any]] = collections.deque()
        self.trainer_version = 0
        self.next_group_id = 0
        self.in_flight: dict[int, GenerateGroup] = {}  # issued and not yet scored
        self.ready: collections.deque[tuple[int, ScoredGroup]] = collections.deque()  # (weight version, group)
        self.trained_groups = 0
        self.filtered_in_a_row = 0  # groups dynamic sampling dropped since it last kept one
        self.wanted_step: int | None = None
        self.exhausted = False

    async def on_start(self) -> None:
        if self.resume_from is not None:
            self._restore(checkpoint.read_record(self.resume_from / "buffer.vmsg", BufferState))
            for request in list(self.in_flight.values()):
                await self.tell("router", request)
        elif 0 in self.eval_versions:
            await self._issue_eval(0)
        await self._issue()

    def _restore(self, state: BufferState) -> None:
        self.trained_groups = state.batches_sent * self.run.data.rollout_batch_size
        self.trainer_version = state.trainer_version
        self.next_group_id = state.next_group_id
        self.source.seek(state.source_epoch, state.source_index)
        self.injected.extend(state.injected)
        self.in_flight = {request.group_id: request for request in state.in_flight}
        # a kept group's finish time is from before the restart: spanning the downtime would say nothing
        self.ready.extend((_version(group), dataclasses.replace(group, finished_at=None)) for group in state.ready)
        self.counters.update(state.counters)
        self.counters["resumed_in_flight"] += len(state.in_flight)
        self.log.info("resumed", batches_sent=state.batches_sent, in_flight=len(state.in_flight),
                      ready=len(state.ready))

    def status(self) -> Status:
        status = super().status()
        status.counters.update(in_flight=len(self.in_flight), ready=len(self.ready))
        return status

    # ------------------------------------------------------------- handlers

    @handles(WeightsPublished)
    async def _on_weights(self, msg: WeightsPublished, envelope: Envelope) -> None:
        if msg.version > self.trainer_version and msg.version in self.eval_versions:
            await self._issue_eval(msg.version)
        self.trainer_version = max(self.trainer_version, msg.version)
        await self._issue()

    @handles(ScoredGroup)
    async def _on_scored(self, msg: ScoredGroup, envelope: Envelope) -> None:
        if msg.group_id in self.eval_version_of:
            await self._on_eval_scored(msg)
            return
        if self.in_flight.pop(msg.group_id, None) is None:
            self.counters["duplicates"] += 1
            return
        self.counters["scored"] += 1
        if self.run.data.dynamic_sampling and not is_informative([s.reward for s in msg.samples]):
            self.counters["dropped_filtered"] += 1
            self.filtered_in_a_row += 1
            self._check_patience()
        else:
            self.filtered_in_a_row = 0
            self.ready.append((_version(msg), msg))
        await self._send_batch()
        await self._issue()

    def _check_patience(self) -> None:
        """Stop a run that dynamic sampling would keep drawing prompts for without end."""
        data = self.run.data
        limit = data.dynamic_sampling_patience * data.rollout_batch_size
        if self.filtered_in_a_row >= limit:
            self.crash(RuntimeError(
                f"dynamic sampling dropped {self.filtered_in_a_row} groups in a row: every response of each got "
                "the same reward (all wrong, for a model that solves none of these prompts). Pass "
                "--no-dynamic-sampling, easier data, or a larger --dynamic-sampling-patience"))

    @handles(WantBatch)
    async def _on_want(self, msg: WantBatch, envelope: Envelope) -> None:
        self.wanted_step = msg.step
        await self._send_batch()
        await self._issue()

    @handles(SnapshotQuery)
    async def _on_snapshot(self, msg: SnapshotQuery, envelope: Envelope) -> BufferState:
        batches_sent = self.trained_groups // self.run.data.rollout_batch_size
        if batches_sent != msg.step:
            raise RuntimeError(f"snapshot for step {msg.step} asked after {batches_sent} batches were sent")
        counters = {key: value for key, value in self.counters.items() if key in _KEPT_COUNTERS}
        return BufferState(batches_sent=batches_sent, trainer_version=self.trainer_version,
                           next_group_id=self.next_group_id, source_epoch=self.source.epoch,
                           source_index=self.source.index, injected=list(self.injected),
                           in_flight=list(self.in_flight.values()), ready=[group for _, group in self.ready],
                           counters=counters)

    @handles(InjectPrompts)
    async def _on_inject(self, msg: InjectPrompts, envelope: Envelope) -> Injected:
        for index, row in enumerate(msg.prompts):  # all or nothing: a refused batch leaves no trace
            self._check(row, f"InjectPrompts.prompts[{index}]")
        rows = list(msg.prompts)
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
        """The next row to issue: injected ones first, then the source (through the hook)."""
        while True:
            if self.injected:
                return self.injected.popleft()  # checked when they were accepted
            row = self.source.next()
            if row is None:
                self._source_exhausted()
                return None
            if self.custom_rollout is not None:
                row = self.custom_rollout(dict(row))
                if row is None:
                    self.counters["skipped_by_hook"] += 1
                    continue
            try:
                self._check(row, self.run.data.custom_rollout or "the prompt source")
            except ValueError as err:
                self.counters["bad_rows"] += 1
                self.log.error("prompt row skipped", error=str(err))
                continue
            return row

    def _check(self, row: dict[str, Any], where: str) -> None:
        """Refuse a row the rollout side could not serve, before it is issued."""
        check_row(row, where)
        group_size = row.get("group_size", self.run.data.group_size)
        if type(group_size) is not int or group_size < 1:
            raise ValueError(f"{where}: group_size must be an int >= 1, got {group_size!r}")
        overrides = row.get("sampling", {})
        if not isinstance(overrides, dict):
            raise ValueError(f"{where}: sampling must be a map of SamplingParams fields, got {overrides!r}")
        if overrides.get("temperature", self.run.sampling.temperature) != self.run.sampling.temperature:
            raise ValueError(f"{where}: a row may not change the temperature (the trainer computes log-probs "
                             f"at --temperature {self.run.sampling.temperature}); change --temperature instead")
        try:
            SamplingParams.from_dict({**self._sampling, **overrides})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: bad sampling settings {overrides!r}: {err}") from None

    def _source_exhausted(self) -> None:
        """Say so once; stop the run when the wanted batch can no longer fill."""
        if not self.exhausted:
            self.exhausted = True
            self.log.warning("the prompt source is exhausted", epochs=self.source.epochs)
        if (self.wanted_step is not None and not self.in_flight and not self.injected
                and len(self.ready) < self.run.data.rollout_batch_size):
            self.crash(RuntimeError(
                f"the prompt source ran out after {self.source.epochs} epoch(s): step {self.wanted_step} needs "
                f"{self.run.data.rollout_batch_size} groups and only {len(self.ready)} are left; "
                "pass --epochs 0 (as many as needed) or more data"))

    async def _issue_group(self, row: dict[str, Any], min_weight_version: int) -> None:
        request = self._request(row, self._prompt_ids(row), row.get("group_size", self.run.data.group_size),
                                {**self._sampling, **row.get("sampling", {})}, min_weight_version)
        self.in_flight[request.group_id] = request
        self.counters["issued"] += 1
        await self.tell("router", request)

    def _prompt_ids(self, row: dict[str, Any]) -> list[int]:
        data = self.run.data
        return prompt_ids(self.tokenizer, row["prompt"], template=data.prompt_template, chat=data.chat_template,
                          thinking=data.enable_thinking, tools=self.tool_schemas)

    def _request(self, row: dict[str, Any], ids: list[int], group_size: int, sampling: dict[str, Any],
                 min_weight_version: int) -> GenerateGroup:
        """The generation request for a prompt row (prompted with ``ids``), under the next group id."""
        group_id = self.next_group_id
        self.next_group_id += 1
        metadata = {k: v for k, v in row.items() if k not in ("prompt", "label", "sampling", "group_size")}
        data = self.run.data
        messages = prompt_messages(row["prompt"], template=data.prompt_template, chat=data.chat_template)
        return GenerateGroup(group_id=group_id, prompt_ids=ids, messages=messages, label=str(row["label"]),
                             metadata=metadata, group_size=group_size, min_weight_version=min_weight_version,
                             sampling=sampling)

    # ----------------------------------------------------------------- eval

    async def _issue_eval(self, version: int) -> None:
        """Every eval prompt, once, for weight version ``version``."""
        requests = [self._request(row, ids, self.run.eval.eval_samples, self._eval_sampling, version)
                    for row, ids in zip(self.eval_rows, self.eval_prompt_ids)]
        self.eval_rounds[version] = {}
        for request in requests:
            self.eval_version_of[request.group_id] = version
        self.log.info("evaluating", version=version, prompts=len(requests))
        for request in requests:
            await self.tell("router", request)

    async def _on_eval_scored(self, msg: ScoredGroup) -> None:
        version = self.eval_version_of.pop(msg.group_id)
        scored = self.eval_rounds[version]
        scored[msg.group_id] = msg.samples
        if len(scored) == len(self.eval_rows):
            del self.eval_rounds[version]
            metrics = eval_metrics([scored[group_id] for group_id in sorted(scored)], version)
            await self.tell("trainer", EvalResult(version=version, metrics=metrics))

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
        # Oldest first (then issue order): a younger group can wait a step, an older one may not.
        ordered = sorted(self.ready, key=lambda item: (item[0], item[1].group_id))
        groups = [group for _, group in ordered[:batch_size]]
        self.ready = collections.deque(ordered[batch_size:])
        self.trained_groups += batch_size
        self.wanted_step = None
        samples = [s for g in groups for s in g.samples]
        staleness = [step - s.weight_version for s in samples]
        ages = collections.Counter(staleness)
        stats = {
            **{f"staleness_samples_{age}": float(count) for age, count in sorted(ages.items())},
            "staleness_mean": statistics.fmean(staleness),
            "staleness_max": float(max(staleness)),
            "time_generate_s": max(g.generate_s for g in groups),
            **generation_span(groups),
            "time_reward_s": sum(g.reward_s for g in groups),
            "reward_timeouts": float(sum(g.reward_timeouts for g in groups)),
            "partial_rollouts": float(sum(1 for s in samples if len(set(s.generated_versions)) > 1)),
            "dropped_stale": float(self.counters["dropped_stale"]),
            "dropped_filtered": float(self.counters["dropped_filtered"]),
            "epoch": float(self.source.epoch),
        }
        self.counters["trained"] += batch_size
        await self.tell("trainer", TrainBatch(step=step, samples=samples, stats=stats))


def generation_span(groups: list[ScoredGroup]) -> dict[str, float]:
    """When the batch's generation began and ended by the wall clock (``generate_from``/``generate_until``, from
    the first group's first token request to the last group's last token) and how long that was
    (``time_generate_span_s``). ``time_generate_s`` is the longest single group; the span is what a synchronous
    step waits for, and the window bench/e2e.py reads the GPU's busy samples in. The clocks are the rollout
    workers' own: across hosts the span is as good as their clocks agree. Groups without a finish time (kept
    over a resume) are left out; a batch of only those has no span."""
    timed = [g for g in groups if g.finished_at is not None]
    if not timed:
        return {}
    start = min(g.finished_at - g.generate_s for g in timed)
    end = max(g.finished_at for g in timed)
    return {"generate_from": start, "generate_until": end, "time_generate_span_s": end - start}


# What a resumed run's summary must still add up: groups and prompts, not traffic.
_KEPT_COUNTERS = frozenset({"issued", "scored", "trained", "duplicates", "dropped_stale", "dropped_filtered",
                            "injected", "skipped_by_hook", "bad_rows", "resumed_in_flight"})


def _version(group: ScoredGroup) -> int:
    """A group is as old as its oldest sample."""
    return min(sample.weight_version for sample in group.samples)

