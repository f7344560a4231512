"""Weights between two hosts on CPU: vime's nng path against a gloo broadcast and the link's raw bandwidth.

Issue 35 item 4's figures. Two network namespaces stand in for two hosts (``vime.devtools.netns``: veth pairs on
a bridge, this machine's kernel moving the bytes). One full update of a Qwen3-0.6B-sized state dict (1.2 GB of
bf16 tensors of 16 MiB, as a layer's weights come) goes from host b to host c three ways, side by side:

* ``raw``: one TCP connection, the bytes of the tensors written with ``sendall`` and read into one buffer: the
  floor any path pays on this link;
* ``gloo``: ``torch.distributed.broadcast`` from rank 0 on b to rank 1 on c, bucket by bucket (``--bucket-mb``),
  as a broadcast group to engines on other hosts would carry it on CPU;
* ``nng``: vime's own path today, an actor on b (started there by a node agent, as the trainer would be) telling
  ``WeightsChunk`` messages of ``--chunk-mb`` (``--weight-chunk-mb``) to an actor on c, which answers once it
  holds every chunk.

Each is timed ``--runs`` times after one warm-up; medians are quoted. The result is a table and a JSON document
(``--json``) with the command, date, commit and machine. Needs root (namespaces); nothing leaves this machine.

Usage::

    python bench/crosshost.py --json bench/results/crosshost-cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

import torch
import trio

from vime.cluster import Cluster
from vime.devtools.netns import Hosts, make_hosts
from vime.runtime import Actor, handles
from vime.transports.codec import Envelope
from vime.transports.records import message
from vime.weights.nng import WeightsChunk, grouped

REPO = Path(__file__).resolve().parent.parent
PORT = 29517  # inside the namespaces, which nothing else uses
TENSOR_MB = 16


def state_dict(total_mb: int) -> dict[str, torch.Tensor]:
    """``total_mb`` of bf16 tensors of ``TENSOR_MB`` each, named as layers are."""
    count = max(1, total_mb // TENSOR_MB)
    return {f"layers.{i}.weight": torch.randn(TENSOR_MB << 19, dtype=torch.float32).to(torch.bfloat16)
            for i in range(count)}


# ---------------------------------------------------------------------------------------------- nng: two actors


@message
class SendWeights:
    """bench driver -> sender (ask, answered with WeightsHeld): send version ``version`` to ``to``."""

    to: str
    version: int


@message
class WeightsHeld:
    """receiver -> sender, and sender -> bench driver: every chunk of ``version`` is in."""

    version: int


@message
class HeldQuery:
    """sender -> receiver (ask, answered with WeightsHeld once all of ``version`` is in)."""

    version: int


class Sender(Actor):
    role = "bench-sender"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunks = grouped(state_dict(self.config["total_mb"]), self.config["chunk_mb"] << 20)

    @handles(SendWeights)
    async def _on_send_weights(self, msg: SendWeights, envelope: Envelope) -> WeightsHeld:
        for index, tensors in enumerate(self.chunks):
            await self.tell(msg.to, WeightsChunk(version=msg.version, index=index, count=len(self.chunks),
                                                 tensors=tensors))
        return await self.ask(msg.to, HeldQuery(version=msg.version), timeout=600)


class Receiver(Actor):
    role = "bench-receiver"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[int, int] = {}
        self.complete: dict[int, trio.Event] = {}

    def _event(self, version: int) -> trio.Event:
        return self.complete.setdefault(version, trio.Event())

    @handles(WeightsChunk)
    async def _on_chunk(self, msg: WeightsChunk, envelope: Envelope) -> None:
        self.held[msg.version] = self.held.get(msg.version, 0) + 1
        if self.held[msg.version] == msg.count:
            self._event(msg.version).set()

    @handles(HeldQuery)
    async def _on_held_query(self, msg: HeldQuery, envelope: Envelope) -> WeightsHeld:
        await self._event(msg.version).wait()
        return WeightsHeld(version=msg.version)


@contextlib.asynccontextmanager
async def agents_on_b_and_c(hosts: Hosts, workdir: Path, roles: list[str]) -> AsyncIterator[Any]:
    """A job on the head and a node agent on each of b and c allowed to start ``roles`` (``module:Class`` under
    bench/); yields the job, with both agents joined. Shared with bench/crosshost_delta.py."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "bench"),
                                                                      os.environ.get("PYTHONPATH")])))
    allowed = [flag for role in roles for flag in ("--allow-role", role)]
    async with Cluster.open(workdir / "run", transport="tcp", host=hosts.head_ip) as job:
        agents = []
        for host in ("b", "c"):
            command = hosts.command(host, sys.executable, "-m", "vime.node", "--join", job.address, "--name", host,
                                    *allowed, "--run-dir", str(workdir / host))
            agents.append(await trio.lowlevel.open_process(command, env=dict(env, VIME_TOKEN=job.token)))
        try:
            for host in ("b", "c"):
                await job.wait_event("node joined", host, timeout=120)
            yield job
        finally:
            for agent in agents:
                agent.terminate()
            for agent in agents:
                await agent.wait()


