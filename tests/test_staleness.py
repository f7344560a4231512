"""Property test: the staleness bound and the accounting hold under any timing.

The real Buffer and Router run in-process (their sends captured, as in
replay); the rest of the job is simulated as discrete events with random
delays drawn by hypothesis: rollout workers that generate token by token
under whatever weights they hold (partial rollouts included), die and come
back, a reward actor, and a trainer that asks for batches, trains and
publishes versions that reach each worker late. Messages between two actors
keep their order, as nng's do.

For every timing: no trained sample is older than ``max_staleness``
versions, no group is trained twice, and every issued group is trained,
dropped, ready or in flight -- none lost.
"""

from __future__ import annotations

import heapq
import itertools
import random
from typing import Any, Callable

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vime.actors.buffer import Buffer
from vime.actors.router import Router
from vime.messages.pipeline import (
    GenerateGroup,
    GroupDone,
    RolloutGroup,
    Sample,
    ScoredGroup,
    TrainBatch,
    WantBatch,
    WeightsPublished,
    WorkerReady,
)
from vime.runtime import ActorSettings
from vime.scenarios import arithmetic
from vime.transports.codec import Envelope

STEPS = 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("model")
    arithmetic.build_model(folder, seed=0, hidden_size=32, layers=1)
    return str(folder)


