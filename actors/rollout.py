"""A rollout worker: an inference engine fed with groups, fed with weights.

Generation runs in a loop beside the message handlers: between two engine
steps the worker applies the newest complete set of weights, admits the
groups whose ``min_weight_version`` it now holds, and sends each finished
group to the reward actor (and tells the router it is done). Weights arrive
by the path the trainer picked from the GPUs the worker names in WantWeights
(nng chunks, CUDA IPC, a broadcast group): the worker hands every weight
message to its :class:`~vime.weights.WeightReceiver`, which has the engine
load them between two steps; over CUDA IPC they come a bucket per ask, and
the engine generates nothing from the first bucket to the last.

A weight update that lands while sequences are running does not restart
them: they continue under the new weights (a partial rollout), and every
token carries the version that produced it.

On the trainer's own GPU with vLLM's sleep mode, the trainer asks
(SleepEngine) before each of its steps: the worker lets its running
responses finish, admits nothing new, and sleeps; the next weights wake it.
Updates then never land mid-response.

With tools (``--tool``), a response is an episode of turns: a turn that
stops with tool calls has them run in the sandbox (in threads, so
generation goes on), their results inserted as tool messages (loss mask 0),
and the response's next turn queued; the group is scored once every
response has ended (``vime.agent``).

Joining: with ``--colocate`` the worker first asks the trainer for its turn
to build the engine, which comes between two training steps (a restarted
worker's too); once built, it tells the trainer it is ready (an ask); the trainer
sends the current weights and answers with their version; only once those
are applied does the worker tell the router to send it work. A worker
started by hand on another host (``python -m vime.actor rollout --join``)
takes the job's settings from the driver, so it is built in ``on_start``.
Leaving: on SIGTERM (or Shutdown) it hands its unfinished groups back to the
router, which re-issues them, and sends nothing more.

The engine runs in a worker thread, one step at a time, so the actor keeps
answering messages (status, weights, new groups) while it generates.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch
import trio

from vime.agent.endpoint import AgentEndpoint
from vime.agent.episode import Episode, ToolCall, parse_tool_calls, tool_messages, turn_ids, turn_text
from vime.agent.sandbox import Limits
from vime.agent.tools import Toolbox
from vime.backends.base import RolloutEngine, SamplingParams, Sequence
from vime.backends.hf import load_tokenizer
from vime.backends.torch_rollout import TorchRolloutEngine
from vime.config import RunConfig
from vime.messages.gpu_turns import BUILD_TURN_RETRY_S, EngineAsleep, MayBuildEngine, SleepEngine
from vime.messages.pipeline import GenerateGroup, GroupDone, RolloutGroup, Sample, WorkerLeaving, WorkerReady
from vime.placement import visible_gpus
from vime.runtime import Actor, ActorSettings, PeerGone, handles
from vime.transports import http
from vime.transports.codec import Envelope
from vime.weights import RECEIVED, WantWeights, WeightReceiver


class _Group:
    """A group being generated: its request, the latest turn and the episode of each response, when it started."""

    def __init__(self, request: GenerateGroup, sequences: list[Sequence], started: float) -> None:
        self.request = request
        self.sequences = sequences
        self.episodes = [Episode(request.prompt_ids) for _ in sequences]  # an episode never changes its prompt
        self.rewards: list[float | None] = [None] * len(sequences)  # an external agent's own scores
        self.started = started
        self.unfinished = len(sequences)


class _EngineCall:
    """An engine call that a message handler waits on while the generation loop runs it."""

    def __init__(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = trio.Event()
        self.error: Exception | None = None


class RolloutWorker(Actor):
    role = "rollout"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.waiting: list[tuple[GenerateGroup, SamplingParams]] = []  # for newer weights, or for the engine
        self.groups: dict[int, _Group] = {}
        self.by_request: dict[int, tuple[_Group, int]] = {}  # engine request id -> its group, its index there
        self.continuing: list[Sequence] = []  # responses' next turns, after their tool calls
        self.external_turns: dict[int, trio.Event] = {}  # with --openai-endpoint: request id -> set when it ends
        self.stepped = trio.lowlevel.ParkingLot()  # woken after every engine step (streaming replies watch it)
        self.endpoint: AgentEndpoint | None = None
        self.next_request = 0
        self.engine_calls: collections.deque[_EngineCall] = collections.deque()  # to run between two steps
        self.wake = trio.Event()
        self.applied = trio.lowlevel.ParkingLot()  # woken whenever a weight version is applied
        self.draining = False  # finishing the running responses before the engine sleeps (SleepEngine)
        self.leaving = False

    async def on_start(self) -> None:
        self.run = RunConfig.from_dict(self.config)
        if self.run.rollout.rollout_threads:  # several workers and a trainer share the CPU: do not oversubscribe
            torch.set_num_threads(self.run.rollout.rollout_threads)
        if self.run.placement.colocate:
            await self._wait_for_build_turn()
        # Loading takes seconds: in a thread, so that heartbeats keep telling the driver we are alive.
        self.engine = await trio.to_thread.run_sync(self._build_engine)
        self.weights = WeightReceiver(self.engine, self._between_steps, lambda: self.wake.set())
        self.tokenizer = load_tokenizer(self.run.model.model_path)
        agent = self.run.agent
        self.toolbox = Toolbox(agent.tool, Limits(seconds=agent.tool_timeout_s, memory_mb=agent.tool_memory_mb)) \
            if agent.tool else None
        self.tool_calls = trio.CapacityLimiter(os.cpu_count() or 1)  # each call is a process of its own
        if agent.openai_endpoint:
            await self._serve_agents(agent.openai_endpoint)
        self.start_soon(self._generate_loop)
        self.start_soon(self._join)

    async def _wait_for_build_turn(self) -> None:
        """Build the engine only once the trainer lets us (MayBuildEngine); with no trainer, nothing trains."""
        ask = MayBuildEngine(host=os.uname().nodename, gpus=visible_gpus())
        with contextlib.suppress(PeerGone, LookupError):
            while not (await self.ask("trainer", ask, timeout=60.0)).granted:
                await trio.sleep(BUILD_TURN_RETRY_S)
        self.log.info("building the engine")

    async def _serve_agents(self, address: str) -> None:
        """Serve the OpenAI-compatible endpoint (``vime.agent.endpoint``); its URL goes to RUN_DIR/endpoints/NAME."""
        host, _, port = address.rpartition(":")
        assert self._nursery is not None
        bound = await self._nursery.start(functools.partial(http.serve, self._handle_agent, host, int(port)))
        url = f"http://{host}:{bound}"
        self.endpoint = AgentEndpoint(self, url, thinking=self.run.data.enable_thinking,
                                      max_response_tokens=self.run.agent.max_response_tokens)
        self.start_soon(self.endpoint.expire_idle, self.run.agent.episode_timeout_s)
        folder = Path(self.settings.run_dir or ".") / "endpoints"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / self.name).write_text(url + "\n")
        self.log.info("serving agents", url=url)

    async def _handle_agent(self, request: http.Request) -> http.Response:
        assert self.endpoint is not None
        return await self.endpoint.handle(request)

    def start_turn(self, prompt_ids: list[int], params: SamplingParams, stream: bool) -> tuple[Sequence, trio.Event]:
        """An external agent's next reply: generated like any turn (with ``stream``, its tokens reach the
        sequence as they come); the event is set when it ends."""
        sequence = Sequence(self.next_request, prompt_ids, params, stream=stream)
        self.next_request += 1
        done = self.external_turns[sequence.request_id] = trio.Event()
        self.continuing.append(sequence)
        self.wake.set()
        return sequence, done

    async def end_response(self, group: _Group, index: int, episode: Episode, finish_reason: str,
                           reward: float | None) -> None:
        """An external agent ended one response of ``group``."""
        group.episodes[index] = episode
        group.sequences[index].finish_reason = finish_reason
        group.rewards[index] = reward
        await self._response_done(group)

    def _build_engine(self) -> RolloutEngine:
        model, rollout = self.run.model, self.run.rollout
        shared = dict(dtype=model.dtype, max_batch_size=rollout.rollout_max_batch_size, seed=self.settings.seed,
                      record_experts=rollout.use_rollout_routing_replay)
        if rollout.rollout_backend == "vllm":
            from vime.backends.vllm_rollout import VllmRolloutEngine

            return VllmRolloutEngine(model.model_path, gpus=rollout.rollout_num_gpus_per_engine,
                                     engine_args=rollout.vllm_args, **shared)
        return TorchRolloutEngine(model.model_path, **shared)

    async def _join(self) -> None:
        """Get the trainer's current weights, then ask the router for work."""
        gpus = await trio.to_thread.run_sync(self.engine.gpus)
        ready = WantWeights(weight_version=self.engine.weight_version, gpus=gpus)
        await self.wait_for_peer("trainer", timeout=600.0)
        current = await self.ask("trainer", ready, timeout=600.0)
        while self.engine.weight_version < current.version:
            await self.applied.park()
        self.log.info("joined", weight_version=self.engine.weight_version)
        await self.wait_for_peer("router", timeout=600.0)
        await self.tell("router", WorkerReady(capacity=self.run.rollout.rollout_capacity,
                                              weight_version=self.engine.weight_version))

    async def on_stop(self) -> None:
        self.leaving = True
        self.wake.set()
        if self.endpoint is not None:
            self.endpoint.withdraw()
        unfinished = sorted([*self.groups, *(g.group_id for g, _ in self.waiting)])
        if unfinished:
            self.log.info("handing unfinished groups back", groups=len(unfinished))
        with contextlib.suppress(LookupError, PeerGone):
            await self.tell("router", WorkerLeaving(group_ids=unfinished))

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
        """The trainer on our GPU is about to train: let the running responses finish, start nothing new, and
        sleep until its next weights (``_admit`` starts nothing while the engine sleeps)."""
        started = time.monotonic()
        self.draining = True
        try:
            while self.engine.busy:
                await self.stepped.park()
            drained = time.monotonic() - started
            await self._between_steps(self._sleep, msg.level, msg.version)
        finally:
            self.draining = False
            self.wake.set()  # groups that came while it drained start now if it did not sleep after all
        return EngineAsleep(drain_s=drained)

    def _sleep(self, level: int, version: int) -> None:
        """Weights newer than the trainer's when it asked came after it stopped waiting for us: generate with
        them rather than sleep through the step they belong to."""
        if self.engine.weight_version <= version:
            self.engine.sleep(level)

    async def _between_steps(self, fn: Callable[..., None], *args: Any) -> None:
        """Have the generation loop run ``fn(*args)`` between two engine steps, where nothing else uses the
        engine; returns (or raises) once it has run."""
        call = _EngineCall(fn, args)
        self.engine_calls.append(call)
        self.wake.set()
        await call.done.wait()
        if call.error is not None:
            raise call.error

    async def _run_engine_calls(self) -> None:
        while self.engine_calls:
            call = self.engine_calls.popleft()
            version = self.engine.weight_version
            try:
                await trio.to_thread.run_sync(call.fn, *call.args)
            except Exception as err:  # the handler that asked for the call answers with it
                call.error = err
            call.done.set()
            if self.engine.weight_version != version:
                self._weights_applied()

    async def _generate_loop(self) -> None:
        while True:
            if self.leaving:  # its groups were handed back: stop spending the engine on them
                self.engine.abort([*self.by_request, *self.external_turns])
                self.by_request.clear()
                return
            await self._run_engine_calls()
            if self.weights.apply():
                self._weights_applied()
            self._admit()
            if not self.engine.busy or self.weights.loading is not None:
                await self.wake.wait()
                self.wake = trio.Event()
                continue
            finished = await trio.to_thread.run_sync(self.engine.step)
            self.stepped.unpark_all()
            for sequence in finished:
                await self._finish(sequence)

    def _weights_applied(self) -> None:
        """Wake whoever waits for a version (joining), and count the update."""
        self.applied.unpark_all()
        self.counters["weight_updates"] += 1
        self.log.debug("weights applied", weight_version=self.engine.weight_version)

    def _admit(self) -> None:
        """Start the waiting groups whose weight version the engine now holds."""
        if self.draining or self.engine.asleep or self.weights.loading is not None:
            return  # the GPU is the colocated trainer's until the next weights, or they are arriving
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
            sequences = []
            for length in forced_lengths(self.run.rollout.forced_response_lengths, params.max_new_tokens,
                                         self.run.job.seed, request.group_id, request.group_size):
                sequences.append(Sequence(self.next_request, list(request.prompt_ids), params if length is None
                                          else dataclasses.replace(params, max_new_tokens=length, stop_token_ids=())))
                self.next_request += 1
            group = self.groups[request.group_id] = _Group(request, sequences, now)
            if self.endpoint is not None:  # external agents drive the responses
                for index in range(len(sequences)):
                    self.endpoint.offer(group, index, request.messages, request.label, request.metadata, params)
                continue
            for index, sequence in enumerate(sequences):
                self.by_request[sequence.request_id] = (group, index)
            self.engine.add(sequences)

    async def _finish(self, sequence: Sequence) -> None:
        """A turn ended: the response calls tools (and goes on after them), or it is complete."""
        external = self.external_turns.pop(sequence.request_id, None)
        if external is not None:  # an agent's reply: the endpoint records it
            external.set()
            return
        group, index = self.by_request.pop(sequence.request_id)
        group.sequences[index] = sequence
        episode = group.episodes[index]
        episode.add_generated(sequence.response_ids, sequence.logprobs, sequence.versions)
        calls = self._tool_calls(episode, sequence)
        if calls:
            self.start_soon(self._use_tools, group, index, calls)
            return
        await self._response_done(group)

    def _tool_calls(self, episode: Episode, turn: Sequence) -> list[ToolCall]:
        """The calls a turn makes, if the response may go on: it stopped (was not cut), within the limits.
        Its text is decoded only to be read; the tokens stay the engine's."""
        agent = self.run.agent
        if (self.toolbox is None or self.leaving or turn.finish_reason != "stop"
                or len(episode.turns) >= agent.max_turns or len(episode.response_ids) >= agent.max_response_tokens):
            return []
        return parse_tool_calls(turn_text(self.tokenizer, turn.response_ids))

    async def _use_tools(self, group: _Group, index: int, calls: list[ToolCall]) -> None:
        """Run the calls (each in the sandbox), insert their results as the chat template writes tool
        messages, and queue the response's next turn -- or end it at the token limit."""
        assert self.toolbox is not None
        results = [await trio.to_thread.run_sync(self.toolbox.call, call, limiter=self.tool_calls) for call in calls]
        if self.leaving:  # its group was handed back meanwhile
            return
        turn, episode = group.sequences[index], group.episodes[index]
        episode.add_inserted(turn_ids(self.tokenizer, tool_messages(results), thinking=self.run.data.enable_thinking,
                                      ended_with_eos=turn.response_ids[-1] == self.tokenizer.eos_token_id))
        episode.turns.append({"calls": [dataclasses.asdict(call) for call in calls], "results": results})
        self.counters["tool_calls"] += len(calls)
        room = self.run.agent.max_response_tokens - len(episode.response_ids)
        if room <= 0:
            await self._response_done(group)
            return
        params = dataclasses.replace(turn.params, max_new_tokens=min(turn.params.max_new_tokens, room))
        follow = Sequence(self.next_request, episode.prompt_ids + episode.response_ids, params)
        self.next_request += 1
        self.by_request[follow.request_id] = (group, index)
        self.continuing.append(follow)
        self.wake.set()

    async def _response_done(self, group: _Group) -> None:
        """One response of the group is complete; the last one sends the group to be scored."""
        group.unfinished -= 1
        if group.unfinished or self.leaving:  # a leaving worker's groups were handed back
            return
        request = group.request
        del self.groups[request.group_id]
        samples = [Sample(group_id=request.group_id, index=index, prompt_ids=e.prompt_ids,
                          response_ids=e.response_ids, logprobs=e.logprobs, versions=e.versions,
                          finish_reason=s.finish_reason or "length", label=request.label, metadata=request.metadata,
                          response_text=self.tokenizer.decode(e.response_ids, skip_special_tokens=True),
                          routed_experts=s.routed_experts, loss_mask=e.loss_mask if 0 in e.loss_mask else None,
                          reward=reward)
                   for index, (s, e, reward) in enumerate(zip(group.sequences, group.episodes, group.rewards))]
        self.counters["groups"] += 1
        self.counters["tokens"] += sum(len(s.response_ids) for s in samples)
        await self.tell("reward", RolloutGroup(group_id=request.group_id, samples=samples, worker=self.name,
                                               generate_s=time.monotonic() - group.started))
        await self.tell("router", GroupDone(group_id=request.group_id))


def forced_lengths(spec: str, max_new_tokens: int, seed: int, group_id: int, count: int) -> list[int | None]:
    """The length each of a group's ``count`` responses is forced to by ``--forced-response-lengths`` (None:
    not forced). Drawn from the run's seed and the group's id, so a group re-issued to another worker, or
    a replayed run, gets the same lengths."""
    if not spec:
        return [None] * count
    if spec == "max":
        return [max_new_tokens] * count
    low = min(int(spec.removeprefix("uniform:")), max_new_tokens)
    generator = random.Random(f"{seed}:{group_id}")
    return [generator.randint(low, max_new_tokens) for _ in range(count)]
