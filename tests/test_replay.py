"""Message logs and replay: crash safety, a recorded run replayed with no
divergence, and a planted divergence found."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio
from test_async import hold_run_until_serving

from conftest import open_job
from vime.cluster import Cluster
from vime.pipeline import train
from vime.replay import judge, replay, show
from vime.scenarios import arithmetic
from vime.scenarios.selfcheck import ECHO, TALLY, Add, Blob, Snapshot, Total, Totals
from vime.transports.codec import Envelope, decode_frame, encode, encode_frame
from vime.transports.msglog import LogWriter, scan


def test_log_round_trip_and_torn_tail_is_skipped_then_cut(tmp_path):
    path = tmp_path / "a.vlog"
    writer = LogWriter(path, {"name": "a", "role": "tally"})
    writer.write("in", "peer", b"frame-1", {"seg": b"attached"})
    writer.write("out", "peer", b"frame-2", {})
    writer.close()
    intact = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00half a rec")  # a crash mid-write
    log = scan(path)
    assert [r.direction for r in log.records] == ["open", "in", "out"]
    assert log.records[1].frame == b"frame-1" and log.records[1].attachments == {"seg": b"attached"}
    assert "torn record" in log.problem and log.good_end == intact
    writer = LogWriter(path, {"name": "a", "role": "tally"})  # a restarted actor appends after the cut
    writer.write("in", "peer", b"frame-3", {})
    writer.close()
    log = scan(path)
    assert log.problem is None
    assert [r.frame for r in log.records if r.direction == "in"] == [b"frame-1", b"frame-3"]


def test_corruption_in_the_middle_stops_reading_there(tmp_path):
    path = tmp_path / "a.vlog"
    writer = LogWriter(path, {"name": "a"})
    for i in range(3):
        writer.write("in", "p", b"x" * 10 + bytes([i]), {})
    writer.close()
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    log = scan(path)
    assert len(log.records) == 3 and "checksum" in log.problem


async def record_tally_run(run_dir: Path) -> Path:
    async with open_job(run_dir, record=True) as job:
        await job.spawn(TALLY, "tally0", seed=7)
        totals = {}
        for i in range(40):
            total = await job.ask("tally0", Add(key=f"k{i % 4}", amount=i))
            totals[total.key] = total.total
        assert await job.ask("tally0", Snapshot()) == Totals(totals=totals, changes=40)
    return run_dir / "messages" / "tally0.vlog"


async def test_replay_of_a_recorded_actor_shows_no_divergence(tmp_path):
    log_path = await record_tally_run(tmp_path)
    result = await trio.to_thread.run_sync(replay, log_path, TALLY)
    assert result.divergence is None, str(result.divergence)
    assert result.compared == 41 and result.problem is None
    assert result.stopped and result.beyond_stop == 0  # the job's end told it to stop: its Shutdown is in the log
    cli = subprocess.run([sys.executable, "-m", "vime.replay", str(log_path), "--role", TALLY], capture_output=True,
                         text=True)
    assert cli.returncode == 0 and "no divergence" in cli.stdout
    shown = subprocess.run([sys.executable, "-m", "vime.replay", "show", str(log_path), "--role", TALLY],
                           capture_output=True, text=True)
    assert shown.returncode == 0
    assert "Add" in shown.stdout and "Total" in shown.stdout and "role=tally" in shown.stdout


async def test_a_log_names_no_module_to_import(tmp_path):
    """The logged role is looked up among the built-in roles only; another actor's class is named on our own
    command line, never taken from the log."""
    log_path = await record_tally_run(tmp_path)
    with pytest.raises(LookupError, match="unknown role 'tally'.*--role package.module:Class"):
        replay(log_path)
    cli = subprocess.run([sys.executable, "-m", "vime.replay", str(log_path)], capture_output=True, text=True)
    assert cli.returncode == 2 and "--role package.module:Class" in cli.stderr


async def test_replay_finds_a_planted_divergence(tmp_path):
    log_path = await record_tally_run(tmp_path)
    records = scan(log_path).records
    tampered = tmp_path / "tampered.vlog"
    writer = LogWriter(tampered, records[0].meta)
    outgoing_totals = 0
    for record in records[1:]:
        frame = record.frame
        if record.direction == "out":
            (message,) = decode_frame(bytearray(frame), max_message_bytes=1 << 30).messages
            if isinstance(message.payload, Total):
                outgoing_totals += 1
                if outgoing_totals == 17:  # the 17th answer now claims one more
                    message.payload.total += 1
                    frame = bytes(encode_frame("x", None, [encode(message)]))
        writer.write(record.direction, record.peer, frame, record.attachments, wall_time=record.wall_time)
    writer.close()
    result = await trio.to_thread.run_sync(replay, tampered, TALLY)
    assert result.divergence is not None
    assert result.divergence.index == 16 and result.divergence.field == "payload"
    ((path, recorded, replayed),) = result.divergence.fields  # field by field: only the one that differs
    assert path == "payload.total" and int(recorded) == int(replayed) + 1
    cli = subprocess.run([sys.executable, "-m", "vime.replay", str(tampered), "--role", TALLY], capture_output=True,
                         text=True)
    assert cli.returncode == 1 and "first divergence at sent message #16" in cli.stdout
    assert f"payload.total: recorded {recorded}, replayed {replayed}" in cli.stdout


async def test_replay_restores_shared_memory_tensors_from_the_log(tmp_path):
    async with open_job(tmp_path, record=True) as job:
        await job.spawn(ECHO, "echo0")
        tensor = torch.randn(1 << 19)  # 2 MiB: over the shared-memory threshold
        reply = await job.ask("echo0", Blob(tensor=tensor, echo=True))
        assert torch.equal(reply.tensor, tensor)
    result = await trio.to_thread.run_sync(replay, tmp_path / "messages" / "echo0.vlog", ECHO)
    assert result.divergence is None and result.compared == 1


async def record_pipeline_run_with_a_joined_worker(run_dir: Path) -> dict:
    """A short asynchronous run over tcp, every actor recording, and a rollout worker joined by hand (it gets
    the job's settings from the driver, as on another host)."""
    config = arithmetic.prepare(run_dir, arithmetic.defaults().replace(
        steps=6, rollout_workers=1, rollout_batch_size=8, rollout_capacity=4, max_staleness=1, max_new_tokens=8))
    joined: dict[str, trio.Process] = {}

    async def join(job: Cluster, row: dict) -> None:
        if row["step"] == 1:
            command = [sys.executable, "-m", "vime.actor", "rollout", "--join", job.address, "--run-dir",
                       str(run_dir), "--record", "--name", "rollout-joined", "--token", job.token]
            joined["process"] = await trio.lowlevel.open_process(command, stdout=subprocess.DEVNULL,
                                                                 stderr=subprocess.DEVNULL)
            await hold_run_until_serving(job, "rollout-joined", "joined")

    try:
        return await train(config, run_dir, transport="tcp", record=True, on_step=join, timeout_s=300)
    finally:
        with trio.move_on_after(30):  # the job's end shuts the joined worker down too
            await joined["process"].wait()
        joined["process"].kill()


async def test_every_actor_kind_replays_with_no_divergence_in_time_proportionate_to_the_run(tmp_path):
    """Buffer, router, reward, trainer, a rollout worker started by the driver and one joined by hand: each
    replays with no divergence, each in less time than the run took. The driver's log is refused before
    any work, saying why."""
    run_dir = tmp_path / "run"
    summary = await record_pipeline_run_with_a_joined_worker(run_dir)
    logs = {path.stem: path for path in (run_dir / "messages").glob("*.vlog")}
    assert set(logs) == {"buffer", "router", "reward", "trainer", "rollout-0", "rollout-joined", "driver"}
    with pytest.raises(LookupError, match="driver log is not replayed: the driver .* is not an actor"):
        replay(logs["driver"])
    cli = await trio.run_process([sys.executable, "-m", "vime.replay", str(run_dir / "messages")],
                                 capture_stdout=True, capture_stderr=True, check=False)
    said = cli.stdout.decode()
    assert cli.returncode == 0, said
    outcomes = dict(re.findall(r"^(\S+)\.vlog:\n(.*)$", said, re.MULTILINE))
    assert said.startswith("driver.vlog: not replayed: a driver log is not replayed")  # before any work
    assert sorted(outcomes) == sorted(set(logs) - {"driver"}), said
    assert all(outcome.startswith("no divergence") for outcome in outcomes.values()), said
    assert not re.search(r"\b0 sent messages compared", said), said
    seconds = {name: float(re.search(r"([0-9.]+) s\)$", outcome)[1]) for name, outcome in outcomes.items()}
    assert max(seconds.values()) < summary["total_s"], (seconds, summary["total_s"])  # each kind, alone, less
    assert "(an engine step began)" in show_text(logs["rollout-joined"])


def show_text(path: Path) -> str:
    shown = io.StringIO()
    show(path, shown)
    return shown.getvalue()


def test_only_an_original_told_to_stop_may_have_sent_fewer_than_its_replay():
    """The reward scores in worker processes, in real time: its replay can finish groups the original dropped as
    Shutdown stopped it. Surplus after every recorded message matched is counted then; a killed original's, or
    any difference among the recorded ones, is a divergence."""
    def sent(total: int, at: int = 0) -> list[Envelope]:
        return [Envelope("Total", "tally0", "driver", index, None, 0.0, None, False,
                         Total(key="a", total=at + index, ticket=index, at=0.0))
                for index in range(total)]

    assert judge(sent(3), sent(5), stopped=True) == (None, 2)
    divergence, beyond = judge(sent(3), sent(5), stopped=False)
    assert beyond == 0 and "count: recorded 3 messages, replayed 5" in divergence.field
    divergence, beyond = judge(sent(3), sent(5, at=1), stopped=True)
    assert beyond == 0 and divergence.index == 0 and divergence.fields[0][0] == "payload.total"
    divergence, _ = judge(sent(5), sent(3), stopped=True)  # fewer than recorded: always a divergence
    assert "count: recorded 5 messages, replayed 3" in divergence.field