class Simulation:
    """One job: a clock, an event heap, the two real actors and the simulated rest."""

    def __init__(self, model_path: str, rng: random.Random, workers: int, staleness: int, batch: int,
                 kill_rate: float) -> None:
        config = arithmetic.defaults().replace(model_path=model_path, rollout_batch_size=batch, group_size=2,
                                               max_staleness=staleness, max_new_tokens=4).to_dict()
        self.rng, self.staleness, self.kill_rate = rng, staleness, kill_rate
        self.now = 0.0
        self.events: list[tuple[float, int, Callable[[], Any]]] = []
        self.order = itertools.count()
        self.last_delivery: dict[tuple[str, str], float] = {}
        self.buffer = Buffer(ActorSettings(name="buffer", listen="ipc:///none", seed=1), config)
        self.router = Router(ActorSettings(name="router", listen="ipc:///none"), config)
        for actor in (self.buffer, self.router):
            actor._send_hook = self.send
        self.workers = {f"rollout-{i}": {"version": 0, "alive": True, "groups": {}} for i in range(workers)}
        self.trainer_version = 0
        self.step = 0
        self.trained: list[int] = []
        self.worst_staleness = 0

    # ---- plumbing
    def at(self, delay: float, action: Callable[[], Any]) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self.order), action))

    def send(self, envelope: Envelope) -> None:
        """A message leaves buffer or router (or a simulated actor): it arrives later, in order per pair."""
        pair = (envelope.sender, envelope.receiver)
        arrival = max(self.now + self.rng.expovariate(1 / 0.002), self.last_delivery.get(pair, 0.0))
        self.last_delivery[pair] = arrival
        heapq.heappush(self.events, (arrival, next(self.order), lambda: self.deliver(envelope)))

    def tell(self, sender: str, receiver: str, payload: Any) -> None:
        self.send(Envelope(type(payload).__name__, sender, receiver, 0, None, self.now, None, False, payload))

    async def deliver(self, envelope: Envelope) -> None:
        receiver, payload = envelope.receiver, envelope.payload
        if receiver in ("buffer", "router"):
            actor = self.buffer if receiver == "buffer" else self.router
            await getattr(actor, actor._handlers[envelope.kind])(payload, envelope)
        elif receiver == "reward":
            self.at(self.rng.uniform(0, 0.01), lambda: self.score(payload))
        elif receiver == "trainer":
            self.train(payload)
        elif self.workers[receiver]["alive"]:
            self.start_group(receiver, payload)

    async def run(self) -> None:
        await self.buffer.on_start()
        for name in self.workers:
            self.tell(name, "router", WorkerReady(capacity=self.rng.randint(1, 4), weight_version=0))
        self.tell("trainer", "buffer", WantBatch(step=0))
        while self.step < STEPS:
            assert self.events, f"the job stalled at step {self.step}"
            self.now, _, action = heapq.heappop(self.events)
            result = action()
            if result is not None:
                await result

    # ---- simulated actors
    def start_group(self, worker: str, request: GenerateGroup) -> None:
        state = self.workers[worker]
        if state["version"] < request.min_weight_version:  # the worker waits for newer weights
            self.at(0.005, lambda: self.start_group(worker, request) if state["alive"] else None)
            return
        versions: list[list[int]] = [[] for _ in range(request.group_size)]
        state["groups"][request.group_id] = versions
        self.at(self.rng.expovariate(1 / 0.01), lambda: self.next_token(worker, request, versions))

    def next_token(self, worker: str, request: GenerateGroup, versions: list[list[int]]) -> None:
        state = self.workers[worker]
        if not state["alive"] or request.group_id not in state["groups"]:
            return
        for sample in versions:
            sample.append(state["version"])  # the weights it holds now: partial rollouts mix versions
        if len(versions[0]) < 4:
            self.at(self.rng.expovariate(1 / 0.01), lambda: self.next_token(worker, request, versions))
            return
        del state["groups"][request.group_id]
        samples = [Sample(group_id=request.group_id, index=i, prompt_ids=request.prompt_ids, response_ids=[1] * 4,
                          logprobs=[-1.0] * 4, versions=v, finish_reason="length", label=request.label,
                          metadata={}) for i, v in enumerate(versions)]
        self.tell(worker, "reward", RolloutGroup(group_id=request.group_id, samples=samples, worker=worker,
                                                 generate_s=0.0, finished_at=0.0))
        self.tell(worker, "router", GroupDone(group_id=request.group_id))
        if self.rng.random() < self.kill_rate:
            self.kill(worker)

    def kill(self, worker: str) -> None:
        """kill -9: what it held is gone; the router hears of it, then a new process says hello."""
        state = self.workers[worker]
        state.update(alive=False, groups={})

        def restart() -> None:
            state.update(alive=True, version=self.trainer_version)  # the trainer sends it the latest weights
            self.tell(worker, "router", WorkerReady(capacity=self.rng.randint(1, 4),
                                                    weight_version=state["version"]))

        async def gone() -> None:  # the driver's news; the new process starts only after it
            await self.router.on_peer_gone(worker)
            self.at(self.rng.uniform(0.01, 0.2), restart)

        self.at(self.rng.uniform(0.001, 0.05), gone)

    def score(self, group: RolloutGroup) -> None:
        for sample in group.samples:
            sample.reward = float(self.rng.random() < 0.5)
        self.tell("reward", "buffer", ScoredGroup(group_id=group.group_id, samples=group.samples, worker=group.worker,
                                                  generate_s=0.0, finished_at=0.0, reward_s=0.0))

    def train(self, batch: TrainBatch) -> None:
        assert batch.step == self.step == self.trainer_version
        for sample in batch.samples:
            age = batch.step - sample.weight_version
            assert age <= self.staleness, f"step {batch.step} got a sample of version {sample.weight_version}"
            self.worst_staleness = max(self.worst_staleness, age)
        self.trained.extend(sorted({s.group_id for s in batch.samples}))

        def publish() -> None:
            self.trainer_version += 1
            self.step += 1
            for state in self.workers.values():  # each worker applies the new weights when they arrive
                version = self.trainer_version
                self.at(self.rng.uniform(0.0, 0.05), lambda s=state, v=version: s.update(version=max(s["version"], v)))
            self.tell("trainer", "buffer", WeightsPublished(version=self.trainer_version))
            self.tell("trainer", "buffer", WantBatch(step=self.step))

        self.at(self.rng.expovariate(1 / 0.03), publish)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(1, 4), staleness=st.integers(0, 3),
       batch=st.integers(1, 6), kill_rate=st.sampled_from([0.0, 0.05, 0.2]))
def test_no_sample_breaks_the_bound_and_every_group_is_accounted_for(model_path, seed, workers, staleness, batch,
                                                                     kill_rate):
    sim = Simulation(model_path, random.Random(seed), workers, staleness, batch, kill_rate)
    trio.run(sim.run)
    counters = sim.buffer.counters
    assert len(sim.trained) == len(set(sim.trained)) == STEPS * batch  # none trained twice
    assert counters["trained"] == STEPS * batch
    accounted = (counters["trained"] + len(sim.buffer.in_flight) + len(sim.buffer.ready)
                 + counters["dropped_stale"] + counters["dropped_filtered"])
    assert counters["issued"] == accounted  # none lost
    assert sim.worst_staleness <= staleness
