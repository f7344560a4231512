"""Transport benchmark: vime actors over ipc and tcp, side by side with Ray,
multiprocessing pipes, a naive trio+pynng loop and blocking pynng.

For each transport, between two OS processes on this host, it measures:

* round-trip latency of a ~100-byte request: p50 and p99 in microseconds;
* one-way throughput of ~100-byte messages, confirmed by one final ask: msgs/s;
* a 64 MiB float32 tensor carried by a request answered with a small ack:
  GB/s from the median time.

What the rows are: vime's driver actor asking an ``echo`` actor (over ipc big
tensors travel through shared memory, over tcp inline); Ray actor method
calls (``ray.get(actor.echo.remote(m))``; tensors go as numpy arrays through
Ray's shared-memory object store); a ``multiprocessing`` spawn child behind a
Pipe, pickling everything; and the naive design vime replaced -- pynng Pair0
with trio ``asend``/``arecv`` and msgpack, tensors as msgpack bytes -- which
research measured at ~224 us per round trip (shared/research/cpu-stack.md, 2);
and the same Pair0 loop with blocking calls on both sides, the floor that nng
itself sets under any runtime built on it.

Transports run one after another, each alone, so that an idle Ray or a second
cluster does not take one of the two cores; within a transport the three
measurements alternate over a few rounds, and medians are quoted. Left out:
fan-out, links across hosts, TLS.

Usage::

    python bench/transport.py --quick --json bench/transport.json

``--quick`` takes under 40 s on a 2-core machine, Ray's start-up included.
Ray rows need the ``bench`` extra (``pip install -e .[bench]``); without it
they read "not installed" and their JSON values are null. The acceptance
checks are printed, never enforced: the exit status does not depend on them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import logging
import multiprocessing
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncContextManager, AsyncIterator, Awaitable, Callable, Iterator, Protocol

import msgpack
import numpy as np
import pynng
import torch
import trio

from vime import Cluster
from vime.logs import configure
from vime.scenarios.selfcheck import ECHO as ECHO_ROLE
from vime.scenarios.selfcheck import Blob, CountQuery, Note, Ping

PAYLOAD = b"x" * 64  # with its envelope, a request of about 100 bytes on every transport
NOTE_BODY = b"y" * 60
TENSOR_ELEMENTS = 16 << 20  # float32: 64 MiB
TENSOR_BYTES = TENSOR_ELEMENTS * 4
ECHO = "echo0"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much each transport is measured; every round does all three measurements.

    Ray and naive pynng are 3-20x slower per message, so they get fewer
    round trips and messages (``slow_*``): enough for a p99, and --quick stays
    under 40 s.
    """

    rounds: int
    warm_up: int  # untimed round trips first
    round_trips: int  # per round
    slow_round_trips: int
    burst: int  # one-way messages per round
    slow_burst: int
    tensors: int  # 64 MiB requests per round

    def counts(self, slow: bool) -> tuple[int, int]:
        """Round trips and one-way messages per round."""
        return (self.slow_round_trips, self.slow_burst) if slow else (self.round_trips, self.burst)


QUICK = Sizes(rounds=3, warm_up=100, round_trips=700, slow_round_trips=300, burst=8_000, slow_burst=800, tensors=1)
FULL = Sizes(rounds=5, warm_up=500, round_trips=4_000, slow_round_trips=1_500, burst=40_000, slow_burst=4_000,
             tensors=2)


class Link(Protocol):
    """One sender talking to one echo in another process; each call returns once confirmed."""

    async def round_trip(self) -> None: ...

    async def burst(self, count: int) -> None: ...

    async def carry(self, tensor: torch.Tensor) -> None: ...


@dataclasses.dataclass(frozen=True)
class Transport:
    """One row of the table."""

    key: str  # prefix of its JSON keys
    label: str
    open: Callable[[], AsyncContextManager[Link]]
    slow: bool = False
    missing: str | None = None  # why it cannot run here


@dataclasses.dataclass
class Samples:
    """Raw timings of one transport, pooled over its rounds."""

    round_trip_s: list[float] = dataclasses.field(default_factory=list)
    msgs_per_s: list[float] = dataclasses.field(default_factory=list)
    tensor_s: list[float] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, float]:
        micros = [s * 1e6 for s in self.round_trip_s]
        return {
            "rtt_p50_us": percentile(micros, 50),
            "rtt_p99_us": percentile(micros, 99),
            "small_msgs_per_s": statistics.median(self.msgs_per_s),
            "64mib_gbps": TENSOR_BYTES / statistics.median(self.tensor_s) / 1e9,
        }


