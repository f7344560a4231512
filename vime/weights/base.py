"""The weight-path interface, both halves, and what every path shares: choosing one, falling back to nng.

A path (:class:`WeightPath`) is one class in a module of its own. One instance of it serves one actor:
the trainer's serves the sender half through :class:`WeightSender`, a rollout worker's the receiver half
through :class:`WeightReceiver`. A path subclass registers itself (:data:`PATHS`) by being defined.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal

import torch

from vime.backends.hf import DTYPES
from vime.runtime import Actor, PeerGone, RemoteError
from vime.transports.records import message

if TYPE_CHECKING:
    from vime.backends.base import RolloutEngine, TrainEngine
    from vime.config import RunConfig

PATHS: dict[str, type[WeightPath]] = {}  # --weight-sync name -> path, every path module's class once imported

Gathered = Literal["host", "device"]  # where a path needs the gathered weights


@message
class WantWeights:
    """rollout worker -> trainer (ask, answered with WeightsComing), once its engine is built (at start, after a
    restart, on joining): choose my weight path from the GPUs my engine is on, send me the newest version if I
    lack it and every later one."""

    weight_version: int  # the version its engine holds
    gpus: list[str]  # UUIDs of its engine's GPUs; empty on CPU


@message
class WeightsComing:
    """trainer -> the worker that asked WantWeights: ``version`` is the newest it is being sent (by its path); it
    asks the router for work once it holds that."""

    version: int


class WeightPath(abc.ABC):
    """One way the weights of a version travel from the trainer to a rollout worker, both halves.

    The sender half (the trainer's instance, ``self.sender``) attaches a worker, sends a version to workers
    and detaches one; the receiver half (a worker's instance, ``self.receiver``) handles the path's message
    kinds (``kinds``) and has the engine load what they bring between two of its steps. The control messages
    always travel over nng; the bytes, by the path."""

    name: ClassVar[str]  # its --weight-sync value, and the ``path`` of the trainer's "weight path" log event
    kinds: ClassVar[tuple[type, ...]] = ()  # the messages its receiver half handles
    priority: ClassVar[int] = 0  # --weight-sync auto takes the highest-priority path that suits the placement
    everywhere: ClassVar[bool] = False  # reaches any worker: the fallback when another path fails
    together: ClassVar[bool] = False  # sends to all its workers at once, reading the engine itself

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        PATHS[cls.name] = cls

    def __init__(self, sender: WeightSender | None = None, receiver: WeightReceiver | None = None) -> None:
        self.sender, self.receiver = sender, receiver

    @staticmethod
    @abc.abstractmethod
    def suits(ours: set[str], theirs: set[str]) -> bool:
        """Whether --weight-sync auto may take this path from a trainer on GPUs ``ours`` to an engine on
        ``theirs`` (UUIDs; empty: CPU)."""

    @staticmethod
    def refuses(ours: set[str], theirs: set[str]) -> str | None:
        """Why --weight-sync NAME cannot take this path for that placement (what it needs), or None."""
        return None

    # The sender half.

    async def attach(self, worker: str, gpus: list[str]) -> bool:
        """Set up the path to ``worker`` (its engine on ``gpus``) outside the weights lock; False when it cannot
        be (the worker's weights then go over the fallback path)."""
        return True

    def detach(self, worker: str) -> None:
        """Forget what the path holds for ``worker`` (gone, or moved to another path)."""

    def wants(self) -> Gathered | None:
        """Where this path needs the gathered weights of the current version (:meth:`WeightSender.outgoing`);
        None when it needs none (it reads the engine itself, or has what it needs already)."""
        return "device"

    @abc.abstractmethod
    async def send(self, workers: list[str], tensors: dict[str, torch.Tensor]) -> list[str]:
        """The current version to ``workers`` (one, unless ``together``); returns once they hold it or it is
        queued. Returns the workers whose load failed, to be served by the fallback path; a worker gone
        meanwhile raises PeerGone or LookupError, or (``together``) is forgotten (:meth:`WeightSender.gone`)."""

    # The receiver half.

    @abc.abstractmethod
    async def receive(self, msg: Any) -> Any:
        """Handle one of ``kinds``; the answer to an ask, or None."""


class WeightSender:
    """The trainer's half of every path: which path serves each worker, a version published to all of them,
    and the fallback to nng when a GPU path fails. ``gone`` is called with a worker found gone meanwhile."""

    def __init__(self, actor: Actor, engine: TrainEngine, run: RunConfig, gone: Callable[[str], None]) -> None:
        self.actor, self.engine, self.run, self.gone = actor, engine, run, gone
        self.halves = {path: path(sender=self) for path in PATHS.values()}
        self.fallback = next(path for path in PATHS.values() if path.everywhere)
        self.paths: dict[str, type[WeightPath]] = {}  # worker -> its path

    def choose(self, trainer_gpus: list[str], worker_gpus: list[str]) -> type[WeightPath]:
        """The path for a worker on ``worker_gpus`` under the run's ``--weight-sync`` (see :func:`choose`)."""
        return choose(self.run.job.weight_sync, trainer_gpus, worker_gpus)

    def half(self, path: type[WeightPath]) -> WeightPath:
        """This trainer's instance of ``path``."""
        return self.halves[path]

    async def attach(self, worker: str, path: type[WeightPath], gpus: list[str]) -> type[WeightPath]:
        """Set up ``path`` to ``worker`` (detached); the path it gets (the fallback when ``path`` cannot be set
        up). Call :meth:`serve` under the weights lock to start serving it."""
        return path if await self.halves[path].attach(worker, gpus) else self.fallback

    def serve(self, worker: str, path: type[WeightPath]) -> None:
        """Send ``worker`` every version from now on by ``path`` (attached)."""
        self.paths[worker] = path

    def serves(self, worker: str) -> bool:
        """Whether ``worker`` is served (not detached since, gone say)."""
        return worker in self.paths

    def detach(self, worker: str) -> None:
        """Stop serving ``worker``; every path forgets it, also one attached but not yet served (a broadcast
        group formed for a worker that died, or asked again, before it was served must not be sent to)."""
        self.paths.pop(worker, None)
        for half in self.halves.values():
            half.detach(worker)

    def fall_back(self, worker: str) -> None:
        """``worker``'s weights go over the fallback path from now on; a LookupError when it is no longer
        served (forgotten meanwhile: it is not brought back)."""
        if worker not in self.paths:
            raise LookupError(f"{worker} is no longer served")
        failed = self.paths[worker]
        self.detach(worker)
        self.paths[worker] = self.fallback
        self.actor.log.info("weight path", worker=worker, path=self.fallback.name, instead_of=failed.name)

    def outgoing(self, host: bool) -> dict[str, torch.Tensor]:
        """The weights as rollout engines load them (:meth:`TrainEngine.rollout_weights`), on the trainer's
        device, or on the host (``host``) when every path to serve goes through it: a tensor-parallel trainer,
        which gathers each tensor whole, then holds one at a time on its GPU instead of the whole model."""
        return dict(self.engine.rollout_weights(DTYPES[self.run.model.dtype], "cpu" if host else None))

    async def publish(self, workers: list[str]) -> None:
        """The current version to each of ``workers`` by its path: first the paths that send to all their
        workers at once, then a gather of the weights for the others (once, on the host when none needs
        them on the device) and each of those in turn. A worker whose GPU path fails (its load raised, or it
        did not answer) gets the version over the fallback path instead, and every later one."""
        together = [path for path in dict.fromkeys(self.paths[worker] for worker in workers) if path.together]
        rest = [worker for worker in workers if not self.paths[worker].together]
        for path in together:
            for worker in await self.halves[path].send([w for w in workers if self.paths[w] is path], {}):
                if self.serves(worker):
                    self.fall_back(worker)
                    rest.append(worker)
        wanted = [where for worker in rest if (where := self.halves[self.paths[worker]].wants()) is not None]
        tensors = self.outgoing(all(where == "host" for where in wanted)) if wanted else {}
        for worker in rest:
            try:
                await self._deliver(worker, tensors)
            except (PeerGone, LookupError):
                self.gone(worker)

    async def _deliver(self, worker: str, tensors: dict[str, torch.Tensor]) -> None:
        path = self.paths[worker]
        try:
            failed = await self.halves[path].send([worker], tensors)
        except (RemoteError, TimeoutError) as err:
            if path.everywhere:
                raise
            self.actor.log.warning("weight path failed: this worker's weights go over nng from now on",
                                   worker=worker, path=path.name, error=str(err))
            failed = [worker]
        if failed:
            self.fall_back(worker)
            await self.halves[self.fallback].send([worker], tensors)


class WeightReceiver:
    """A rollout worker's half of every path. ``between_steps(fn, *args)`` has the generation loop run ``fn``
    between two engine steps and returns once it has; ``wake`` wakes the loop."""

    def __init__(self, engine: RolloutEngine, between_steps: Callable[..., Any], wake: Callable[[], None]) -> None:
        self.engine, self.between_steps, self.wake = engine, between_steps, wake
        self.halves = {kind: path(receiver=self) for path in PATHS.values() for kind in path.kinds}
        self.complete: tuple[int, dict[str, torch.Tensor]] | None = None  # newest full set not yet applied
        self.loading: int | None = None  # the version whose buckets are arriving: the engine must not step

    async def receive(self, msg: Any) -> Any:
        """A message of any path's receiver half; its answer."""
        return await self.halves[type(msg)].receive(msg)

    def arrived(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """A full set of ``version``, to load between two steps (:meth:`apply`) unless a newer one comes first."""
        if self.complete is None or self.complete[0] < version:
            self.complete = (version, tensors)
        self.wake()

    def apply(self) -> bool:
        """Load the newest full set that arrived whole, if any (between two engine steps); whether it did. A
        full set also ends a bucketed update that failed halfway."""
        if self.complete is None:
            return False
        version, tensors = self.complete
        self.complete = self.loading = None
        self.engine.load_weights(tensors, version)
        return True


def choose(mode: str, trainer_gpus: list[str], worker_gpus: list[str]) -> type[WeightPath]:
    """The path weights take to a worker whose engine is on ``worker_gpus``, from a trainer on ``trainer_gpus``
    (UUIDs; empty: CPU), under ``--weight-sync mode``; a ValueError says what to pass when the placement does not
    allow the mode asked for."""
    ours, theirs = set(trainer_gpus), set(worker_gpus)
    if mode == "auto":
        return max((path for path in PATHS.values() if path.suits(ours, theirs)), key=lambda path: path.priority)
    path = PATHS[mode]
    needs = path.refuses(ours, theirs)
    if needs is not None:
        raise ValueError(f"--weight-sync {mode} needs {needs} (trainer: {trainer_gpus or 'CPU'}, engine: "
                         f"{worker_gpus or 'CPU'}); use --weight-sync auto")
    return path
