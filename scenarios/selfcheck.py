"""selfcheck: the actor runtime end to end, on real processes, in ~15 s; and the small actors it runs.

It starts three actors, measures ask round trips, a burst of small tells and a 64 MiB tensor, kills one actor
with SIGKILL and restarts it, then replays the stateful actor's message log (only it records, so the figures
above are not slowed by logging) and checks it reproduces every message it sent. It trains nothing.

Its actors, which the runtime's tests and ``bench/transport.py`` spawn too:

* ``echo`` answers pings, sinks bursts of notes, acknowledges (or returns) tensors and can be told to nap,
  which makes backpressure observable; with ``{"fail_on_start": true}`` in its config it fails as it starts
  (a broken start-up, for the driver's restart policy).
* ``tally`` keeps per-key totals and stamps each change with a ticket drawn from its seeded RNG and the message
  clock: real state that a replay of its message log must reproduce exactly.

They are not built-in roles (``vime.roles``): they are spawned by module path (:data:`ECHO`, :data:`TALLY`), and
a tally's log is replayed with ``python -m vime.replay LOG --role vime.scenarios.selfcheck:Tally``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import trio

from vime.cluster import Cluster
from vime.replay import replay
from vime.runtime import Actor, handles
from vime.transports.codec import Envelope
from vime.transports.records import message

ECHO = "vime.scenarios.selfcheck:Echo"  # the roles to spawn, by module path
TALLY = "vime.scenarios.selfcheck:Tally"


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


DESCRIPTION = "runtime self-check across real processes: messages, asks, restarts, transports (no model)"


async def run(run_dir: Path, transport: str, say: Callable[[str], None]) -> dict:
    """Run the checks; returns the figures (also written to RUN_DIR/selfcheck.json)."""
    figures: dict = {"transport": transport}
    async with Cluster.open(run_dir, transport=transport) as job:
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(job.spawn, ECHO, "echo0")
            nursery.start_soon(job.spawn, ECHO, "echo1")
            nursery.start_soon(partial(job.spawn, TALLY, "tally0", record=True))
        say(f"3 actors up in {time.monotonic() - started:.1f} s (driver at {job.address})")

        rtts = []
        for _ in range(1000):
            t0 = time.perf_counter()
            await job.ask("echo0", Ping(payload=b"p" * 64))
            rtts.append(time.perf_counter() - t0)
        figures["ask_rtt_p50_us"] = statistics.median(rtts[100:]) * 1e6
        say(f"ask round trip p50 {figures['ask_rtt_p50_us']:.0f} us")

        count = 20_000
        t0 = time.perf_counter()
        for seq in range(count):
            await job.tell("echo1", Note(seq=seq, body=b"n" * 80))
        reply = await job.ask("echo1", CountQuery())
        figures["small_msgs_per_s"] = count / (time.perf_counter() - t0)
        figures["notes_intact"] = reply == Count(received=count, out_of_order=0)
        say(f"{count} tells: {figures['small_msgs_per_s']:,.0f} msgs/s, all in order: {figures['notes_intact']}")

        import torch  # here: the echo and tally actors, which tests spawn by the dozen, need none

        tensor = torch.randn(16 << 20)
        seconds = []
        for _ in range(3):  # the first creates a shared-memory segment; later ones reuse it
            t0 = time.perf_counter()
            ack = await job.ask("echo0", Blob(tensor=tensor))
            seconds.append(time.perf_counter() - t0)
        figures["tensor_64mib_gbps"] = tensor.nbytes / statistics.median(seconds) / 1e9
        figures["tensor_intact"] = ack.nbytes == tensor.nbytes
        say(f"64 MiB tensor, median of 3: {figures['tensor_64mib_gbps']:.2f} GB/s")

        for i in range(50):
            await job.ask("tally0", Add(key=f"k{i % 5}", amount=i))
        snapshot = await job.ask("tally0", Snapshot())
        figures["tally_changes"] = snapshot.changes

        victim = job.actors["echo1"].pid
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        await job.wait_event("died", "echo1", timeout=10)
        figures["death_noticed_s"] = time.monotonic() - t0
        await job.restart("echo1")
        figures["restarted_answers"] = (await job.ask("echo1", Ping(payload=b"back"))).payload == b"back"
        say(f"SIGKILL of echo1 noticed in {figures['death_noticed_s'] * 1000:.0f} ms; restarted and answering: "
            f"{figures['restarted_answers']}")

    result = await trio.to_thread.run_sync(replay, run_dir / "messages" / "tally0.vlog", TALLY)
    figures["replay_divergence"] = None if result.divergence is None else str(result.divergence)
    say(f"replay of tally0's log: {'no divergence' if result.divergence is None else result.divergence} "
        f"({result.compared} sent messages compared)")
    figures["passed"] = bool(figures["notes_intact"] and figures["tensor_intact"] and figures["restarted_answers"]
                             and figures["death_noticed_s"] < 5 and result.divergence is None)
    (run_dir / "selfcheck.json").write_text(json.dumps(figures, indent=2))
    return figures
