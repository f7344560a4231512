"""The actor runtime: an inbox, handlers by message kind, tell and ask.

An :class:`Actor` subclass declares handlers with :func:`handles`; each
receives the payload record and its envelope and may return a record, which
goes back as the reply when the sender asked. Messages are handled one at a
time, in arrival order, so an actor's state needs no locks -- and a run can be
replayed from its message log (``vime.replay``).

Failure semantics, in one place:

* A frame that is not vime (garbage, truncated), a message of an unknown kind,
  one that does not match its schema, or one over ``max_message_bytes`` is
  logged, counted under ``errors`` in the actor's status, and answered with
  :class:`ErrorReply` when the sender asked. The actor keeps serving; messages
  it already accepted are untouched.
* A handler that raises is logged and counted; the asker gets ErrorReply and
  ``ask`` raises :class:`RemoteError` there.
* ``ask`` raises :class:`TimeoutError` when no reply comes in time, and
  :class:`PeerGone` when the driver reports the peer dead meanwhile.

Backpressure: an actor's inbox holds at most ``inbox_capacity`` messages.
When it is full the actor stops reading its socket, the senders' outboxes
fill, and ``tell`` waits. Replies bypass the inbox, and while an ask is
pending the inbox may overflow, so a reply is never stuck behind a full one.

Concurrency: a loop an actor starts beside its handlers (``start_soon``) runs
between their awaits. Handlers and loops wait on each other through
:class:`Changed`, :class:`Wakeup` and :class:`BetweenSteps` (``vime.tasks``),
not through flags polled or events swapped by hand. A lock is needed only where
two tasks change the same state across an await (``vime.tasks`` says which).
Where such a loop decides something from the messages handled by then, it
calls :meth:`Actor.step_point` first, so that a replay decides the same.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import os
import random
import signal
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, ClassVar

import pynng
import structlog
import trio

from vime.inbound import UNRECORDED_KINDS, Inbound
from vime.messages.model_files import ModelFileChunk, ModelFileRead, ModelManifest, ModelManifestQuery
from vime.messages.runtime import (
    Directory,
    ErrorReply,
    Heartbeat,
    Register,
    SegmentsFree,
    Shutdown,
    Status,
    StatusQuery,
)
from vime.settings import setting
from vime.tasks import BetweenSteps, Changed, Wakeup  # noqa: F401 (the runtime's primitives)
from vime.transports.codec import Envelope, encode, encode_frame
from vime.transports.msglog import STEP, LogWriter
from vime.transports.shm import SegmentPool
from vime.transports.sockets import Inbox, Outbox, TlsFiles

# Runtime chatter that depends on wall-clock timers, the garbage collector or
# the transport (Status counts frames and sends, including the heartbeats and
# registration that replay skips), not on what the actor was sent; replay does
# not expect a fresh instance to reproduce it.
# A joined worker's model fetch (vime.model_files) too: whether it asks for the list of files and reads chunks
# depends on what its host holds, not on its messages (a replay has no driver to ask, and asks nothing).
UNREPLAYED_KINDS: frozenset[type] = frozenset({Heartbeat, Register, SegmentsFree, Status, ModelManifestQuery,
                                               ModelManifest, ModelFileRead, ModelFileChunk})


_MAX_STRANGERS = 16


class RemoteError(RuntimeError):
    """The peer answered an ask with ErrorReply."""

    def __init__(self, peer: str, reply: ErrorReply) -> None:
        super().__init__(f"{peer} answered {reply.kind or 'the message'} with {reply.reason}: {reply.error}")
        self.peer = peer
        self.reply = reply


class PeerGone(RuntimeError):
    """The peer died or left while we were waiting for its reply."""


class DriverSilent(TimeoutError):
    """The driver did not answer this actor's Register: a wrong address, or no job there. Only this
    timeout means that; a TimeoutError later in the actor's life is an error of its own."""


