"""Delta weight sync between two hosts on CPU: ``--weight-sync nng-delta`` against the full ``nng`` path.

Issue 36 item 6's figures. Two network namespaces stand in for two hosts (``vime.devtools.netns``, as
bench/crosshost.py); ``--rate-mbit`` caps host b's link with a token bucket (``tc``), to stand for a slower NIC
than the kernel's copy. An actor on b holds a trainer's weights as a mixed-precision optimizer keeps them: fp32
masters (``--total-mb`` of bf16 as the engine loads them, tensors of 16 MiB, Qwen3-0.6B's size by default,
initialised N(0, 0.02) as its matrices are), stepped like Adam's first step (``lr`` times the sign of a random
gradient: the largest per-element step Adam takes, so the fewest unchanged bf16 elements). It publishes each
version through vime's own :class:`~vime.weights.WeightSender` to an actor on c holding a
:class:`~vime.weights.WeightReceiver`, by each path in turn; an update is timed from the publication to the
receiver's engine holding the version (the gather and conversion to bf16, the encoding, the link, the rebuild).
For each learning rate: the fraction of bf16 elements unchanged by a step, bytes and seconds per update for
both paths (medians of ``--runs`` after the first, which goes whole on both), and whether the receiver's engine
ends bit-identical to the trainer's (a hash of every tensor). Prints a table and writes JSON (``--json``);
decides nothing. Needs root.

Usage::

    python bench/crosshost_delta.py --json bench/results/crosshost-delta-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Iterator

import torch
import trio
from crosshost import TENSOR_MB, agents_on_b_and_c, provenance

from vime.devtools.netns import Hosts, make_hosts
from vime.runtime import Actor, handles
from vime.transports.codec import Envelope
from vime.transports.records import message
from vime.weights import RECEIVED, Nng, NngDelta, WeightReceiver, WeightSender
from vime.weights.nng_delta import digest, wire_bytes


@message
class Publish:
    """bench driver -> trainer (ask, answered with Published): step the weights with ``lr`` and publish the new
    version to the receiver by ``path``."""

    lr: float
    path: str


@message
class Published:
    """trainer -> bench driver: the version, its seconds from publication to the receiver holding it, the tensor
    bytes it sent, the fraction of bf16 elements the step left unchanged, and the hashes on both sides."""

    version: int
    seconds: float
    wire_bytes: int
    unchanged: float
    digest: str
    receiver_digest: str


@message
class HoldsQuery:
    """trainer -> receiver (ask, answered with Holds once its engine holds ``version``); with ``digest`` the
    answer hashes what the engine holds (after the timing)."""

    version: int
    digest: bool


@message
class Holds:
    """receiver -> trainer: the engine holds ``version``; ``digest`` hashes its tensors when asked ("" if not)."""

    version: int
    digest: str


class _Engine:
    """A trainer's weights as the weight paths read them: fp32 masters, handed out in bf16."""

    device = "cpu"

    def __init__(self, total_mb: int) -> None:
        self.weight_version = 0
        generator = torch.Generator().manual_seed(0)
        self.master = {f"layers.{i}.weight": torch.randn(TENSOR_MB << 19, generator=generator) * 0.02
                       for i in range(max(1, total_mb // TENSOR_MB))}
        self.generator = generator

    def step(self, lr: float) -> float:
        """Adam's first step on a random gradient; the fraction of bf16 elements left unchanged."""
        same = total = 0
        for weight in self.master.values():
            before = weight.to(torch.bfloat16)
            weight.sub_(torch.randn(weight.shape, generator=self.generator).sign_(), alpha=lr)
            same += int(torch.eq(before.view(torch.int16), weight.to(torch.bfloat16).view(torch.int16)).sum())
            total += weight.numel()
        self.weight_version += 1
        return same / total

    def rollout_weights(self, dtype: torch.dtype, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, weight.to(dtype)) for name, weight in self.master.items())


class Trainer(Actor):
    role = "bench-trainer"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = _Engine(self.config["total_mb"])
        job = types.SimpleNamespace(weight_sync="nng", weight_chunk_mb=self.config["chunk_mb"])
        run = types.SimpleNamespace(job=job, model=types.SimpleNamespace(dtype="bf16"))
        self.weights = WeightSender(self, self.engine, run, gone=lambda worker: None)

    @handles(Publish)
    async def _on_publish(self, msg: Publish, envelope: Envelope) -> Published:
        path = {"nng": Nng, "nng-delta": NngDelta}[msg.path]
        if self.weights.paths.get("receiver") is not path:
            self.weights.detach("receiver")
            self.weights.serve("receiver", path)
        unchanged = await trio.to_thread.run_sync(self.engine.step, msg.lr)
        version = self.engine.weight_version
        started = time.perf_counter()
        await self.weights.publish(["receiver"])
        await self.ask("receiver", HoldsQuery(version=version, digest=False), timeout=900)
        seconds = time.perf_counter() - started
        holds = await self.ask("receiver", HoldsQuery(version=version, digest=True), timeout=900)
        if path is Nng:
            sent = sum(t.nbytes for chunk in self.weights.half(Nng).chunks for t in chunk.tensors.values())
        else:
            half = self.weights.half(NngDelta)
            sent = sum(wire_bytes(part) for parts in half.encoded.values() for part in parts)
        ours = await trio.to_thread.run_sync(digest, dict(self.engine.rollout_weights(torch.bfloat16)))
        return Published(version=version, seconds=seconds, wire_bytes=sent, unchanged=unchanged, digest=ours,
                         receiver_digest=holds.digest)


class _Held:
    """The receiver's engine: keeps what it loads (the weight paths hand it fresh tensors)."""

    def __init__(self) -> None:
        self.weight_version = 0
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.weights, self.weight_version = tensors, version


class Receiver(Actor):
    role = "bench-receiver"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = _Held()
        self.loaded = trio.Event()
        self.weights = WeightReceiver(self.engine, between_steps=None, wake=self._wake)

    def _wake(self) -> None:
        """No generation loop here: load at once."""
        self.weights.apply()
        self.loaded.set()
        self.loaded = trio.Event()

    @handles(*RECEIVED)
    async def _on_weights(self, msg: Any, envelope: Envelope) -> Any:
        """Every weight message goes to the receiver half, as a rollout worker's does."""
        return await self.weights.receive(msg)

    @handles(HoldsQuery)
    async def _on_holds(self, msg: HoldsQuery, envelope: Envelope) -> Holds:
        while self.engine.weight_version < msg.version:
            await self.loaded.wait()
        hashed = await trio.to_thread.run_sync(digest, self.engine.weights) if msg.digest else ""
        return Holds(version=msg.version, digest=hashed)


def cap_link(hosts: Hosts, host: str, rate_mbit: int) -> None:
    """``host``'s outgoing bytes at most ``rate_mbit`` Mbit/s (a token bucket on its end of the link)."""
    subprocess.run(["ip", "netns", "exec", hosts.namespaces[host], "tc", "qdisc", "add", "dev",
                    hosts.interface(host), "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "4mb",
                    "latency", "100ms"], check=True)


async def measure(hosts: Hosts, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """For each learning rate and path: one whole update, then ``runs`` timed ones."""
    rows: dict[str, Any] = {}
    async with agents_on_b_and_c(hosts, workdir, ["crosshost_delta:Trainer", "crosshost_delta:Receiver"]) as job:
        await job.spawn("crosshost_delta:Receiver", "receiver", node="c", timeout=120)
        await job.spawn("crosshost_delta:Trainer", "trainer", {"total_mb": args.total_mb, "chunk_mb": args.chunk_mb},
                        node="b", timeout=600)
        for lr in args.lr:
            for path in ("nng", "nng-delta"):
                updates = [await job.ask("trainer", Publish(lr=lr, path=path), timeout=1800)
                           for _ in range(args.runs + 1)]
                timed = updates[1:]
                rows[f"{path} lr={lr:g}"] = {
                    "path": path, "lr": lr, "median_s": statistics.median(u.seconds for u in timed),
                    "runs_s": [u.seconds for u in timed],
                    "wire_mb": statistics.median(u.wire_bytes for u in timed) / 2**20,
                    "first_update_s": updates[0].seconds, "unchanged": statistics.median(u.unchanged for u in timed),
                    "bit_identical": all(u.digest == u.receiver_digest for u in updates)}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mb", type=int, default=1200, help="state dict size (Qwen3-0.6B in bf16: ~1,200)")
    parser.add_argument("--chunk-mb", type=int, default=64, help="nng chunk size (--weight-chunk-mb's default)")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5], help="learning rates of the steps")
    parser.add_argument("--runs", type=int, default=3, help="timed updates per path and rate, after a whole one")
    parser.add_argument("--rate-mbit", type=int, default=0, help="cap host b's link at this rate (0: no cap)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    with make_hosts("b", "c") as hosts, tempfile.TemporaryDirectory(prefix="vime-crossdelta-") as workdir:
        if args.rate_mbit:
            cap_link(hosts, "b", args.rate_mbit)
        rows = trio.run(measure, hosts, args, Path(workdir))
    link = f"{args.rate_mbit} Mbit/s" if args.rate_mbit else "uncapped"
    print(f"one update of {args.total_mb} MB of bf16 between two network namespaces, link {link} "
          f"({args.runs} runs after a whole one, medians)")
    print(f"{'path':<10} {'lr':>7} {'unchanged':>10} {'wire MB':>9} {'seconds':>9} {'x full':>7} {'exact':>6}")
    for row in rows.values():
        full = rows[f"nng lr={row['lr']:g}"]
        print(f"{row['path']:<10} {row['lr']:>7g} {row['unchanged']:>10.4f} {row['wire_mb']:>9.1f} "
              f"{row['median_s']:>9.3f} {row['median_s'] / full['median_s']:>7.2f} {str(row['bit_identical']):>6}")
    if args.json:
        document = {**provenance("bench/crosshost_delta.py"), "total_mb": args.total_mb, "chunk_mb": args.chunk_mb,
                    "rate_mbit": args.rate_mbit, "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        existing = json.loads(args.json.read_text()) if args.json.exists() else {}
        existing[f"{link}, {document['commit']}"] = document
        args.json.write_text(json.dumps(existing, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
