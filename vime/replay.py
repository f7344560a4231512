"""``python -m vime.replay LOG``: re-drive an actor from its message log.

A fresh instance of the logged actor (same role, config and seed, from the
log's opening record) is fed every frame the original received, in order and
with the recorded arrival clock, while nothing leaves the process. What it
sends is compared with what the original sent; the first difference is
printed and the exit status is 1, else "no divergence" and 0.

``python -m vime.replay show LOG`` prints the log readably instead.

The role comes from the log's opening record and is looked up among the built-in roles only: nothing read from
a log decides what is imported. An actor of another role (a user's, or the self-check's ``tally``) is replayed
with ``--role package.module:Class`` given on the command line.

Compared: kind, receiver, reply_to, weight_version, wants_reply and the
payload (tensors by value). Not compared: message ids and send times, which
also count the runtime's own timer traffic (heartbeats, registration) -- that
traffic is skipped on both sides. Handler sleeps run on a virtual clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio
import trio.testing

from vime.logs import configure
from vime.roles import resolve_role
from vime.runtime import UNREPLAYED_KINDS, Actor, ActorSettings
from vime.transports.codec import BadMessage, Envelope, FrameError, decode_frame
from vime.transports.msglog import LogRecord, scan
from vime.transports.records import is_record, to_fields


@dataclasses.dataclass
class Divergence:
    index: int
    recorded: Envelope | None
    replayed: Envelope | None
    field: str

    def __str__(self) -> str:
        return (f"first divergence at sent message #{self.index} ({self.field}):\n"
                f"  recorded: {_describe(self.recorded)}\n  replayed: {_describe(self.replayed)}")


@dataclasses.dataclass
class ReplayResult:
    received_frames: int
    compared: int
    divergence: Divergence | None
    problem: str | None  # a torn tail or corruption the reader stopped at


def _decode_all(record: LogRecord) -> list[Envelope | BadMessage]:
    try:
        frame = decode_frame(bytearray(record.frame), max_message_bytes=1 << 62, resolve_shm=record.resolve_shm)
    except FrameError as err:
        return [BadMessage("malformed", str(err))]
    return frame.messages


def replay(path: Path, role: str | None = None) -> ReplayResult:
    """Replay one actor's log and compare what it sends with the recording."""
    log = scan(path)
    if not log.records or log.records[0].direction != "open":
        raise ValueError(f"{path} is not a vime message log (no opening record)")
    opening = log.records[0].meta
    cls = _role(role, opening.get("role", ""))
    settings = dataclasses.replace(ActorSettings(**opening["settings"]), record=False, driver=None)
    actor = cls(settings, opening["config"])
    produced: list[Envelope] = []
    actor._send_hook = produced.append
    inbound = [r for r in log.records if r.direction == "in"]

    async def drive() -> None:
        async with trio.open_nursery() as nursery:
            actor._nursery = nursery
            await actor.on_start()
            nursery.start_soon(actor._handle_loop)
            for record in inbound:
                actor._accept_frame(bytearray(record.frame), record.wall_time, record.resolve_shm)
                await trio.testing.wait_all_tasks_blocked()
            while actor._queue or actor._busy:
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(drive, clock=trio.testing.MockClock(autojump_threshold=0))
    recorded = [m for r in log.records if r.direction == "out" for m in _decode_all(r)]
    recorded = [m for m in recorded if isinstance(m, BadMessage) or type(m.payload) not in UNREPLAYED_KINDS]
    replayed = [m for m in produced if type(m.payload) not in UNREPLAYED_KINDS]
    return ReplayResult(len(inbound), min(len(recorded), len(replayed)), _compare(recorded, replayed), log.problem)


def _compare(recorded: list[Any], replayed: list[Envelope]) -> Divergence | None:
    for index, (old, new) in enumerate(zip(recorded, replayed)):
        if isinstance(old, BadMessage):
            return Divergence(index, None, new, f"recorded message unreadable: {old.error}")
        for field in ("kind", "receiver", "reply_to", "weight_version", "wants_reply"):
            if getattr(old, field) != getattr(new, field):
                return Divergence(index, old, new, field)
        if not _same(old.payload, new.payload):
            return Divergence(index, old, new, "payload")
    if len(recorded) != len(replayed):
        index = min(len(recorded), len(replayed))
        old = recorded[index] if index < len(recorded) else None
        new = replayed[index] if index < len(replayed) else None
        return Divergence(index, old, new, f"count: recorded {len(recorded)} messages, replayed {len(replayed)}")
    return None


def _same(a: Any, b: Any) -> bool:
    if is_record(a) or is_record(b):
        return type(a) is type(b) and _same(to_fields(a), to_fields(b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _describe(envelope: Envelope | None) -> str:
    if envelope is None:
        return "(nothing)"
    return (f"{envelope.kind} to {envelope.receiver} reply_to={envelope.reply_to} "
            f"weight_version={envelope.weight_version} {_short(envelope.payload)}")


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _role(given: str | None, logged: str) -> type[Actor]:
    """The actor class to replay: ``given`` on our command line (a built-in role or ``module:Class``), else the
    logged role, which must be a built-in one."""
    if given is not None:
        return resolve_role(given, allow_import=True)
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
                                     epilog="python -m vime.replay show LOG prints a log readably.")
    if argv[:1] == ["show"]:
        parser.prog += " show"
        parser.add_argument("log", type=Path)
        parser.add_argument("--role", default=None,
                            help="declare this role's message kinds (built-in name or package.module:Class)")
        args = parser.parse_args(argv[1:])
        show(args.log, role=args.role)
        return 0
    parser.add_argument("log", type=Path, help="an actor's message log (RUN_DIR/messages/NAME.vlog)")
    parser.add_argument("--role", default=None,
                        help="replay with this role (built-in name or package.module:Class) instead of the logged one")
    args = parser.parse_args(argv)
    configure("warning")
    try:
        result = replay(args.log, args.role)
    except LookupError as err:
        print(f"cannot replay {args.log}: {err}", file=sys.stderr)
        return 2
    if result.problem:
        print(f"note: {result.problem}")
    if result.divergence is not None:
        print(result.divergence)
        return 1
    print(f"no divergence ({result.received_frames} frames received, {result.compared} sent messages compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
