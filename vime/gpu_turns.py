"""GPU turn-taking: when a rollout engine may be built, and sleep, on a GPU the trainer trains on.

vLLM sizes its KV cache from the GPU memory it sees in use while it profiles, so an engine must not be built
beside a training step, nor beside another engine's profile; and with vLLM's sleep mode
(``--vllm-enable-sleep-mode true``) the engines on the trainer's GPUs give their memory back for every step.
The three sides of that, in one place:

* the driver (:func:`start_engines_in_turn`) starts the workers that share GPUs one after another, each once
  the one before has built its engine, then tells the trainer (EnginesStarted);
* the trainer (:class:`TrainerGpu`) trains first only then (with ``--colocate``); lets an engine built later
  (a restarted worker, MayBuildEngine) build between two steps, the next of which waits until it is built;
  holds the GPU (``busy``) from a step's batch to its end; and before each step puts the engines on its GPUs
  to sleep (SleepEngine), each finishing its running responses first; the next weights wake them;
* a rollout worker (:func:`wait_for_build_turn`, :class:`EngineSleep`) asks for its turn before it builds,
  and when asked to sleep lets its running responses finish (drains), starts nothing new, and sleeps.

Rollout and training then take turns on the GPU, each with all of its memory. The messages, and the timing
constants both sides read, are in ``vime.messages.gpu_turns``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from vime.messages.gpu_turns import (
    BUILD_TURN_ASK_S,
    BUILD_TURN_KEPT_S,
    BUILD_TURN_RETRY_S,
    ENGINE_BUILD_S,
    BuildTurn,
    EngineAsleep,
    EnginesStarted,
    MayBuildEngine,
    SleepEngine,
)
from vime.messages.runtime import StatusQuery
from vime.placement import Placement, visible_gpus
from vime.runtime import Actor, Changed, PeerGone, RemoteError

if TYPE_CHECKING:
    from vime.backends.base import RolloutEngine, TrainEngine
    from vime.config import RunConfig

# ------------------------------------------------------------------ driver


def engines_sharing_gpus(placed: Placement) -> list[list[int]]:
    """The rollout workers in groups that start in turn: one group per set of GPUs; a worker without GPUs
    placed for it is a group of its own."""
    groups: dict[str, list[int]] = {}
    for index, devices in enumerate(placed.engines):
        groups.setdefault(devices or f"unplaced-{index}", []).append(index)
    return list(groups.values())


async def start_engines_in_turn(job: Any, placed: Placement, spawn: Callable[[int], Awaitable[str]]) -> None:
    """Start the rollout workers (``spawn(index)`` starts one and returns its name); those sharing GPUs one
    after another, each once the one before has built its engine (it answers a status query only then). Once
    every engine is built (or gone, or past ``ENGINE_BUILD_S``), tell the trainer, which waits for that before
    training on a GPU it shares. The waits only order the starts (they run beside the run's watch, which
    reports a worker that fails)."""
    async def built(name: str) -> None:
        """Return once ``name`` has built its engine, through its restarts, or once it is gone for good, or
        ``ENGINE_BUILD_S`` after it was started."""
        with trio.move_on_after(ENGINE_BUILD_S):
            while True:
                try:
                    await job.ask(name, StatusQuery(), timeout=ENGINE_BUILD_S)
                    return
                except TimeoutError:
                    return
                except (PeerGone, LookupError):  # it died, or is not back yet
                    if job.gone_for_good(name):
                        return
                    await trio.sleep(1.0)

    async def start_in_turn(indices: list[int]) -> None:
        for index in indices:
            await built(await spawn(index))

    async with trio.open_nursery() as nursery:
        for indices in engines_sharing_gpus(placed):
            nursery.start_soon(start_in_turn, indices)
    with contextlib.suppress(PeerGone, LookupError):  # a trainer gone is the watch's to report
        await job.tell("trainer", EnginesStarted())


# ----------------------------------------------------------------- trainer


class TrainerGpu:
    """The trainer's GPUs and the engines beside them. ``forget(worker)`` is called with a worker found gone.

    A step calls :meth:`release` until it has its batch (an engine may be built then), :meth:`take` before it
    trains, and :meth:`sleep_engines` under the weights lock; handlers call :meth:`may_build` (MayBuildEngine),
    :meth:`built` (WantWeights, or the worker gone) and :meth:`engines_started` (EnginesStarted)."""

    def __init__(self, actor: Actor, engine: TrainEngine, run: RunConfig, forget: Callable[[str], None]) -> None:
        self.actor, self.engine, self.run, self.forget = actor, engine, run, forget
        self.host, self.visible = os.uname().nodename, set(visible_gpus())
        self.started = trio.Event()  # EnginesStarted came
        self.busy = False  # a step trains, publishes, saves or exports: no engine may start building here
        self.builds: dict[str, float] = {}  # workers building an engine on our GPU -> when we stop waiting
        self.queued: dict[str, float] = {}  # workers refused a turn to build -> when we stop keeping their place
        self.sharing: set[str] = set()  # workers whose engine is on our GPU (colocated): put to sleep
        self.changed = Changed()  # a build ended or a place was given up

    def engines_started(self) -> None:
        self.started.set()

    async def first_turn(self) -> None:
        """With ``--colocate``, wait until the driver says every engine it starts is built."""
        if self.run.placement.colocate and not self.started.is_set():
            self.actor.log.info("training waits for the engines on this GPU to be built")
            await self.started.wait()

    def share(self, worker: str, worker_gpus: list[str], trainer_gpus: list[str]) -> None:
        """``worker`` is served weights; its engine sleeps through our steps when it is on our GPUs."""
        if set(worker_gpus) & set(trainer_gpus):
            self.sharing.add(worker)

    def drop(self, worker: str) -> None:
        self.sharing.discard(worker)

    def may_build(self, worker: str, msg: MayBuildEngine, weights_travel: bool) -> BuildTurn:
        """Let a worker build its engine on our GPU only while no step uses the GPU, no weights are being handed
        over (``weights_travel``) and no other engine is being built (two profiling at once would each count the
        other's memory); refused, it keeps its place, so that the next step waits for it instead of leaving it no
        moment between steps to start in."""
        if msg.host != self.host or not self.visible & set(msg.gpus):
            return BuildTurn(granted=True)
        now = trio.current_time()
        if self.busy or weights_travel or set(self.builds) - {worker}:
            self.queued[worker] = now + BUILD_TURN_KEPT_S
            return BuildTurn(granted=False)
        self.queued.pop(worker, None)
        self.builds[worker] = now + ENGINE_BUILD_S
        self.engine.release_memory()  # what the last step cached is free memory to the engine's profile
        self.actor.log.info("an engine is built on our GPU: training waits for it", worker=worker)
        return BuildTurn(granted=True)

    def built(self, worker: str) -> None:
        """``worker`` no longer holds back training: its engine is built (it asked for weights: WantWeights),
        or it is gone."""
        if (self.builds.pop(worker, None), self.queued.pop(worker, None)) != (None, None):
            self.changed.notify()

    def release(self) -> None:
        """Until the step has its batch, an engine may be built on our GPU."""
        self.busy = False

    async def take(self) -> float:
        """Wait until no engine is being built on our GPU or waits for its turn to be, then keep the GPU until
        the step is over; a worker silent past its deadline is given up on (the driver reports a dead one).
        Returns the seconds waited."""
        started = time.perf_counter()
        while True:
            now = trio.current_time()
            for waiting in (self.builds, self.queued):
                for worker, deadline in list(waiting.items()):
                    if deadline < now:
                        self.actor.log.warning("an engine took too long to build: training beside it", worker=worker)
                        del waiting[worker]
            if not (self.builds or self.queued):
                break
            with trio.move_on_after(1.0):
                await self.changed.wait()
        self.busy = True
        return time.perf_counter() - started

    async def sleep_engines(self, workers: set[str], version: int) -> float | None:
        """With vLLM's sleep mode, the engines of ``workers`` on our GPU finish their running responses and give
        their memory back while we train (the weights published next, newer than ``version``, wake them).
        Returns the longest time an engine took to finish its responses, or None when none sleeps. One that
        cannot sleep stays awake, with a warning: training may then run short of memory."""
        sleepers = sorted(workers & self.sharing)
        if not (sleepers and self.run.rollout.sleep_mode):
            return None
        drains = [0.0]

        async def put_to_sleep(worker: str) -> None:
            try:
                answer = await self.actor.ask(worker, SleepEngine(level=2, version=version), timeout=600.0)
                drains.append(answer.drain_s)
            except (PeerGone, LookupError):
                self.forget(worker)
            except (RemoteError, TimeoutError) as err:
                self.actor.log.warning("a colocated engine did not go to sleep: training beside it (if memory runs "
                                       "out, lower --vllm-gpu-memory-utilization)", worker=worker, error=str(err))

        async with trio.open_nursery() as nursery:
            for worker in sleepers:
                nursery.start_soon(put_to_sleep, worker)
        return max(drains)


# ----------------------------------------------------------- rollout worker


async def wait_for_build_turn(actor: Actor) -> None:
    """Build the engine only once the trainer lets us (MayBuildEngine); with no trainer, nothing trains."""
    ask = MayBuildEngine(host=os.uname().nodename, gpus=visible_gpus())
    with contextlib.suppress(PeerGone, LookupError):
        while not (await actor.ask("trainer", ask, timeout=BUILD_TURN_ASK_S)).granted:
            await trio.sleep(BUILD_TURN_RETRY_S)
    actor.log.info("building the engine")


class EngineSleep:
    """A rollout worker's engine, put to sleep by the trainer on its GPU. ``stepped`` is notified after every
    engine step; ``between_steps(fn, *args)`` has the generation loop run ``fn`` between two steps; ``wake``
    wakes that loop. While :attr:`draining`, and while the engine sleeps, the worker starts nothing new."""

    def __init__(self, engine: RolloutEngine, stepped: Changed, between_steps: Callable[..., Awaitable[None]],
                 wake: Callable[[], None]) -> None:
        self.engine, self.stepped, self.between_steps, self.wake = engine, stepped, between_steps, wake
        self.draining = False  # finishing the running responses before the engine sleeps

    @property
    def holds_starts(self) -> bool:
        """Nothing new may start: the GPU is the trainer's until the next weights, or is about to be."""
        return self.draining or self.engine.asleep

    async def sleep(self, msg: SleepEngine) -> EngineAsleep:
        """The trainer on our GPU is about to train: let the running responses finish, start nothing new, and
        sleep until its next weights."""
        started = time.monotonic()
        self.draining = True
        try:
            await self.stepped.until(lambda: not self.engine.busy)
            drained = time.monotonic() - started
            await self.between_steps(self._sleep, msg.level, msg.version)
        finally:
            self.draining = False
            self.wake()  # groups that came while it drained start now if it did not sleep after all
        return EngineAsleep(drain_s=drained)

    def _sleep(self, level: int, version: int) -> None:
        """Weights newer than the trainer's when it asked came after it stopped waiting for us: generate with
        them rather than sleep through the step they belong to."""
        if self.engine.weight_version <= version:
            self.engine.sleep(level)
