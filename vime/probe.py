"""Small actors for self-checks, tests and benchmarks.

``echo`` answers pings, sinks bursts of notes, acknowledges (or returns)
tensors and can be told to nap, which makes backpressure observable; with
``{"fail_on_start": true}`` in its config it fails as it starts (a broken
start-up, for the driver's restart policy).
``tally`` keeps per-key totals and stamps each change with a ticket drawn from
its seeded RNG and the message clock: real state that a replay of its message
log must reproduce exactly.
"""

from __future__ import annotations

from typing import Any

import trio

from vime.runtime import Actor, handles
from vime.transports.codec import Envelope
from vime.transports.records import message


@message
class Ping:
    """anyone -> echo (ask): answered with Pong carrying the same bytes."""

    payload: bytes


@message
class Pong:
    """echo -> asker: the Ping's bytes."""

    payload: bytes


@message
class Note:
    """anyone -> echo (tell): one small message of a burst, numbered in order."""

    seq: int
    body: bytes


@message
class CountQuery:
    """anyone -> echo (ask): how many Notes arrived, and how many out of order."""


@message
class Count:
    """echo -> asker: Note totals."""

    received: int
    out_of_order: int


@message
class Blob:
    """anyone -> echo (ask): a tensor or array; ``echo`` sends it back."""

    tensor: Any
    echo: bool = False


@message
class BlobAck:
    """echo -> asker: bytes seen, and the tensor itself when asked to echo it."""

    nbytes: int
    tensor: Any = None


@message
class Nap:
    """anyone -> echo: sleep this long before handling the next message."""

    seconds: float


@message
class Add:
    """anyone -> tally (ask): add ``amount`` to ``key``; answered with Total."""

    key: str
    amount: int


@message
class Total:
    """tally -> asker: the key's new total and the ticket stamped on the change."""

    key: str
    total: int
    ticket: int
    at: float


@message
class Snapshot:
    """anyone -> tally (ask): all totals, answered with Totals."""


@message
class Totals:
    """tally -> asker: every key's total and how many changes were made."""

    totals: dict[str, int]
    changes: int


class Echo(Actor):
    role = "echo"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.notes = 0
        self.out_of_order = 0
        self.last_seq = -1

    async def on_start(self) -> None:
        if self.config.get("fail_on_start"):
            raise RuntimeError("echo was told to fail as it starts (fail_on_start)")

    @handles(Ping)
    async def ping(self, msg: Ping, envelope: Envelope) -> Pong:
        return Pong(payload=msg.payload)

    @handles(Note)
    async def note(self, msg: Note, envelope: Envelope) -> None:
        self.notes += 1
        if msg.seq != self.last_seq + 1:
            self.out_of_order += 1
        self.last_seq = msg.seq

    @handles(CountQuery)
    async def count(self, msg: CountQuery, envelope: Envelope) -> Count:
        return Count(received=self.notes, out_of_order=self.out_of_order)

    @handles(Blob)
    async def blob(self, msg: Blob, envelope: Envelope) -> BlobAck:
        return BlobAck(nbytes=msg.tensor.nbytes, tensor=msg.tensor if msg.echo else None)

    @handles(Nap)
    async def nap(self, msg: Nap, envelope: Envelope) -> None:
        await trio.sleep(msg.seconds)


class Tally(Actor):
    role = "tally"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.totals: dict[str, int] = {}
        self.changes = 0

    @handles(Add)
    async def add(self, msg: Add, envelope: Envelope) -> Total:
        self.totals[msg.key] = self.totals.get(msg.key, 0) + msg.amount
        self.changes += 1
        return Total(key=msg.key, total=self.totals[msg.key], ticket=self.rng.getrandbits(32), at=self.now())

    @handles(Snapshot)
    async def snapshot(self, msg: Snapshot, envelope: Envelope) -> Totals:
        return Totals(totals=dict(self.totals), changes=self.changes)
