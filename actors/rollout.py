"""A rollout worker: an inference engine fed with groups, fed with weights.

Generation runs in a loop beside the message handlers, the engine in a worker
thread one step at a time (so the actor keeps answering messages while it
generates). Between two steps the loop runs what handlers asked of the engine,
applies the newest complete weights, admits the groups whose
``min_weight_version`` it now holds, and sends each finished group to the
reward actor (and tells the router it is done). The concerns it delegates:

* weight sync -- ``vime.weights``: every weight message goes to the
  :class:`~vime.weights.WeightReceiver`, which has the engine load it between
  two steps. Sequences running when an update lands continue under the new
  weights (a partial rollout); every token carries its version.
* GPU turns -- ``vime.gpu_turns``: with ``--colocate`` the engine is built in
  the trainer's turn; with vLLM's sleep mode it drains and sleeps through each
  training step on its GPU (SleepEngine) until the next weights.
* tools -- ``vime.agent.tools``; external agents -- ``vime.agent.endpoint``
  (``--openai-endpoint``); the groups in flight, their engine requests and their samples --
  ``vime.groups``.

Joining: once built, it tells the trainer it is ready (an ask); the trainer
sends the current weights and answers with their version; once those are
applied the worker tells the router to send it work. A worker started by
hand on another host (``vime-actor rollout --join``) takes the
job's settings from the driver, so it is built in ``on_start``, from the
model folder that ``vime.model_files`` finds or fetches on its host. Leaving: on
SIGTERM (or Shutdown) it hands its unfinished groups back to the router,
which re-issues them, and sends nothing more.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import trio

from vime.agent.endpoint import AgentEndpoint, serve_agents
from vime.agent.episode import Episode, ToolCall
from vime.agent.tools import ToolUse
from vime.backends import rollout_engine
from vime.backends.base import RolloutEngine, SamplingParams, Sequence
from vime.backends.hf import load_tokenizer
from vime.config import RunConfig
from vime.gpu_turns import EngineSleep, wait_for_build_turn
from vime.groups import Group, InFlight
from vime.messages.gpu_turns import EngineAsleep, SleepEngine
from vime.messages.pipeline import GenerateGroup, GroupDone, RolloutGroup, WorkerLeaving, WorkerReady
from vime.model_files import local_model_folder
from vime.runtime import Actor, ActorSettings, BetweenSteps, Changed, Wakeup, handles
from vime.startup import timed
from vime.transports.codec import Envelope
from vime.weights import RECEIVED, WantWeights, WeightReceiver


class RolloutWorker(Actor):
    role = "rollout"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.waiting: list[tuple[GenerateGroup, SamplingParams]] = []  # for newer weights, or for the engine
        self.in_flight = InFlight()  # the groups started, and which response each engine request is a turn of
        self.continuing: list[Sequence] = []  # responses' next turns, after their tool calls
        self.external_turns: dict[int, trio.Event] = {}  # with --openai-endpoint: request id -> set when it ends
        self.stepped = Changed()  # after every engine step (a drain and streaming replies watch it)
        self.endpoint: AgentEndpoint | None = None
        self.wake = Wakeup()  # the generation loop has something to do
        self.engine_calls = BetweenSteps(self.wake.set)  # handlers' engine calls, run between two steps
        self.applied = Changed()  # a weight version was applied
        self.leaving = False

    async def on_start(self) -> None:
        self.run = RunConfig.from_dict(self.config)
        model_path = await local_model_folder(self, self.run.model.model_path)  # a joined host may lack the head's
        self.run = self.run.replace(model_path=model_path)
        if self.run.rollout.rollout_threads:  # several workers and a trainer share the CPU: do not oversubscribe
            torch.set_num_threads(self.run.rollout.rollout_threads)
        if self.run.placement.colocate:
            with timed(self.startup, "build_turn_wait_s"):
                await wait_for_build_turn(self)
        # Loading takes seconds: in a thread, so that heartbeats keep telling the driver we are alive.
        with timed(self.startup, "engine_build_s"):
            self.engine = await trio.to_thread.run_sync(self._build_engine)
        self.weights = WeightReceiver(self.engine, self.engine_calls.call, self.wake.set)
        self.gpu = EngineSleep(self.engine, self.stepped, self.engine_calls.call, self.wake.set)
        self.tokenizer = load_tokenizer(self.run.model.model_path)
        self.tools = ToolUse(self.run.agent, self.tokenizer, self.run.data.enable_thinking)
        if self.run.agent.openai_endpoint:
            self.endpoint = await serve_agents(self, self._nursery, self.run.agent, self.run.data.enable_thinking,
                                               Path(self.settings.run_dir or "."), self.name)
            self.log.info("serving agents", url=self.endpoint.url)
        self.start_soon(self._generate_loop)
        self.start_soon(self._join)

    def start_turn(self, prompt_ids: list[int], params: SamplingParams, stream: bool) -> tuple[Sequence, trio.Event]:
        """An external agent's next reply: generated like any turn (with ``stream``, its tokens reach the
        sequence as they come); the event is set when it ends."""
        sequence = self.in_flight.sequence(prompt_ids, params, stream=stream)
        done = self.external_turns[sequence.request_id] = trio.Event()
        self.continuing.append(sequence)
        self.wake.set()
        return sequence, done

    async def end_response(self, group: Group, index: int, episode: Episode, finish_reason: str,
                           reward: float | None) -> None:
        """An external agent ended one response of ``group``."""
        group.episodes[index] = episode
        group.sequences[index].finish_reason = finish_reason
        group.rewards[index] = reward
        await self._response_done(group)

    def _build_engine(self) -> RolloutEngine:
        return rollout_engine(self.run, self.settings.seed)

    async def _join(self) -> None:
        """Get the trainer's current weights, then ask the router for work."""
        gpus = await trio.to_thread.run_sync(self.engine.gpus)
        ready = WantWeights(weight_version=self.engine.weight_version, gpus=gpus)
        await self.wait_for_peer("trainer", timeout=600.0)
        current = await self.ask("trainer", ready, timeout=600.0)
        await self.applied.until(lambda: self.engine.weight_version >= current.version)
        self.log.info("joined", weight_version=self.engine.weight_version)
        await self.wait_for_peer("router", timeout=600.0)
        await self.tell("router", WorkerReady(capacity=self.run.rollout.rollout_capacity,
                                              weight_version=self.engine.weight_version))

    async def on_stop(self) -> None:
        self.leaving = True
        self.wake.set()
        if self.endpoint is not None:
            self.endpoint.withdraw()
        unfinished = sorted([*self.in_flight.groups, *(g.group_id for g, _ in self.waiting)])
        if unfinished:
            self.log.info("handing unfinished groups back", groups=len(unfinished))
        await self.tell_quietly("router", WorkerLeaving(group_ids=unfinished))

    @handles(GenerateGroup)
    async def _on_group(self, msg: GenerateGroup, envelope: Envelope) -> None:
        """Check the request here, where a bad one fails alone, not in the generation loop it would stop."""
        params = SamplingParams.from_dict(msg.sampling)
        vocab = self.engine.vocab_size
        if msg.group_size < 1 or not msg.prompt_ids or not all(0 <= t < vocab for t in msg.prompt_ids):
            raise ValueError(f"group {msg.group_id}: needs group_size >= 1 and a prompt of token ids below {vocab}")
        self.waiting.append((msg, params))
        self.wake.set()

    @handles(*RECEIVED)
    async def _on_weights(self, msg: Any, envelope: Envelope) -> Any:
        """Weights by any path: the receiver half of that path handles them (``vime.weights``)."""
        return await self.weights.receive(msg)

    @handles(SleepEngine)
    async def _on_sleep(self, msg: SleepEngine, envelope: Envelope) -> EngineAsleep:
        """The trainer on our GPU is about to train (``vime.gpu_turns``)."""
        return await self.gpu.sleep(msg)

    async def _generate_loop(self) -> None:
        while True:
            if self.leaving:  # its groups were handed back: stop spending the engine on them
                self.engine.abort([*self.in_flight.abandon(), *self.external_turns])
                return
            await self._run_engine_calls()
            self._apply_weights()
            if self.engine.busy or self._startable():
                await self.step_point()  # which groups start next, and so what the engine's batches hold
                self._apply_weights()  # live, nothing changed since; a replay may only now hold an nng set
                self._admit()
            if not self.engine.busy or self.weights.loading is not None:
                await self.wake.wait()
                continue
            finished = await trio.to_thread.run_sync(self.engine.step)
            self.stepped.notify()
            for sequence in finished:
                await self._finish(sequence)

    async def _run_engine_calls(self) -> None:
        """What handlers asked of the engine (``vime.tasks.BetweenSteps``); a call that loads weights is an update."""
        version = self.engine.weight_version

        def after() -> None:
            nonlocal version
            if self.engine.weight_version != version:
                version = self.engine.weight_version
                self._weights_applied()

        await self.engine_calls.run(after)

    def _apply_weights(self) -> None:
        """The newest complete set of weights, if one came since (``vime.weights``), goes into the engine."""
        if self.weights.apply():
            self._weights_applied()

    def _weights_applied(self) -> None:
        """Wake whoever waits for a version (joining), and count the update."""
        self.applied.notify()
        self.counters["weight_updates"] += 1
        self.log.debug("weights applied", weight_version=self.engine.weight_version)

    def _startable(self) -> bool:
        """Whether _admit would start anything now."""
        if self.gpu.holds_starts or self.weights.loading is not None:
            return False  # the GPU is the colocated trainer's until the next weights, or they are arriving
        version = self.engine.weight_version
        return bool(self.continuing) or any(g.min_weight_version <= version for g, _ in self.waiting)

    def _admit(self) -> None:
        """Start the waiting groups whose weight version the engine now holds."""
        if not self._startable():
            return
        if self.continuing:  # a response's next turn goes on under whatever weights the engine holds
            self.engine.add(self.continuing)
            self.continuing = []
        version = self.engine.weight_version
        ready = [(g, params) for g, params in self.waiting if g.min_weight_version <= version]
        if not ready:
            return
        self.waiting = [(g, params) for g, params in self.waiting if g.min_weight_version > version]
        now = time.monotonic()
        for request, params in ready:
            group = self.in_flight.start(request, params, self.run.rollout.forced_response_lengths,
                                         self.run.job.seed, now, booked=self.endpoint is None)
            if self.endpoint is not None:  # external agents drive the responses
                for index in range(len(group.sequences)):
                    self.endpoint.offer(group, index, request.messages, request.label, request.metadata, params)
                continue
            self.engine.add(group.sequences)

    async def _finish(self, sequence: Sequence) -> None:
        """A turn ended: the response calls tools (and goes on after them), or it is complete."""
        external = self.external_turns.pop(sequence.request_id, None)
        if external is not None:  # an agent's reply: the endpoint records it
            external.set()
            return
        group, index = self.in_flight.turn_ended(sequence)
        calls = [] if self.leaving else self.tools.calls(group.episodes[index], sequence)
        if calls:
            self.start_soon(self._use_tools, group, index, calls)
            return
        await self._response_done(group)

    async def _use_tools(self, group: Group, index: int, calls: list[ToolCall]) -> None:
        """Run the calls, then queue the response's next turn -- or end it at the token limit."""
        results = await self.tools.run(calls)
        if self.leaving:  # its group was handed back meanwhile
            return
        params = self.tools.go_on(group.episodes[index], group.sequences[index], calls, results)
        self.counters["tool_calls"] += len(calls)
        if params is None:
            await self._response_done(group)
            return
        self.continuing.append(self.in_flight.next_turn(group, index, params, self.run.job.seed))
        self.wake.set()

    async def _response_done(self, group: Group) -> None:
        """One response of the group is complete; the last one sends the group to be scored."""
        if not self.in_flight.response_ended(group) or self.leaving:  # a leaving worker's groups were handed back
            return
        request = group.request
        samples = group.samples(self.tokenizer, prompt_text=bool(self.run.reward.custom_rm_path))
        self.counters["groups"] += 1
        self.counters["tokens"] += sum(len(s.response_ids) for s in samples)
        await self.tell("reward", RolloutGroup(group_id=request.group_id, samples=samples, worker=self.name,
                                               generate_s=time.monotonic() - group.started,
                                               finished_at=time.time()))
        await self.tell("router", GroupDone(group_id=request.group_id))