@dataclasses.dataclass(frozen=True)
class ActorSettings:
    """How one actor process runs; role-specific settings travel in ``config``. Each field is a flag of
    ``python -m vime.actor`` (``--inbox-capacity 64``; ``driver`` is ``--join``)."""

    name: str = setting(dataclasses.MISSING, "actor name, unique in the job (vime.actor: ROLE-RANDOM when not "
                                             "given)")
    listen: str = setting(dataclasses.MISSING, "address to listen on (vime.actor: tcp on the interface that "
                                               "reaches the driver when not given)")
    driver: str | None = setting(None, "the driver's address (ipc://..., tcp://HOST:PORT, tls+tcp://HOST:PORT); "
                                       "none for the driver itself and in replay", flags=("--join",),
                                 metavar="ADDRESS")
    token: str | None = setting(None, "the job's join token (vime.actor: $VIME_TOKEN when not given); required by "
                                      "tcp jobs")
    run_dir: str | None = setting(None, "the job's run folder (message logs go under it)")
    record: bool = setting(False, "write this actor's message log")
    seed: int = setting(0, "seeds this actor's rng and its engine; a training run's driver derives it from the "
                           "run's --seed (vime.seeds)")
    inbox_capacity: int = setting(1024, "messages the inbox holds before the actor stops reading its socket")
    outbox_capacity: int = setting(1024, "messages waiting for one peer before tell waits")
    max_message_bytes: int = setting(1 << 30, "a larger message is refused")
    heartbeat_s: float = setting(1.0, "seconds between heartbeats to the driver")
    spin_us: float = setting(400.0, "poll this long for the next frame before parking (0: never poll)")
    shm_threshold: int = setting(1 << 20, "to an actor on this host, tensors of this many bytes or more go "
                                          "through shared memory")
    tls_cert_key: str | None = setting(None, "PEM with our certificate and key (tls+tcp)")
    tls_ca: str | None = setting(None, "PEM of the CA that signs the job's certificates")
    model_path: str | None = setting(None, "a joined actor: this host's copy of the job's model folder, checked "
                                           "against the head's (sha256 of every file); not given: the head's "
                                           "--model-path when this host has it, else fetched from the driver into "
                                           "--model-cache", metavar="DIR")
    model_cache: str | None = setting(None, "a joined actor: where models fetched from the driver are kept, one "
                                            "folder per model contents, never evicted; not given: "
                                            "$VIME_MODEL_CACHE, else $XDG_CACHE_HOME/vime/models, else "
                                            "~/.cache/vime/models", metavar="DIR")
    model_fetch_timeout_s: float = setting(60.0, "a joined actor fetching the model: seconds to wait for each chunk "
                                                 "(16 MiB) before giving up on the driver")
    node: str | None = setting(None, "set by the node agent (vime.node) that started this actor: it runs on that "
                                     "node, not on the driver's host (its model folder is checked, or fetched)")
    parent_pid: int | None = setting(None, "shut down when the driver that spawned us (process PID; 0 or no PID: "
                                           "our parent at start) is gone; a driver that dies before we start is "
                                           "noticed too when PID is given", flags=("--exit-with-parent",),
                                     metavar="PID", const=0)

    @property
    def tls(self) -> TlsFiles | None:
        if self.tls_cert_key and self.tls_ca:
            return TlsFiles(self.tls_cert_key, self.tls_ca)
        return None


def handles(*kinds: type) -> Callable[[Callable], Callable]:
    """Mark an ``async def handler(self, msg, envelope)`` method as the handler of ``kinds``."""

    def mark(fn: Callable) -> Callable:
        fn.__vime_handles__ = kinds
        return fn

    return mark


class _PendingAsk:
    """One ask waiting for its answer. The Event is made only if the asker has
    to park: most local replies arrive while it polls."""

    __slots__ = ("peer", "kind", "reply", "error", "done", "_event")

    def __init__(self, peer: str, kind: str) -> None:
        self.peer = peer
        self.kind = kind
        self.reply: Envelope | None = None
        self.error: Exception | None = None
        self.done = False
        self._event: trio.Event | None = None

    def finish(self, reply: Envelope | None = None, error: Exception | None = None) -> None:
        self.reply, self.error, self.done = reply, error, True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if not self.done:
            self._event = trio.Event()
            await self._event.wait()