async def time_nng(hosts: Hosts, args: argparse.Namespace, workdir: Path) -> list[float]:
    """Node agents on b and c, the sender and receiver actors started there; one timed update per run."""
    async with agents_on_b_and_c(hosts, workdir, ["crosshost:Sender", "crosshost:Receiver"]) as job:
        await job.spawn("crosshost:Receiver", "receiver", node="c", timeout=120)
        await job.spawn("crosshost:Sender", "sender", {"total_mb": args.total_mb, "chunk_mb": args.chunk_mb},
                        node="b", timeout=300)
        seconds = []
        for version in range(args.runs + 1):
            started = time.perf_counter()
            await job.ask("sender", SendWeights(to="receiver", version=version), timeout=900)
            seconds.append(time.perf_counter() - started)
        return seconds[1:]


# ------------------------------------------------------------------------------------- raw TCP and gloo, in one


_PEER = r'''
import json, socket, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {bench!r})
from crosshost import state_dict
from vime.weights.nng import grouped
role, ip, port, total_mb, bucket_mb, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:7])
tensors = state_dict(total_mb)
nbytes = sum(t.nbytes for t in tensors.values())
raw, gloo = [], []
if role == "send":
    listener = socket.create_server((ip, port + 1))
    conn, _ = listener.accept()
else:
    time.sleep(1.0)
    conn = socket.create_connection((ip, port + 1))
buffer = bytearray(nbytes)
for _ in range(runs + 1):
    started = time.perf_counter()
    if role == "send":
        for tensor in tensors.values():
            conn.sendall(tensor.view(torch.uint8).numpy().data)
        conn.recv(1)
    else:
        view, got = memoryview(buffer), 0
        while got < nbytes:
            got += conn.recv_into(view[got:])
        conn.sendall(b"k")
    raw.append(time.perf_counter() - started)
dist.init_process_group("gloo", init_method=f"tcp://{{ip}}:{{port}}", rank=0 if role == "send" else 1, world_size=2)
buckets = [torch.cat([t.flatten() for t in part.values()]) for part in grouped(tensors, bucket_mb << 20)]
for _ in range(runs + 1):
    dist.barrier()
    started = time.perf_counter()
    for bucket in buckets:
        dist.broadcast(bucket, src=0)
    dist.barrier()
    gloo.append(time.perf_counter() - started)
dist.destroy_process_group()
if role == "recv":
    print(json.dumps({{"raw": raw[1:], "gloo": gloo[1:]}}))
'''


def time_raw_and_gloo(hosts: Hosts, args: argparse.Namespace) -> dict[str, list[float]]:
    """A process on b (sender, rank 0) and one on c (receiver, rank 1): the raw link, then the gloo broadcast."""
    code = _PEER.format(bench=str(REPO / "bench"))
    flags = [hosts.ips["b"], str(PORT), str(args.total_mb), str(args.bucket_mb), str(args.runs)]
    sender = subprocess.Popen(hosts.command("b", sys.executable, "-c", code, "send", *flags),
                              env=dict(os.environ, GLOO_SOCKET_IFNAME=hosts.interface("b")))
    try:
        out = subprocess.run(hosts.command("c", sys.executable, "-c", code, "recv", *flags), capture_output=True,
                             text=True, timeout=1800, check=True,
                             env=dict(os.environ, GLOO_SOCKET_IFNAME=hosts.interface("c"))).stdout
    finally:
        try:
            sender.wait(timeout=30)
        except subprocess.TimeoutExpired:  # rank 0 may wait in its store's teardown after the figures are in
            sender.kill()
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mb", type=int, default=1200, help="state dict size (Qwen3-0.6B in bf16: ~1,200)")
    parser.add_argument("--chunk-mb", type=int, default=64, help="nng chunk size (--weight-chunk-mb's default)")
    parser.add_argument("--bucket-mb", type=int, default=256, help="broadcast bucket size")
    parser.add_argument("--runs", type=int, default=3, help="timed updates per path, after one warm-up")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    gb = args.total_mb / 1024
    with make_hosts("b", "c") as hosts, tempfile.TemporaryDirectory(prefix="vime-crosshost-") as workdir:
        seconds = time_raw_and_gloo(hosts, args)
        seconds["nng"] = trio.run(time_nng, hosts, args, Path(workdir))
    rows = {path: {"median_s": statistics.median(values), "runs_s": values,
                   "gb_per_s": gb / statistics.median(values)} for path, values in seconds.items()}
    print(f"one update of {args.total_mb} MB between two network namespaces ({args.runs} runs, medians)")
    print(f"{'path':<6} {'seconds':>9} {'GB/s':>7} {'x raw':>7}")
    for path, row in rows.items():
        print(f"{path:<6} {row['median_s']:>9.3f} {row['gb_per_s']:>7.2f} "
              f"{row['median_s'] / rows['raw']['median_s']:>7.2f}")
    if args.json:
        document = {**provenance("bench/crosshost.py"), "total_mb": args.total_mb, "chunk_mb": args.chunk_mb,
                    "bucket_mb": args.bucket_mb, "rows": rows}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def provenance(script: str) -> dict[str, str]:
    """Where a JSON record of these benches comes from: the date, the commit, the command and the machine."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    return {"date": datetime.date.today().isoformat(), "commit": commit,
            "command": " ".join(["python", script, *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}


if __name__ == "__main__":
    sys.exit(main())