METRICS = ("rtt_p50_us", "rtt_p99_us", "small_msgs_per_s", "64mib_gbps")
# The issue named vime ipc's throughput keys before the per-transport scheme.
RENAMED = {"vime_ipc_small_msgs_per_s": "vime_small_msgs_per_s", "vime_ipc_64mib_gbps": "vime_local_64mib_gbps"}


def json_key(transport_key: str, metric: str) -> str:
    key = f"{transport_key}_{metric}"
    return RENAMED.get(key, key)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


async def time_calls(call: Callable[[], Awaitable[None]], count: int) -> list[float]:
    """Seconds taken by each of ``count`` sequential calls."""
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        await call()
        seconds.append(time.perf_counter() - start)
    return seconds


def confirm(what: str, reported: int, expected: int) -> None:
    """A benchmark that lost data measured nothing: stop rather than print its numbers."""
    if reported != expected:
        raise RuntimeError(f"the echo reported {reported} {what}, expected {expected}")


async def measure(transport: Transport, sizes: Sizes, tensor: torch.Tensor) -> Samples:
    """Open the transport, warm it up, then run the rounds."""
    round_trips, burst = sizes.counts(transport.slow)
    samples = Samples()
    async with transport.open() as link:
        await time_calls(link.round_trip, sizes.warm_up)
        await link.burst(burst // 10)
        await link.carry(tensor)  # first mapping, first object-store put, first page faults
        for _ in range(sizes.rounds):
            samples.round_trip_s += await time_calls(link.round_trip, round_trips)
            [seconds] = await time_calls(functools.partial(link.burst, burst), 1)
            samples.msgs_per_s.append(burst / seconds)
            samples.tensor_s += await time_calls(functools.partial(link.carry, tensor), sizes.tensors)
    return samples


# ------------------------------------------------------------------- vime


class VimeLink:
    """The cluster's driver actor talking to a spawned ``echo`` actor."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.notes_sent = 0

    async def round_trip(self) -> None:
        await self.cluster.ask(ECHO, Ping(payload=PAYLOAD), timeout=10)

    async def burst(self, count: int) -> None:
        for _ in range(count):
            await self.cluster.tell(ECHO, Note(seq=self.notes_sent, body=NOTE_BODY))
            self.notes_sent += 1
        tally = await self.cluster.ask(ECHO, CountQuery(), timeout=60)
        confirm("one-way messages", tally.received, self.notes_sent)
        confirm("messages out of order", tally.out_of_order, 0)

    async def carry(self, tensor: torch.Tensor) -> None:
        ack = await self.cluster.ask(ECHO, Blob(tensor=tensor), timeout=60)
        confirm("tensor bytes", ack.nbytes, tensor.nbytes)


@contextlib.asynccontextmanager
async def open_vime(transport: str) -> AsyncIterator[VimeLink]:
    with tempfile.TemporaryDirectory(prefix="vime-bench-") as run_dir:
        async with Cluster.open(run_dir, transport=transport) as cluster:
            await cluster.spawn(ECHO_ROLE, name=ECHO)
            yield VimeLink(cluster)


# ------------------------------------------------- baselines without vime


class PlainEcho:
    """The echo behind the mp pipe, naive pynng and Ray rows.

    A request is ``(method, *args)``; methods returning None are one-way.
    """

    def __init__(self) -> None:
        self.notes = 0

    def echo(self, payload: bytes) -> bytes:
        return payload

    def note(self, body: bytes) -> None:
        self.notes += 1

    def count(self) -> int:
        return self.notes

    def nbytes(self, data: Any) -> int:
        return memoryview(data).nbytes

    def handle(self, request: list[Any] | tuple[Any, ...]) -> Any:
        method, *args = request
        return getattr(self, method)(*args)


@contextlib.contextmanager
def child_process(target: Callable[..., None], *args: Any) -> Iterator[None]:
    """A spawned child that is terminated (killed, if need be) on exit, however we leave."""
    child = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    child.start()
    try:
        yield
    finally:
        child.terminate()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()


def serve_pipe(conn: Any) -> None:
    echo = PlainEcho()
    while True:
        reply = echo.handle(conn.recv())
        if reply is not None:
            conn.send(reply)


class PipeLink:
    """multiprocessing Connection.send/recv: every message pickled, tensors as numpy arrays."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.notes_sent = 0

    async def round_trip(self) -> None:
        self.conn.send(("echo", PAYLOAD))
        self.conn.recv()

    async def burst(self, count: int) -> None:
        for _ in range(count):
            self.conn.send(("note", NOTE_BODY))
        self.notes_sent += count
        self.conn.send(("count",))
        confirm("one-way messages", self.conn.recv(), self.notes_sent)

    async def carry(self, tensor: torch.Tensor) -> None:
        self.conn.send(("nbytes", tensor.numpy()))
        confirm("tensor bytes", self.conn.recv(), tensor.nbytes)


@contextlib.asynccontextmanager
async def open_pipe() -> AsyncIterator[PipeLink]:
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    with child_process(serve_pipe, theirs):
        yield PipeLink(ours)


def serve_naive(address: str, blocking: bool) -> None:
    if blocking:
        echo_blocking(address)
    else:
        trio.run(naive_echo, address)


def echo_blocking(address: str) -> None:
    echo = PlainEcho()
    with pynng.Pair0(dial=address, recv_max_size=0) as sock:
        while True:
            reply = echo.handle(msgpack.unpackb(sock.recv()))
            if reply is not None:
                sock.send(msgpack.packb(reply))


async def naive_echo(address: str) -> None:
    echo = PlainEcho()
    with pynng.Pair0(dial=address, recv_max_size=0) as sock:
        while True:
            reply = echo.handle(msgpack.unpackb(await sock.arecv()))
            if reply is not None:
                await sock.asend(msgpack.packb(reply))


class NaiveLink:
    """pynng Pair0 and msgpack, no runtime: with trio ``asend``/``arecv`` (the design
    research timed before vime's runtime), or with blocking calls on both sides
    (what nng itself costs: the floor under any runtime built on it)."""

    def __init__(self, sock: pynng.Pair0, blocking: bool) -> None:
        self.sock = sock
        self.blocking = blocking
        self.notes_sent = 0

    async def send(self, *request: Any) -> None:
        data = msgpack.packb(request)
        if self.blocking:
            self.sock.send(data)
        else:
            await self.sock.asend(data)

    async def request(self, *request: Any) -> Any:
        await self.send(*request)
        return msgpack.unpackb(self.sock.recv() if self.blocking else await self.sock.arecv())

    async def round_trip(self) -> None:
        await self.request("echo", PAYLOAD)

    async def burst(self, count: int) -> None:
        for _ in range(count):
            await self.send("note", NOTE_BODY)
        self.notes_sent += count
        confirm("one-way messages", await self.request("count"), self.notes_sent)

    async def carry(self, tensor: torch.Tensor) -> None:
        confirm("tensor bytes", await self.request("nbytes", tensor.numpy().tobytes()), tensor.nbytes)


@contextlib.asynccontextmanager
async def open_naive(blocking: bool) -> AsyncIterator[NaiveLink]:
    with tempfile.TemporaryDirectory(prefix="vime-bench-") as folder:
        address = f"ipc://{folder}/naive"
        with pynng.Pair0(listen=address, recv_max_size=0) as sock, child_process(serve_naive, address, blocking):
            yield NaiveLink(sock, blocking)


class RayLink:
    """Ray actor method calls; ``ray.get`` blocks, which is how a Ray driver waits."""

    def __init__(self, ray: Any, actor: Any) -> None:
        self.ray = ray
        self.actor = actor

    async def round_trip(self) -> None:
        self.ray.get(self.actor.echo.remote(PAYLOAD))

    async def burst(self, count: int) -> None:
        # Pipelined calls, then waiting on them all: Ray's way to stream one-way work.
        self.ray.get([self.actor.note.remote(NOTE_BODY) for _ in range(count)])

    async def carry(self, tensor: torch.Tensor) -> None:
        confirm("tensor bytes", self.ray.get(self.actor.nbytes.remote(tensor.numpy())), tensor.nbytes)


@contextlib.asynccontextmanager
async def open_ray() -> AsyncIterator[RayLink]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # read at import: no network, no prompt
    import ray  # the bench extra; imported here so that spawned children do not pay for it

    try:  # inside: shutdown also reaps what a half-finished init started
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        actor = ray.remote(PlainEcho).remote()
        ray.get(actor.count.remote())  # waits for its worker process
        yield RayLink(ray, actor)
    finally:
        ray.shutdown()


def transports() -> list[Transport]:
    ray_missing = None if importlib.util.find_spec("ray") else "not installed"
    return [
        Transport("vime_ipc", "vime ipc (shm tensors)", functools.partial(open_vime, "ipc")),
        Transport("vime_tcp", "vime tcp (inline tensors)", functools.partial(open_vime, "tcp")),
        Transport("ray", "Ray actor calls", open_ray, slow=True, missing=ray_missing),
        Transport("mp_pipe", "mp Pipe + pickle", open_pipe),
        Transport("naive_trio_pynng", "naive trio+pynng", functools.partial(open_naive, False), slow=True),
        Transport("pynng_blocking", "pynng blocking (floor)", functools.partial(open_naive, True)),
    ]


# ---------------------------------------------------------------- report


def table(rows: list[Transport], results: dict[str, dict[str, float] | None]) -> str:
    """Rows are transports; ratio columns divide each by vime ipc (rtt: >1 is slower, rates: <1 is slower)."""
    header = ["transport", "rtt p50 us", "rtt p99 us", "small msgs/s", "64MiB GB/s",
              "p50 / ipc", "msgs / ipc", "GB/s / ipc"]
    base = results["vime_ipc"]
    lines = [header]
    for transport in rows:
        values = results[transport.key]
        if values is None:
            lines.append([f"{transport.label} ({transport.missing})", *["-"] * (len(header) - 1)])
            continue
        ratios = [f"{values[m] / base[m]:.2f}x" if base else "-"
                  for m in ("rtt_p50_us", "small_msgs_per_s", "64mib_gbps")]
        lines.append([transport.label, f"{values['rtt_p50_us']:.1f}", f"{values['rtt_p99_us']:.1f}",
                      f"{values['small_msgs_per_s']:,.0f}", f"{values['64mib_gbps']:.2f}", *ratios])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                               for column, (cell, width) in enumerate(zip(line, widths)))
                     for line in lines)


