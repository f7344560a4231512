"""``python -m vime.replay LOG``: re-drive an actor from its message log.

A fresh instance of the logged actor (same role, config and seed, from the
log's opening record -- or, for a worker that joined by hand, from the
settings the driver answered its registration with) is fed every frame the
original received, in order and with the recorded arrival clock, while
nothing leaves the process. What it sends is compared with what the original
sent; the first difference is printed field by field and the exit status is
1, else "no divergence" and 0.

The log is walked in the order things happened: a frame is fed only once the
replayed actor has sent what the original had sent before that frame came,
so work an actor does beside its handlers (training in a thread, a rollout
worker's generation loop) meets the messages where it met them. A rollout
worker's log also marks each engine step; the replayed worker steps at the
same points, so its batches, and so its samples, are the original's. The
trio clock follows the recorded one; real time passes only for threads and
pipes. Whatever the actor writes into its run folder goes to a scratch
folder, removed afterwards.

``python -m vime.replay show LOG`` prints the log readably instead.

The role comes from the log's opening record and is looked up among the built-in roles only: nothing read from
a log decides what is imported. An actor of another role (a user's, or the self-check's ``tally``) is replayed
with ``--role package.module:Class`` given on the command line. The driver's log (``driver.vlog``) is not an
actor's: it is shown, not replayed (see :data:`NOT_REPLAYED`).

Compared: kind, receiver, reply_to (as the replayed actor numbers its asks), weight_version, wants_reply and
the payload (tensors by value), except the durations an actor measures with a wall clock (:data:`MEASURED`).
A replay may send more than an original that a Shutdown stopped with work in flight: the reward scores in worker
processes, in real time, and the replay can finish a group the original dropped unscored as it stopped. Those
surplus messages, after every recorded one matched, are counted (``ReplayResult.beyond_stop``), not a divergence.
Not compared: message ids and send times, and the runtime's own timer traffic (heartbeats, registration),
which is skipped on both sides.

Cost: the actor's own work again (a trainer trains, a rollout worker generates), alone on the machine, and
never more than the walk above waits for: about what the actor was busy for in the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import trio
import trio.testing

from vime.logs import configure
from vime.messages.runtime import Registered
from vime.roles import resolve_role
from vime.runtime import UNREPLAYED_KINDS, Actor, ActorSettings
from vime.transports.codec import BadMessage, Envelope, FrameError, decode_frame
from vime.transports.msglog import STEP, LogRecord, opening, scan
from vime.transports.records import is_record, is_tensor, to_fields

# Logs of processes that are not actors a replay could rebuild, and why.
NOT_REPLAYED: dict[str, str] = {
    "driver": "the driver (vime.cluster) is not an actor but the job's supervisor: what it sends follows the "
              "processes it starts and the clock, not its messages; its log is for `python -m vime.replay show`",
}

# Durations and times read from a wall clock, by message kind: a replay cannot reproduce when or how long.
MEASURED: dict[str, frozenset[str]] = {
    "RolloutGroup": frozenset({"generate_s", "finished_at"}),
    "ScoredGroup": frozenset({"generate_s", "finished_at", "reward_s"}),
}

# Real seconds a replayed actor may sit idle (no thread running, its clock caught up) before what it has
# not sent is taken as a divergence.
STALL_S = 10.0

@dataclasses.dataclass
class Divergence:
    """The first message the replayed actor sent differently: its index among those compared, both envelopes,
    which part differs, and each differing field as (path, recorded, replayed)."""

    index: int
    recorded: Envelope | None
    replayed: Envelope | None
    field: str
    fields: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    more_fields: int = 0  # differing fields beyond those in ``fields``

    def __str__(self) -> str:
        lines = [f"first divergence at sent message #{self.index} ({self.field}):",
                 f"  recorded: {_describe(self.recorded)}", f"  replayed: {_describe(self.replayed)}"]
        lines += [f"  {path}: recorded {old}, replayed {new}" for path, old, new in self.fields]
        if self.more_fields:
            lines.append(f"  ... and {self.more_fields} more differing fields")
        return "\n".join(lines)


@dataclasses.dataclass
class ReplayResult:
    received_frames: int
    compared: int
    divergence: Divergence | None
    problem: str | None  # a torn tail or corruption the reader stopped at
    beyond_stop: int = 0  # sent after all the recorded ones by the replay of an original a Shutdown stopped
    stopped: bool = False  # the log told the actor to stop (it may still have been killed as it stopped)


_DIFFERENCES_SHOWN = 12
_ENVELOPE_FIELDS = ("kind", "receiver", "reply_to", "weight_version", "wants_reply")
_run_in_thread = trio.to_thread.run_sync  # the real one: the walk's own pauses are not the actor's threads


def _decode_all(record: LogRecord) -> list[Envelope | BadMessage]:
    try:
        frame = decode_frame(bytearray(record.frame), max_message_bytes=1 << 62, resolve_shm=record.resolve_shm)
    except FrameError as err:
        return [BadMessage("malformed", str(err))]
    return frame.messages


def _compared(message: Envelope | BadMessage) -> bool:
    return isinstance(message, BadMessage) or type(message.payload) not in UNREPLAYED_KINDS


def replay(path: Path, role: str | None = None) -> ReplayResult:
    """Replay one actor's log and compare what it sends with the recording. LookupError, before any work,
    when the log's process cannot be replayed (the driver's, a role not given)."""
    log = scan(path)
    if not log.records or log.records[0].direction != "open":
        raise ValueError(f"{path} is not a vime message log (no opening record)")
    opening = log.records[0].meta
    cls = _role(role, opening.get("role", ""))
    with tempfile.TemporaryDirectory(prefix="vime-replay-") as scratch:
        settings = dataclasses.replace(ActorSettings(**opening["settings"]), record=False, driver=None,
                                       parent_pid=None, run_dir=scratch)
        walk = _Walk(cls(settings, _config(log.records, opening)), log.records)
        with _counting_threads(walk):
            trio.run(walk.drive, clock=walk.clock)
    inbound = sum(r.direction == "in" for r in log.records)
    compared = min(len(walk.recorded), len(walk.produced))
    divergence, beyond = judge(walk.recorded, walk.produced, walk.stopped)
    return ReplayResult(inbound, compared, divergence, log.problem, beyond_stop=beyond, stopped=walk.stopped)


def judge(recorded: list[Any], replayed: list[Envelope], stopped: bool) -> tuple[Divergence | None, int]:
    """The first divergence, and how many messages the replay sent beyond the recorded ones without one: only an
    original the log told to stop (``stopped``) may have sent fewer (see the module's docstring)."""
    judged = replayed[:len(recorded)] if stopped else replayed
    divergence = _compare(recorded, judged)
    return divergence, 0 if divergence else len(replayed) - len(judged)


def _config(records: list[LogRecord], opening: dict[str, Any]) -> dict[str, Any]:
    """The config the actor ran with: its opening record's or, for one that joined by hand with none of its own,
    the job's settings the driver answered its registration with (that answer is in the log)."""
    if opening.get("config"):
        return opening["config"]
    for record in records:
        for message in _decode_all(record) if record.direction == "in" else ():
            if isinstance(message, Envelope) and isinstance(message.payload, Registered):
                return dict(message.payload.config or {})
    return {}


class _Walk:
    """Feeds a fresh actor its log in the order things happened (see the module's docstring) and keeps what it
    sends. The actor's sends are numbered as it numbers them; replies in the log are renumbered to match."""

    def __init__(self, actor: Actor, records: list[LogRecord]) -> None:
        self.actor, self.records = actor, records
        self.clock = trio.testing.MockClock()
        self.outbound = {r.offset: [m for m in _decode_all(r) if _compared(m)] for r in records if r.direction == "out"}
        self.recorded = [m for r in records if r.direction == "out" for m in self.outbound[r.offset]]
        self.produced: list[Envelope] = []
        self.capturing = True
        self.stopped = False  # the log told the actor to stop (Shutdown), as against its log just ending (killed)
        self.reply_ids: dict[int, int] = {}  # a recorded ask's id -> the replayed one's
        self.threads = 0  # the actor's calls running in worker threads
        self.steps_open = self.steps_started = 0  # a rollout worker's engine steps the log allows, and taken
        # at each step mark, how many messages the original had started handling: no more, no fewer here
        self.step_dispatched = [r.meta.get("dispatched", 0) for r in records if r.direction == STEP]
        self.dispatched = 0
        self._steps = trio.lowlevel.ParkingLot()
        actor._send_hook = self._sent
        route = actor._route
        actor._route = lambda envelope, arrived: route(self._renumbered(envelope), arrived)
        if self.step_dispatched:  # an actor that marks no steps (or a log from before step marks): ungated
            actor.step_gate = self._step_gate

    def _sent(self, envelope: Envelope) -> None:
        if not (self.capturing and _compared(envelope)):
            return
        index = len(self.produced)
        self.produced.append(envelope)
        if index < len(self.recorded) and isinstance(self.recorded[index], Envelope):
            self.reply_ids[self.recorded[index].id] = envelope.id

    def _renumbered(self, envelope: Envelope) -> Envelope:
        """A reply to an ask this actor made is matched by the replayed ask's id; one to a message the replay
        does not send (registration) matches nothing."""
        if envelope.reply_to is not None:
            envelope.reply_to = self.reply_ids.get(envelope.reply_to, -1)
        return envelope

    async def _step_gate(self) -> None:
        """The actor's next step point (a rollout worker's engine step) waits until the walk reaches its mark in
        the log and as many messages were handled as there."""
        while self.steps_started >= self.steps_open or self.dispatched < self._dispatch_limit():
            await self._steps.park()
        self.steps_started += 1
        self.actor._queue_ready.unpark_all()

    def _dispatch_limit(self) -> float:
        """Messages may be handled up to the next step mark's count (none: all of them)."""
        marks = self.step_dispatched
        return marks[self.steps_started] if self.steps_started < len(marks) else math.inf

    async def _handle_loop(self) -> None:
        """The runtime's handler loop, but holding a message back while handling it would pass the next step
        mark: a frame's messages are handled one by one, and the original's engine step fell among them."""
        actor = self.actor
        while True:
            while not actor._queue or self.dispatched >= self._dispatch_limit():
                await actor._queue_ready.park()
            self.dispatched += 1
            self._steps.unpark_all()
            actor._busy = True
            try:
                await actor._dispatch(*actor._queue.popleft())
            finally:
                actor._busy = False

    async def drive(self) -> None:
        actor = self.actor
        async with trio.open_nursery() as nursery:
            actor._nursery = nursery
            await actor.on_start()
            nursery.start_soon(self._handle_loop)
            nursery.start_soon(self._stop_when_asked)
            if await self._walk():
                await self._settle()
            if not actor._stopping.is_set():  # the original was killed, or the log ends early: clean up unseen
                self.capturing = False
                actor._stopping.set()
            await trio.sleep_forever()

    async def _stop_when_asked(self) -> None:
        """As the runtime does on Shutdown: on_stop, whose messages (a worker handing its groups back) count,
        then nothing more."""
        await self.actor._stopping.wait()
        self.stopped = self.capturing  # drive() stops uncaptured only to clean up after a log that just ends
        await self.actor.on_stop()
        await trio.testing.wait_all_tasks_blocked()
        self.actor._nursery.cancel_scope.cancel()

    async def _walk(self) -> bool:
        """Each record in turn; False once the actor stalled short of what the log says it sent."""
        sent = 0
        for record in self.records[1:]:
            if record.direction == "in":
                self._jump_to(record)
                await trio.testing.wait_all_tasks_blocked()
                self.actor._accept_frame(bytearray(record.frame), record.wall_time, record.resolve_shm)
            elif record.direction == "out":
                sent += len(self.outbound[record.offset])
                if not await self._until(lambda: len(self.produced) >= sent, record):
                    return False
            elif record.direction == STEP:
                await trio.testing.wait_all_tasks_blocked()  # what came before the mark is handled
                self.steps_open = opened = self.steps_open + 1
                self._steps.unpark_all()
                if not await self._until(lambda: self.steps_started >= opened, record):
                    return False
        return True

    async def _until(self, done: Callable[[], bool], record: LogRecord) -> bool:
        """Let the actor run (its threads to their end, its clock up to ``record``'s time) until ``done()``;
        False when it sat idle ``STALL_S`` real seconds short of it."""
        idle_since = time.monotonic()
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if done():
                return True
            if self.threads:
                idle_since = time.monotonic()
            elif self._jump_to(record):
                continue
            elif time.monotonic() - idle_since > STALL_S:
                return False
            await _run_in_thread(time.sleep, 0.002)

    async def _settle(self) -> None:
        """After the last record: let the actor finish what it started, so that anything more it sends counts."""
        await trio.testing.wait_all_tasks_blocked()
        while self.threads:
            await _run_in_thread(time.sleep, 0.002)
            await trio.testing.wait_all_tasks_blocked()

    def _jump_to(self, record: LogRecord) -> bool:
        """Move the clock up to ``record``'s recorded time; whether it moved."""
        ahead = (record.mono_time - self.records[0].mono_time) - self.clock.current_time()
        if ahead <= 0:
            return False
        self.clock.jump(ahead)
        return True


@contextlib.contextmanager
def _counting_threads(walk: _Walk) -> Iterator[None]:
    """While replaying, the actor's ``trio.to_thread.run_sync`` calls are counted: a replayed actor whose thread
    still runs (training, an engine step) is busy, not stalled, and its clock must not jump meanwhile."""
    async def run_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        walk.threads += 1
        try:
            return await _run_in_thread(fn, *args, **kwargs)
        finally:
            walk.threads -= 1

    trio.to_thread.run_sync = run_sync
    try:
        yield
    finally:
        trio.to_thread.run_sync = _run_in_thread


def _compare(recorded: list[Any], replayed: list[Envelope]) -> Divergence | None:
    for index, (old, new) in enumerate(zip(recorded, replayed)):
        if isinstance(old, BadMessage):
            return Divergence(index, None, new, f"recorded message unreadable: {old.error}")
        for field in _ENVELOPE_FIELDS:
            if getattr(old, field) != getattr(new, field):
                return Divergence(index, old, new, field, [(field, repr(getattr(old, field)),
                                                            repr(getattr(new, field)))])
        differences = list(_differences(old.payload, new.payload, "payload", MEASURED.get(old.kind, frozenset())))
        if differences:
            shown = differences[:_DIFFERENCES_SHOWN]
            return Divergence(index, old, new, "payload", shown, len(differences) - len(shown))
    if len(recorded) != len(replayed):
        index = min(len(recorded), len(replayed))
        old = recorded[index] if index < len(recorded) else None
        new = replayed[index] if index < len(replayed) else None
        return Divergence(index, old, new, f"count: recorded {len(recorded)} messages, replayed {len(replayed)}")
    return None


def _differences(a: Any, b: Any, path: str, measured: frozenset[str] = frozenset()) -> Iterator[tuple[str, str,
                                                                                                          str]]:
    """Each field where ``a`` and ``b`` differ, as (path, recorded, replayed); ``measured`` fields are skipped."""
    if is_record(a) and type(a) is type(b):
        old, new = to_fields(a), to_fields(b)
        for key in old:
            if key not in measured:
                yield from _differences(old[key], new[key], f"{path}.{key}")
    elif (isinstance(a, np.ndarray) or is_tensor(a)) and type(a) is type(b):
        yield from _array_differences(a, b, path)
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in sorted({*a, *b}, key=str):
            if key not in b or key not in a:
                yield f"{path}[{key!r}]", _short(a.get(key, "(absent)")), _short(b.get(key, "(absent)"))
            else:
                yield from _differences(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path} (length)", str(len(a)), str(len(b))
        for index, (x, y) in enumerate(zip(a, b)):
            yield from _differences(x, y, f"{path}[{index}]")
    elif type(a) is not type(b) or (a != b and not (isinstance(a, float) and math.isnan(a) and math.isnan(b))):
        yield path, _short(a), _short(b)


def _array_differences(a: Any, b: Any, path: str) -> Iterator[tuple[str, str, str]]:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        yield f"{path} (dtype, shape)", f"{a.dtype} {tuple(a.shape)}", f"{b.dtype} {tuple(b.shape)}"
        return
    unequal = (a != b).nonzero() if is_tensor(a) else np.argwhere(a != b)
    if len(unequal):
        where = tuple(int(i) for i in unequal[0])
        yield (f"{path}{list(where)} (first of {len(unequal)} differing elements)", repr(a[where].item()),
               repr(b[where].item()))


def _describe(envelope: Envelope | None) -> str:
    if envelope is None:
        return "(nothing)"
    return (f"{envelope.kind} to {envelope.receiver} reply_to={envelope.reply_to} "
            f"weight_version={envelope.weight_version}")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _role(given: str | None, logged: str) -> type[Actor]:
    """The actor class to replay: ``given`` on our command line (a built-in role or ``module:Class``), else the
    logged role, which must be a built-in one."""
    if given is not None:
        return resolve_role(given, allow_import=True)
    if logged in NOT_REPLAYED:
        raise LookupError(f"a {logged} log is not replayed: {NOT_REPLAYED[logged]}")
    try:
        return resolve_role(logged, allow_import=False)
    except LookupError as err:
        raise LookupError(f"{err}; this log's actor is not of a built-in role: pass --role package.module:Class "
                          f"(the class it ran, a module you trust)") from None


def show(path: Path, out: Any = sys.stdout, role: str | None = None) -> None:
    """Print one line per message: time, direction, peer, kind, size, weight version. ``role`` (else the logged
    one, built-in only) is imported first: importing it declares its message kinds."""
    log = scan(path)
    if log.records and log.records[0].direction == "open":
        try:
            _role(role, log.records[0].meta.get("role", ""))
        except LookupError as err:
            print(f"note: {err}; its own message kinds will show as unreadable", file=out)
    print(f"{'time (UTC)':<15} {'dir':<4} {'peer':<16} {'kind':<16} {'bytes':>10} {'wv':>4}  reply_to", file=out)
    for record in log.records:
        stamp = datetime.datetime.fromtimestamp(record.wall_time, datetime.timezone.utc).strftime("%H:%M:%S.%f")
        if record.direction == STEP:
            print(f"{stamp:<15} step (an engine step began)", file=out)
            continue
        if record.direction == "open":
            meta = record.meta
            print(f"{stamp:<15} open {meta.get('name', '')} role={meta.get('role')} pid={meta.get('pid')} "
                  f"seed={meta.get('settings', {}).get('seed')}", file=out)
            continue
        size = len(record.frame) + sum(len(a) for a in record.attachments.values())
        for message in _decode_all(record):
            if isinstance(message, BadMessage):
                print(f"{stamp:<15} {record.direction:<4} {record.peer:<16} {'(bad: ' + message.reason + ')':<16} "
                      f"{size:>10}", file=out)
            else:
                version = "-" if message.weight_version is None else message.weight_version
                peer = message.sender if record.direction == "in" else message.receiver
                print(f"{stamp:<15} {record.direction:<4} {peer:<16} {message.kind:<16} {size:>10} {version:>4}  "
                      f"{message.reply_to if message.reply_to is not None else ''}", file=out)
    if log.problem:
        print(f"note: {log.problem}", file=out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m vime.replay", description=__doc__.split("\n\n")[0],
                                     epilog="python -m vime.replay show LOG prints a log readably.",
                                     allow_abbrev=False)
    if argv[:1] == ["show"]:
        parser.prog += " show"
        parser.add_argument("log", type=Path)
        parser.add_argument("--role", default=None,
                            help="declare this role's message kinds (built-in name or package.module:Class)")
        args = parser.parse_args(argv[1:])
        show(args.log, role=args.role)
        return 0
    parser.add_argument("log", type=Path, help="an actor's message log (RUN_DIR/messages/NAME.vlog), or a run's "
                                               "RUN_DIR/messages: each of its logs")
    parser.add_argument("--role", default=None,
                        help="replay with this role (built-in name or package.module:Class) instead of the logged one")
    args = parser.parse_args(argv)
    configure("warning")
    if args.log.is_dir():
        return _replay_folder(args.log)
    try:
        return _replay_one(args.log, args.role)
    except LookupError as err:
        print(f"cannot replay {args.log}: {err}", file=sys.stderr)
        return 2


def _replay_one(path: Path, role: str | None) -> int:
    """Replay one log and print the outcome and what it cost; the exit status (0, or 1 on a divergence)."""
    started = time.monotonic()
    result = replay(path, role)
    if result.problem:
        print(f"note: {result.problem}")
    if result.divergence is not None:
        print(result.divergence)
        return 1
    beyond = (f"{result.beyond_stop} more sent than the original, which a Shutdown stopped with them in flight, "
              if result.beyond_stop else "")
    print(f"no divergence ({result.received_frames} frames received, {result.compared} sent messages compared, "
          f"{beyond}{time.monotonic() - started:.1f} s)")
    return 0


def _replay_folder(folder: Path) -> int:
    """Every log of a run: first, before any work, those that cannot be replayed and why; then each other one."""
    logs = sorted(folder.glob("*.vlog"))
    if not logs:
        print(f"cannot replay {folder}: no message logs (*.vlog) in it; --record writes them", file=sys.stderr)
        return 2
    replayable = []
    for path in logs:
        try:
            _role(None, (opening(path) or {}).get("role", ""))
            replayable.append(path)
        except LookupError as err:
            print(f"{path.name}: not replayed: {err}")
    status = 0
    for path in replayable:  # each in a process of its own, as it ran: torch's thread count is process-wide
        print(f"{path.name}:", flush=True)
        status = max(status, subprocess.run([sys.executable, "-m", "vime.replay", str(path)]).returncode)
    return status


if __name__ == "__main__":
    sys.exit(main())
