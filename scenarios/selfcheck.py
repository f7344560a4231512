"""selfcheck: the actor runtime end to end, on real processes, in ~15 s.

Until the RL pipeline lands this is the default scenario. It starts three
actors, measures ask round trips, a burst of small tells and a 64 MiB tensor,
kills one actor with SIGKILL and restarts it, then replays the stateful
actor's message log (only it records, so the figures above are not
slowed by logging) and checks it reproduces every message it sent. It
trains nothing.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import trio

from vime.cluster import Cluster
from vime.probe import Add, Blob, Count, CountQuery, Note, Ping, Snapshot
from vime.replay import replay

DESCRIPTION = "runtime self-check across real processes (no training yet)"


async def run(run_dir: Path, transport: str, say: Callable[[str], None]) -> dict:
    """Run the checks; returns the figures (also written to RUN_DIR/selfcheck.json)."""
    figures: dict = {"transport": transport}
    async with Cluster.open(run_dir, transport=transport) as job:
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(job.spawn, "echo", "echo0")
            nursery.start_soon(job.spawn, "echo", "echo1")
            nursery.start_soon(partial(job.spawn, "tally", "tally0", record=True))
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

    result = await trio.to_thread.run_sync(replay, run_dir / "messages" / "tally0.vlog")
    figures["replay_divergence"] = None if result.divergence is None else str(result.divergence)
    say(f"replay of tally0's log: {'no divergence' if result.divergence is None else result.divergence} "
        f"({result.compared} sent messages compared)")
    figures["passed"] = bool(figures["notes_intact"] and figures["tensor_intact"] and figures["restarted_answers"]
                             and figures["death_noticed_s"] < 5 and result.divergence is None)
    (run_dir / "selfcheck.json").write_text(json.dumps(figures, indent=2))
    return figures