class Actor(Inbound):
    """Base of every vime actor. Subclasses set ``role`` and write handlers.

    Hooks: ``on_start`` runs once the actor is registered and before the
    first message is handled; ``on_stop`` runs on shutdown after the last one.
    """

    role: ClassVar[str] = "actor"
    exit_code: int = 0  # ``python -m vime.actor`` exits with it once the actor has stopped
    _handlers: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table = {}
        for klass in reversed(cls.__mro__):
            for attr, fn in vars(klass).items():
                for kind in getattr(fn, "__vime_handles__", ()):
                    table[kind.__name__] = attr
        cls._handlers = table

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.name = settings.name
        self.config = dict(config or {})
        self.rng = random.Random(settings.seed)
        self.log = structlog.get_logger().bind(role=self.role, actor=self.name)
        self.counters: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.startup: dict[str, float] = {}  # phase -> seconds, timed by on_start (vime.startup.timed); in Status
        self.directory: dict[str, str] = {}
        self.address = settings.listen
        self._ids = itertools.count(1)
        self._pending: dict[int, _PendingAsk] = {}
        self._queue: collections.deque[tuple[Envelope, float]] = collections.deque()
        self._queue_ready = trio.lowlevel.ParkingLot()
        self._queue_space = trio.lowlevel.ParkingLot()
        self._directory_changed = trio.lowlevel.ParkingLot()
        self._outboxes: dict[str, Outbox] = {}
        self._learned: dict[str, str] = {}  # names seen on frames -> their reply address
        self._handling_time: float | None = None
        self._busy = False
        self._fast_paths = 0
        self._nursery: trio.Nursery | None = None
        self._stopping = trio.Event()
        self._serving = False  # on_start has finished
        self._inbox: Inbox | None = None
        self._segments = SegmentPool()
        self._lenders: dict[str, Callable[[memoryview], str]] = {}
        self._released: collections.deque[tuple[str, str]] = collections.deque()  # (owner, segment); thread-safe
        self._release_ready = trio.lowlevel.ParkingLot()
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._log_writer: LogWriter | None = None
        self._send_hook: Callable[[Envelope], None] | None = None  # replay captures sends here
        self.step_gate: Callable[[], Awaitable[None]] | None = None  # set by a replay: see step_point
        self._strangers: collections.OrderedDict[str, None] = collections.OrderedDict()  # see _reply_error

    # ----------------------------------------------------------------- public

    def now(self) -> float:
        """Arrival time of the message being handled (wall clock elsewhere).

        Handlers that need the time use this, not ``time.time()``, so that a
        replay sees exactly the clock the live run saw.
        """
        return self._handling_time if self._handling_time is not None else time.time()

    async def step_point(self) -> None:
        """A point of an actor's own loop (not a handler) where what it does next depends on the messages handled
        by now, which timing decides (a rollout worker choosing which groups its engine starts): a recorded actor
        marks it in its log, and a replayed one waits here (``step_gate``, set by ``vime.replay``) until the
        replay reaches the same mark with as many messages handled. Mark only points that do work: how often an
        idle loop wakes is timing too. Nothing the caller decides on may await between this and the decision."""
        if self._log_writer is not None:  # the messages whose handling had started: the replay starts as many
            dispatched = self.counters["handled"] + self.errors["handler"] + self._busy
            self._log_writer.write(STEP, "", b"", {}, {"dispatched": dispatched})
        if self.step_gate is not None:
            await self.step_gate()

    async def tell(self, to: str, payload: Any, *, weight_version: int | None = None) -> None:
        """Send ``payload`` to the actor named ``to`` without waiting for an answer.

        Returns once the message is queued for sending. It yields only when
        the outbox to that peer is full (backpressure) -- so a burst of tells
        is shipped in a few large frames.
        """
        await self._send(to, payload, weight_version=weight_version)

    async def tell_quietly(self, to: str, payload: Any) -> None:
        """:meth:`tell`, for news that no longer matters once ``to`` is gone (dead, its node lost, never in the
        directory): then nothing is sent and nothing raised."""
        with contextlib.suppress(LookupError, PeerGone):
            await self.tell(to, payload)

    async def ask(self, to: str, payload: Any, *, timeout: float = 30.0, weight_version: int | None = None) -> Any:
        """Send ``payload`` and wait for the reply record.

        Raises TimeoutError after ``timeout`` s, RemoteError when the peer
        answered with an error, PeerGone when the peer died meanwhile. On
        cancellation the reply, if it still comes, is dropped and counted.
        """
        msg_id = next(self._ids)
        pending = self._pending[msg_id] = _PendingAsk(to, type(payload).__name__)
        try:
            await self._send(to, payload, weight_version=weight_version, msg_id=msg_id, wants_reply=True)
            self._poll_for(lambda: pending.done)
            if pending.done:
                await self._yield_now_and_then()  # the reply is in hand: a full yield is rarely worth it
            else:
                with trio.move_on_after(timeout):
                    await pending.wait()
        finally:
            del self._pending[msg_id]
        if pending.error is not None:
            raise pending.error
        if pending.reply is None:
            raise TimeoutError(
                f"{self.name}: no reply from {to} to {pending.kind} within {timeout} s; "
                f"is it alive and not overloaded? (see actors.json and its log)"
            )
        if isinstance(pending.reply.payload, ErrorReply):
            raise RemoteError(to, pending.reply.payload)
        return pending.reply.payload

    async def _yield_now_and_then(self) -> None:
        """Let other tasks run every 16th call, else only honour cancellation.

        Polling hands frames straight to the waiting task, so a busy
        conversation may never park; without this, timers (heartbeats) and
        signal handling would starve while it lasts.
        """
        self._fast_paths += 1
        if self._fast_paths % 16:
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            await trio.lowlevel.checkpoint()

    def _poll_for(self, done: Callable[[], bool]) -> None:
        """Poll the socket for up to ``spin_us`` until ``done()``, instead of parking.

        Used by an ask waiting for its reply and by the handler loop waiting
        for the next request: in a conversation the next frame usually lands
        within tens of microseconds, while parking and being woken through
        epoll plus a task switch costs as much again. Polling happens in the
        waiting task itself (no hop), only while no other task is runnable,
        and yields the CPU between polls (see ``Inbox.poll``).
        """
        if self._inbox is None or not self.settings.spin_us:
            return
        deadline = time.perf_counter() + self.settings.spin_us * 1e-6
        while not done() and (remaining := deadline - time.perf_counter()) > 0:
            buffer = self._inbox.poll(remaining)
            if buffer is None:
                return
            self._accept_frame(buffer, time.time())

    def status(self) -> Status:
        return Status(
            name=self.name,
            role=self.role,
            counters={**self.counters, "segments_lent": self._segments.lent, "outboxes": len(self._outboxes)},
            errors=dict(self.errors),
            inbox_depth=len(self._queue),
            pending_asks=len(self._pending),
            startup=dict(self.startup),
        )

    def stop(self) -> None:
        """Ask the actor to shut down gracefully (as SIGTERM does)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """The actor was told to stop (``stop()``, SIGINT/SIGTERM, Shutdown). Long work in ``on_start``, which
        a stop does not interrupt, checks it between steps and gives up."""
        return self._stopping.is_set()

    async def wait_stopping(self) -> None:
        """Return once the actor is told to stop: long work in ``on_start`` races it, so that a stop is not
        held up by an ask in flight (whose reply may never come once the actor's sockets close)."""
        await self._stopping.wait()

    def unsent_to(self, name: str) -> int:
        """Messages queued for ``name`` that have not been handed to its socket yet (0 when we have none for it):
        how far behind the peer is in taking what we send it."""
        try:
            outbox = self._outboxes.get(self._address_of(name))
        except LookupError:
            return 0
        return outbox.queued if outbox is not None else 0

    def on_arrival(self, envelope: Envelope) -> bool:
        """Take a message as it arrives, before it waits in the queue behind the handler in hand; True when
        taken (it is then not handled). For bookkeeping that must not wait -- the driver stamps heartbeats so,
        since a handler that takes seconds would make a live actor look dead -- never for work: it runs inside
        the receive loop and must not block."""
        return False

    async def on_start(self) -> None:
        """Runs after registration, before the first message is handled."""

    async def on_stop(self) -> None:
        """Runs on shutdown, after the last message was handled."""

    async def on_peer_gone(self, name: str) -> None:
        """Runs, as part of handling the driver's Directory, for each actor that left or died.

        Asks waiting on it have already failed with PeerGone.
        """

    async def wait_for_peer(self, name: str, timeout: float = 60.0) -> None:
        """Return once ``name`` is in the directory (actors of a job start one by one).

        Raises TimeoutError, naming the actors that are known, after ``timeout`` s.
        """
        with trio.move_on_after(timeout):
            while name not in self.directory:
                await self._directory_changed.park()
        if name not in self.directory:
            raise TimeoutError(f"{self.name}: no actor named {name!r} joined within {timeout} s; "
                               f"known: {sorted(self.directory)}")

    def crash(self, error: BaseException) -> None:
        """Stop this actor with ``error``, for failures that make going on pointless
        (a reward function that cannot score). The process exits non-zero with the
        traceback in its log, and the driver reports the death like any other.
        """

        async def fail() -> None:
            raise error

        self.start_soon(fail)

    def start_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` beside the handler loop, for work that outlives one message
        (a generation loop, a training loop). It is cancelled when the actor stops;
        if it raises, the actor stops with that error -- a bug should not go quiet.
        """
        assert self._nursery is not None, "start_soon is for a serving actor (on_start or a handler)"
        self._nursery.start_soon(fn, *args)

    # ------------------------------------------------------------ built-ins

    @handles(StatusQuery)
    async def _on_status(self, msg: StatusQuery, envelope: Envelope) -> Status:
        return self.status()

    @handles(Directory)
    async def _on_directory(self, msg: Directory, envelope: Envelope) -> None:
        for name in self._set_directory(msg.addresses):
            await self.on_peer_gone(name)

    @handles(Shutdown)
    async def _on_shutdown(self, msg: Shutdown, envelope: Envelope) -> None:
        self.log.info("shutdown requested", by=envelope.sender, reason=msg.reason)
        self._stopping.set()

    # -------------------------------------------------------------- serving

    async def serve(self, *, handle_signals: bool = True,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, register with the driver, and handle messages until stopped.

        Stops on Shutdown, SIGINT/SIGTERM (in the main thread) or ``stop()``:
        the message in hand is finished, ``on_stop`` runs, queued outgoing
        messages get up to two seconds to leave, then the sockets close.
        """
        settings = self.settings
        self._inbox = Inbox(settings.listen, max_frame_bytes=4 * settings.max_message_bytes + (16 << 20),
                            tls=settings.tls)
        self.address = self._inbox.address
        if settings.record:
            self._open_log()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if handle_signals:
                    await nursery.start(self._watch_signals)
                self._trio_token = trio.lowlevel.current_trio_token()
                nursery.start_soon(self._receive_loop)
                nursery.start_soon(self._release_loop)
                if settings.parent_pid is not None:
                    nursery.start_soon(self._watch_parent)
                if settings.driver is not None:
                    await self._register()
                    nursery.start_soon(self._heartbeat_loop)
                await self.on_start()
                self._serving = True
                nursery.start_soon(self._handle_loop)
                task_status.started()
                await self._stopping.wait()
                await self._drain_and_stop()
                nursery.cancel_scope.cancel()
        finally:
            self._close()

    async def _drain_and_stop(self) -> None:
        await self.on_stop()
        with trio.move_on_after(2.0):
            while any(outbox.queued for outbox in self._outboxes.values()):
                await trio.sleep(0.01)

    def _close(self) -> None:
        for outbox in self._outboxes.values():
            outbox.close()
        if self._inbox is not None:
            self._inbox.close()
        self._segments.close()
        if self._log_writer is not None:
            self._log_writer.close()

    async def _watch_signals(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Turn SIGINT/SIGTERM into a graceful stop; installed before registering,
        so a signal during start-up is not a traceback."""
        try:
            receiver = trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
        except RuntimeError:  # not the main thread: the embedding program handles signals
            task_status.started()
            return
        with receiver as signals:
            task_status.started()
            async for signum in signals:
                self.log.info("signal received; shutting down", signal=signal.Signals(signum).name)
                self._stopping.set()
                return

    async def _register(self) -> None:
        register = Register(name=self.name, role=self.role, address=self.address, pid=os.getpid(),
                            host=os.uname().nodename)
        try:
            reply = await self.ask("driver", register, timeout=self._register_timeout_s())
        except TimeoutError as err:
            raise DriverSilent(str(err)) from err
        self._set_directory(reply.directory)
        self.run_id = reply.run_id
        if not self.config and reply.config:  # joined by hand: the job's settings come from the driver
            self.config = dict(reply.config)

    def _register_timeout_s(self) -> float:
        """How long to wait for the driver's answer to Register. A hand-joined actor may have the wrong address:
        30 s, then it says so. One the driver spawned knows the driver is there (and stops at once if it dies),
        so it waits out a slow answer: the driver counts it in as the Register arrives, but the reply travels a
        connection dialled back to this actor (a TLS handshake, on a machine busy starting five Pythons), and an
        actor that gave up then left a job that had counted it in. (A TLS run's buffer that waited out even
        300 s had a listener broken by its RSA key, which ``TlsFiles`` now refuses.)"""
        return 30.0 if self.settings.parent_pid is None else 300.0

    async def _heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(self.settings.heartbeat_s)
            await self.tell("driver", Heartbeat(name=self.name, status=dataclasses.asdict(self.status())))

    async def _watch_parent(self) -> None:
        """Stop once the driver that spawned this actor is gone (``--exit-with-parent``): gracefully when
        serving, at once while still starting -- a driver killed mid-registration never answers it.

        One of three watches of a parent, each for what the others cannot do: this one stops the actor the
        way a Shutdown does (``on_stop`` runs), from its own loop; ``vime.actor``'s thread is the backstop for
        a loop that never gets there (blocked, or not started yet); a trainer's follower rank, which has no
        loop to stop, ends at once (``vime.backends.tensor_parallel``)."""
        while os.getppid() == self.settings.parent_pid:
            await trio.sleep(self.settings.heartbeat_s)
        self.log.error("the driver that started this actor is gone; shutting down", driver_pid=self.settings.parent_pid)
        outbox = self._outboxes.pop(self.settings.driver or "", None)
        if outbox is not None:  # what is queued for a dead driver never leaves: do not wait for it
            outbox.close()
        if self._serving:
            self._stopping.set()
        else:
            self._nursery.cancel_scope.cancel()

    def _set_directory(self, addresses: dict[str, str]) -> list[str]:
        """Adopt the driver's directory; returns the names that left it."""
        gone = sorted(n for n in self.directory if n not in addresses)
        self.directory = dict(addresses)
        self._directory_changed.unpark_all()
        for name in gone:
            self._peer_gone(name)
        return gone

    def _peer_gone(self, name: str) -> None:
        """Fail asks waiting on a dead peer and drop what was queued for it."""
        for pending in self._pending.values():
            if pending.peer == name and not pending.done:
                pending.finish(error=PeerGone(f"{name} left or died before answering {pending.kind}"))
        self._segments.reclaim(name)
        self._lenders.pop(name, None)
        address = self._learned.pop(name, None)
        if address in self._outboxes and address not in self.directory.values():
            self._outboxes.pop(address).close()

    # -------------------------------------------------------------- sending

    def _address_of(self, name: str) -> str:
        if name == "driver" and self.settings.driver is not None:
            return self.settings.driver
        address = self.directory.get(name) or self._learned.get(name)
        if address is None:
            raise LookupError(f"{self.name}: no actor named {name!r} is known; known: {sorted(self.directory)}")
        return address

    async def _send(self, to: str, payload: Any, *, weight_version: int | None, msg_id: int | None = None,
                    wants_reply: bool = False, reply_to: int | None = None, address: str | None = None) -> None:
        """Encode and queue one message; ``address`` overrides the lookup of ``to``.

        A reply to a stranger (an error reply to a frame's own reply address, or a peer that is not in the
        directory) never waits for room: a peer that never reads would otherwise stall the handler loop, or
        pile up one waiting task per bad frame. When its outbox is full it is dropped and counted.
        """
        stranger = reply_to is not None and (address is not None or (to not in self.directory and to != "driver"))
        envelope = Envelope(type(payload).__name__, self.name, to, msg_id if msg_id is not None else next(self._ids),
                            reply_to, self.now(), weight_version, wants_reply, payload)
        if self._send_hook is not None:
            self._send_hook(envelope)
            return
        if self._released and type(payload) is not SegmentsFree:
            await self._give_segments_back()  # so a sender learns of freed segments before our reply
        address = address or self._address_of(to)
        same_host = address.startswith("ipc://")
        encoded = encode(envelope, self._lender(to) if same_host else None, self.settings.shm_threshold)
        if self._log_writer is not None and type(payload) not in UNRECORDED_KINDS:
            self._log_writer.write("out", to, encode_frame(self.address, None, [encoded]), dict(encoded.shm))
        self.counters["sent"] += 1
        outbox = self._outbox(address)
        if not ((wants_reply or reply_to is not None) and outbox.send_now(encoded)):
            try:
                if stranger:
                    outbox.put_nowait(encoded)
                else:
                    await outbox.put(encoded)
            except trio.WouldBlock:
                self.counters["replies_dropped"] += 1
            except trio.ClosedResourceError:
                raise PeerGone(f"{to} left or died before {envelope.kind} could be sent") from None

    def _lender(self, borrower: str) -> Callable[[memoryview], str]:
        """The shared-memory writer for one peer (cached: one is built per peer, not per send)."""
        lender = self._lenders.get(borrower)
        if lender is None:
            lender = self._lenders[borrower] = functools.partial(self._segments.lend, borrower=borrower)
        return lender

    def _outbox(self, address: str) -> Outbox:
        outbox = self._outboxes.get(address)
        if outbox is None:
            outbox = Outbox(address, self.address, self.settings.token, capacity=self.settings.outbox_capacity,
                            tls=self.settings.tls)
            self._outboxes[address] = outbox
            assert self._nursery is not None, "actor is not serving yet"
            self._nursery.start_soon(outbox.pump)
        return outbox

    # ------------------------------------------------------------ replies to bad input, segments back

    async def _give_segments_back(self) -> None:
        """Tell each sender which of its segments we no longer view."""
        by_owner: dict[str, list[str]] = {}
        while self._released:
            owner, name = self._released.popleft()
            by_owner.setdefault(owner, []).append(name)
        for owner, names in by_owner.items():
            with contextlib.suppress(LookupError, PeerGone, pynng.NNGException):
                await self._send(owner, SegmentsFree(names=names), weight_version=None)

    async def _reply_error(self, to: str, msg_id: int, error: ErrorReply, address: str | None) -> None:
        """Answer bad input; a peer we cannot answer (bogus address) only gets logged.

        An address we have no socket to is a stranger's. Sockets to strangers
        are kept for the last ``_MAX_STRANGERS`` of them only (the oldest is
        closed when a new one comes), so a flood of bad frames with made-up
        reply addresses cannot make us open sockets without end.
        """
        if address and address not in self._outboxes:
            self._strangers[address] = None
            while len(self._strangers) > _MAX_STRANGERS:
                oldest, _ = self._strangers.popitem(last=False)
                if oldest not in self._learned.values() and oldest not in self.directory.values():
                    outbox = self._outboxes.pop(oldest, None)
                    if outbox is not None:
                        outbox.close()
        try:
            await self._send(to, error, weight_version=None, reply_to=msg_id, address=address or None)
        except (LookupError, PeerGone, pynng.NNGException, ValueError) as err:  # ValueError: an address we cannot dial
            self.log.warning("could not send an error reply", to=to, error=str(err))

    async def _handle_loop(self) -> None:
        while True:
            if not self._queue:
                self._poll_for(lambda: bool(self._queue))
            while not self._queue:
                await self._queue_ready.park()
            self._queue_space.unpark()
            self._busy = True
            try:
                # No local keeps the envelope: _dispatch must be able to drop the last reference.
                await self._dispatch(*self._queue.popleft())
            finally:
                self._busy = False
            await self._yield_now_and_then()

    async def _dispatch(self, envelope: Envelope, arrived: float) -> None:
        handler = getattr(self, self._handlers[envelope.kind])
        kind, sender, msg_id, wants_reply = envelope.kind, envelope.sender, envelope.id, envelope.wants_reply
        self._handling_time = arrived
        try:
            try:
                reply = await handler(envelope.payload, envelope)
                self.counters["handled"] += 1
            except Exception as err:
                self.errors["handler"] += 1
                self.log.exception("handler failed", kind=kind, sender=sender)
                reply = ErrorReply(reason="handler", error=f"{type(err).__name__}: {err}", kind=kind)
            # Dropping the request now frees the shared memory its tensors viewed,
            # so the sender hears SegmentsFree before it hears the reply.
            del envelope
            if wants_reply:
                if reply is None:
                    reply = ErrorReply(reason="no-reply", kind=kind,
                                       error=f"{self.role} handled {kind} but returned no answer")
                await self._send(sender, reply, weight_version=None, reply_to=msg_id)
        finally:
            self._handling_time = None

    # --------------------------------------------------------------- logging

    def _open_log(self) -> None:
        run_dir = Path(self.settings.run_dir or ".")
        opening = {"name": self.name, "role": self.role, "config": self.config,
                   "settings": dataclasses.asdict(dataclasses.replace(self.settings, token=None)), "pid": os.getpid()}
        self._log_writer = LogWriter(run_dir / "messages" / f"{self.name}.vlog", opening)