def checks(flat: dict[str, Any]) -> list[str]:
    """The issue's acceptance lines: PASS, FAIL, or SKIP when a number is missing. Never enforced."""
    ray_over_ipc = flat["ray_rtt_p50_us"] / flat["vime_ipc_rtt_p50_us"] if flat["ray_rtt_p50_us"] else None
    rows = [
        ("vime ipc rtt p50 us", flat["vime_ipc_rtt_p50_us"], "<", 120),
        ("ray rtt p50 / vime ipc rtt p50", ray_over_ipc, ">=", 5),
        ("vime small msgs/s", flat["vime_small_msgs_per_s"], ">=", 50_000),
        ("vime local 64MiB GB/s", flat["vime_local_64mib_gbps"], ">=", flat["ray_64mib_gbps"]),
        ("vime tcp 64MiB GB/s", flat["vime_tcp_64mib_gbps"], ">=", 0.6),
    ]
    lines = []
    for what, value, op, bound in rows:
        if value is None or bound is None:
            lines.append(f"SKIP  {what} {op} {'ray' if bound is None else bound}: no number to compare")
            continue
        passed = value < bound if op == "<" else value >= bound
        lines.append(f"{'PASS' if passed else 'FAIL'}  {what} {op} {number(bound)}: {number(value)}")
    return lines


def number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def machine() -> dict[str, Any]:
    """Facts that make a stored result comparable with a later one."""

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "nproc": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pynng": version("pynng"),
        "trio": version("trio"),
        "ray": version("ray"),
        "vime_commit": git_commit(),
        "command": shlex.join([sys.executable, *sys.argv]),
    }


def git_commit() -> str | None:
    """The commit of the checkout this file lives in; None outside one."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Example: python bench/transport.py --quick --json bench/transport.json")
    parser.add_argument("--quick", action="store_true", help="fewer samples; finishes in under 40 s")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    started = time.perf_counter()
    facts = machine()
    configure("warning")  # the driver actor logs every registration at info
    sizes = QUICK if args.quick else FULL
    tensor = torch.ones(TENSOR_ELEMENTS, dtype=torch.float32)
    rows = transports()
    results: dict[str, dict[str, float] | None] = {}
    seconds: dict[str, float] = {}
    for transport in rows:
        results[transport.key] = None
        if transport.missing:
            print(f"{transport.label}: skipped, {transport.missing}", file=sys.stderr)
            continue
        began = time.perf_counter()
        results[transport.key] = trio.run(measure, transport, sizes, tensor).summary()
        seconds[transport.key] = round(time.perf_counter() - began, 2)
        print(f"{transport.label}: {seconds[transport.key]:.1f} s", file=sys.stderr)
    flat = {json_key(t.key, m): (results[t.key] or {}).get(m) for t in rows for m in METRICS}
    verdicts = checks(flat)
    wall_s = time.perf_counter() - started
    mode = "quick" if args.quick else "full"
    print(table(rows, results), "", *verdicts, "", f"wall time {wall_s:.1f} s after imports ({mode})", sep="\n")
    if args.json:
        document = {**flat, "checks": verdicts, "machine": facts, "sizes": dataclasses.asdict(sizes),
                    "seconds_per_transport": seconds, "wall_s": round(wall_s, 2)}
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
