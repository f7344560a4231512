"""The runtime across real processes and sockets: ask/tell, backpressure,
supervision, joining, and every kind of bad input."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pynng
import pytest
import torch
import trio

from conftest import make_tls_files, open_job
from vime import PeerGone, RemoteError
from vime.actor import _parser
from vime.cluster import new_join_token
from vime.messages.runtime import ErrorReply, StatusQuery
from vime.runtime import Actor
from vime.scenarios.selfcheck import ECHO, Blob, Count, CountQuery, Nap, Note, Ping, Pong
from vime.transports.codec import Encoded, Envelope, decode_frame, encode_frame
from vime.transports.sockets import Inbox


async def test_ask_and_tell_in_order(tmp_path, transport):
    async with open_job(tmp_path, transport) as job:
        await job.spawn(ECHO, "echo0")
        assert await job.ask("echo0", Ping(payload=b"hello")) == Pong(payload=b"hello")
        for seq in range(3000):
            await job.tell("echo0", Note(seq=seq, body=b"n" * 60))
        assert await job.ask("echo0", CountQuery()) == Count(received=3000, out_of_order=0)


async def test_tensors_cross_processes_intact(tmp_path, transport):
    async with open_job(tmp_path, transport) as job:
        await job.spawn(ECHO, "echo0")
        big = torch.randn(1 << 20)  # 4 MiB: shared memory over ipc, inline over tcp
        halves = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4).transpose(0, 2)
        for tensor in (big, halves):
            reply = await job.ask("echo0", Blob(tensor=tensor, echo=True))
            assert reply.nbytes == tensor.nbytes
            assert reply.tensor.dtype == tensor.dtype and torch.equal(reply.tensor, tensor)


async def test_actors_json_tracks_live_actors(tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0")
        rows = json.loads((tmp_path / "actors.json").read_text())["actors"]
        assert [(r["name"], r["role"], r["pid"], r["address"]) for r in rows] == [
            ("echo0", "echo", info.pid, info.address)]


async def test_backpressure_blocks_the_sender_and_loses_nothing(tmp_path):
    async with open_job(tmp_path) as job:
        await job.spawn(ECHO, "echo0", settings={"inbox_capacity": 8})
        await job.tell("echo0", Nap(seconds=1.5))
        sent = 0
        total = 20_000

        async def flood() -> None:
            nonlocal sent
            for seq in range(total):
                await job.tell("echo0", Note(seq=seq, body=b"b" * 2000))
                sent += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await trio.sleep(0.8)
            stuck_at = sent
        assert stuck_at < total, "the sender was never held back while the receiver slept"
        count = await job.ask("echo0", CountQuery())
        assert count == Count(received=total, out_of_order=0)
        status = await job.ask("echo0", StatusQuery())
        assert status.errors == {}


async def test_a_job_closes_even_when_an_actor_does_not_read_its_inbox(tmp_path):
    """Closing tells every actor to shut down; one that does not read (here, napping behind a full outbox)
    must not hold the job open until it does: it is killed after a bounded wait."""
    async with open_job(tmp_path) as job:
        await job.spawn(ECHO, "echo0", settings={"inbox_capacity": 4})
        await job.tell("echo0", Nap(seconds=60))

        async def flood() -> None:
            for seq in range(100_000):
                await job.tell("echo0", Note(seq=seq, body=b"f" * 4000))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await trio.sleep(1.0)  # the flood is stuck behind the napping actor: the outbox to it is full
            nursery.cancel_scope.cancel()
        closing = time.monotonic()
    assert time.monotonic() - closing < 30  # not the rest of the 60 s nap


async def test_killed_actor_is_reported_within_5s_and_can_restart(tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0")
        started = time.monotonic()
        os.kill(info.pid, signal.SIGKILL)
        event = await job.wait_event("died", "echo0", timeout=5)
        assert time.monotonic() - started < 5
        assert "SIGKILL" in event.detail
        assert json.loads((tmp_path / "actors.json").read_text())["actors"] == []
        with pytest.raises(LookupError):
            await job.ask("echo0", Ping(payload=b"?"), timeout=1)
        restarted = await job.restart("echo0")
        assert restarted.pid != info.pid
        assert await job.ask("echo0", Ping(payload=b"again")) == Pong(payload=b"again")


async def test_ask_waiting_on_a_dying_actor_fails_fast(tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0")
        await job.tell("echo0", Nap(seconds=30))

        async def kill_soon() -> None:
            await trio.sleep(0.3)
            os.kill(info.pid, signal.SIGKILL)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_soon)
            started = time.monotonic()
            with pytest.raises(PeerGone):
                await job.ask("echo0", Ping(payload=b"x"), timeout=20)
        assert time.monotonic() - started < 5


async def test_auto_restart(tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0", restart=True)
        os.kill(info.pid, signal.SIGKILL)
        await job.wait_event("restarted", "echo0", timeout=30)
        assert await job.ask("echo0", Ping(payload=b"back")) == Pong(payload=b"back")
        assert not job.gone_for_good("echo0")


async def test_an_actor_that_leaves_cleanly_is_not_restarted(tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0", restart=True)
        os.kill(info.pid, signal.SIGTERM)
        await job.wait_event("died", "echo0", timeout=10)
        with trio.fail_after(5):
            while not job.gone_for_good("echo0"):
                await trio.sleep(0.05)
        await trio.sleep(1)
        assert "echo0" not in job.actors and "restarted" not in [e.what for e in job.events if e.name == "echo0"]


async def test_an_actor_failing_as_it_starts_is_not_restarted_forever(tmp_path):
    """A broken start-up (a bad engine argument, say) fails again on every restart: the driver stops after
    three failures in a row and says why, instead of restarting it for as long as the job runs."""
    async with open_job(tmp_path) as job:
        with contextlib.suppress(RuntimeError):  # it may fail before or after registering
            await job.spawn(ECHO, "broken", {"fail_on_start": True}, restart=True)
        event = await job.wait_event("gave up", "broken", timeout=180)  # three starts of Python and torch
        assert "3 times in a row" in event.detail and "told to fail as it starts" in event.detail
        # each start registers before on_start fails; "restarted" is posted only when the driver saw the
        # registration before the exit, so it is not counted
        assert [e.what for e in job.events if e.name == "broken"].count("joined") == 3
        await trio.sleep(1)
        assert "broken" not in job.actors and job.gone_for_good("broken")


class TimesOutOnItsOwn(Actor):
    """Registers, then fails with a TimeoutError of its own, as an ask to a peer that never answers would."""

    role = "times-out"

    async def on_start(self) -> None:
        raise TimeoutError("waited for a peer that never answered")


async def test_a_timeout_after_registering_is_not_reported_as_a_silent_driver(tmp_path, monkeypatch):
    """Only the Register's own timeout means "the driver did not answer": any TimeoutError used to end the actor
    with exit 2 and that message, hiding the real error (a TLS run's buffer in CI said no more than that)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                      os.environ.get("PYTHONPATH")])))
    log = tmp_path / "logs" / "waits.log"
    async with open_job(tmp_path) as job:
        with contextlib.suppress(RuntimeError):  # it may fail before or after the driver sees it registered
            await job.spawn("test_runtime:TimesOutOnItsOwn", "waits", timeout=120)
        with trio.fail_after(60):
            while "waited for a peer" not in log.read_text():
                await trio.sleep(0.1)
    said = log.read_text()
    assert "did not answer" not in said and "TimeoutError: waited for a peer that never answered" in said, said


def _join(address: str, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "VIME_TOKEN"}
    return subprocess.Popen([sys.executable, "-m", "vime.actor", ECHO, "--join", address, *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def _wait_joined(job, process: subprocess.Popen, name: str, timeout: float = 30) -> None:
    """Wait for the driver to see ``name`` join; if the process exits first, fail with what it printed."""
    with trio.fail_after(timeout):
        while process.poll() is None:
            with trio.move_on_after(0.2):
                await job.wait_event("joined", name, timeout=timeout)
                return
    pytest.fail(f"the joining process exited with {process.returncode}: {process.stderr.read()}")


def test_join_tokens_are_safe_on_a_command_line():
    """A token that starts with '-' reads as an option after --token and the join fails (a flaky test once)."""
    tokens = [new_join_token() for _ in range(2000)]
    for token in tokens:
        assert _parser().parse_args(["echo", "--join", "tcp://127.0.0.1:1", "--token", token]).token == token
    assert len(set(tokens)) == len(tokens) and min(len(t) for t in tokens) >= 32


async def test_join_with_right_token_then_killed_is_noticed(tmp_path):
    async with open_job(tmp_path, "tcp", dead_after_s=3.0) as job:
        process = _join(job.address, "--token", job.token, "--name", "remote0")
        try:
            await _wait_joined(job, process, "remote0", timeout=90)  # a loaded 2-core machine starts Python slowly
            assert await job.ask("remote0", Ping(payload=b"hi")) == Pong(payload=b"hi")
            assert job.actors["remote0"].joined
            started = time.monotonic()
            process.kill()
            await job.wait_event("died", "remote0", timeout=5)
            assert time.monotonic() - started < 5
        finally:
            process.kill()
            process.wait()


@pytest.mark.parametrize("token_args", [["--token", "not-the-token"], []], ids=["wrong", "missing"])
async def test_join_with_bad_token_is_refused_on_both_sides(tmp_path, token_args):
    async with open_job(tmp_path, "tcp") as job:
        process = _join(job.address, *token_args, "--name", "intruder")
        _, stderr = await trio.to_thread.run_sync(process.communicate, None, 60)
        assert process.returncode == 2
        assert "join refused" in stderr and "token" in stderr
        assert "intruder" not in job.actors
        assert job.driver.errors["unauthorized"] >= 1


# ------------------------------------------------------------- bad input


class RawPeer:
    """A hand-made nng peer that writes arbitrary bytes into an actor's inbox."""

    def __init__(self, address: str, reply_inbox: Inbox) -> None:
        self.push = pynng.Push0()
        self.push.dial(address, block=True)
        self.inbox = reply_inbox

    def send(self, data: bytes) -> None:
        self.push.send(data)

    def frame(self, *headers: bytes, token: str | None = None) -> bytes:
        return bytes(encode_frame(self.inbox.address, token, [Encoded(h, [], 0, []) for h in headers]))

    async def reply(self) -> Envelope:
        with trio.fail_after(10):
            buffer = await self.inbox.receive()
        (message,) = decode_frame(buffer, max_message_bytes=1 << 30).messages
        return message

    def close(self) -> None:
        self.push.close()
        self.inbox.close()


def header(kind: str, fields: object, msg_id: int = 1, wants_reply: bool = True) -> bytes:
    return msgpack.packb([kind, "tester", "echo0", msg_id, None, 0.0, None, wants_reply, fields])


async def test_bad_input_is_answered_counted_and_harmless(tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0", settings={"max_message_bytes": 64 << 10})
        for seq in range(100):  # state accepted before the attack
            await job.tell("echo0", Note(seq=seq, body=b""))
        peer = RawPeer(info.address, Inbox(f"ipc://{tmp_path}/tester"))
        try:
            peer.send(b"\x00garbage that is not a frame")
            peer.send(peer.frame(header("Note", {"seq": 1, "body": b""}))[:-3])
            peer.send(peer.frame(header("NoSuchKind", {}, msg_id=11)))
            assert (await peer.reply()).payload.reason == "schema"
            peer.send(peer.frame(header("Ping", {"payload": 42}, msg_id=12)))
            reply = await peer.reply()
            assert reply.reply_to == 12 and reply.payload.reason == "schema"
            assert "expected bytes" in reply.payload.error
            peer.send(peer.frame(header("Ping", {"payload": b"x" * (100 << 10)}, msg_id=13)))
            reply = await peer.reply()
            assert reply.reply_to == 13 and reply.payload.reason == "oversized"
            peer.send(peer.frame(header("Blob", {"tensor": None}, msg_id=14)))
            reply = await peer.reply()
            assert isinstance(reply.payload, ErrorReply) and reply.payload.reason == "handler"
        finally:
            peer.close()
        with pytest.raises(RemoteError, match="oversized"):
            await job.ask("echo0", Ping(payload=b"x" * (100 << 10)))
        assert await job.ask("echo0", Ping(payload=b"still here")) == Pong(payload=b"still here")
        assert await job.ask("echo0", CountQuery()) == Count(received=100, out_of_order=0)
        errors = (await job.ask("echo0", StatusQuery())).errors
        assert errors["malformed"] == 1
        assert errors["truncated"] == 1
        assert errors["schema"] == 2
        assert errors["oversized"] == 2
        assert errors["handler"] == 1


async def test_frames_without_the_job_token_are_refused(tmp_path):
    async with open_job(tmp_path, "tcp") as job:
        info = await job.spawn(ECHO, "echo0")
        peer = RawPeer(info.address, Inbox("tcp://127.0.0.1:0"))
        try:
            peer.send(peer.frame(header("Ping", {"payload": b"x"}, msg_id=5), token="guess"))
            reply = await peer.reply()
            assert reply.payload.reason == "unauthorized"
            peer.send(peer.frame(header("Ping", {"payload": b"x"}, msg_id=6), token=job.token))
            assert (await peer.reply()).payload == Pong(payload=b"x")
        finally:
            peer.close()


async def test_a_flood_of_refused_frames_with_made_up_reply_addresses_opens_few_sockets(tmp_path):
    async with open_job(tmp_path, "tcp") as job:
        info = await job.spawn(ECHO, "echo0")
        peer = RawPeer(info.address, Inbox("tcp://127.0.0.1:0"))
        try:
            for port in range(20_000, 20_200):  # below the ephemeral range: never our own reply inbox's port
                message = Encoded(header("Ping", {"payload": b"x"}, msg_id=port), [], 0, [])
                peer.send(bytes(encode_frame(f"tcp://127.0.0.1:{port}", "guess", [message])))
            peer.send(peer.frame(header("Ping", {"payload": b"x"}, msg_id=1), token="guess"))
            reply = await peer.reply()
            assert reply.reply_to == 1 and reply.payload.reason == "unauthorized"  # the latest stranger is answered
        finally:
            peer.close()
        status = await job.ask("echo0", StatusQuery())
        assert status.errors["unauthorized"] == 201
        assert status.counters["outboxes"] <= 1 + 16  # the driver's, and the last strangers'


async def test_ask_times_out_with_a_useful_message(tmp_path):
    async with open_job(tmp_path) as job:
        await job.spawn(ECHO, "echo0")
        await job.tell("echo0", Nap(seconds=2))
        with pytest.raises(TimeoutError, match="no reply from echo0"):
            await job.ask("echo0", Ping(payload=b"x"), timeout=0.3)
        assert await job.ask("echo0", Ping(payload=b"late")) == Pong(payload=b"late")
        assert job.driver.counters["late_replies"] == 1


@pytest.fixture
def tls_files(tmp_path):
    return make_tls_files(tmp_path / "tls")


async def test_tls_transport_with_token(tmp_path, tls_files):
    async with open_job(tmp_path, "tls+tcp", tls=tls_files) as job:
        assert job.address.startswith("tls+tcp://")
        await job.spawn(ECHO, "echo0")
        assert job.actors["echo0"].address.startswith("tls+tcp://")
        assert await job.ask("echo0", Ping(payload=b"secret")) == Pong(payload=b"secret")
        tensor = torch.randn(1 << 18)
        assert torch.equal((await job.ask("echo0", Blob(tensor=tensor, echo=True))).tensor, tensor)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_signal_shuts_an_actor_down_gracefully(tmp_path, sig):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0")
        os.kill(info.pid, sig)
        event = await job.wait_event("died", "echo0", timeout=10)
        assert event.detail == "exited with code 0"
        log = (tmp_path / "logs" / "echo0.log").read_text()
        assert "signal received; shutting down" in log


async def test_heartbeats_carry_status_to_the_driver(tmp_path):
    async with open_job(tmp_path) as job:
        await job.spawn(ECHO, "echo0")
        await job.tell("echo0", Note(seq=0, body=b""))
        with trio.fail_after(5):
            while job.actors["echo0"].status.get("counters", {}).get("handled", 0) < 1:
                await trio.sleep(0.1)
        assert job.actors["echo0"].status["role"] == "echo"


async def test_shared_memory_segments_are_given_back_and_reused(tmp_path):
    async with open_job(tmp_path) as job:
        await job.spawn(ECHO, "echo0")
        tensor = torch.randn(1 << 20)  # 4 MiB
        for _ in range(5):
            assert (await job.ask("echo0", Blob(tensor=tensor))).nbytes == tensor.nbytes
        pool = job.driver._segments
        with trio.fail_after(5):
            while pool.lent:
                await trio.sleep(0.01)
        assert len(pool._segments) <= 2  # reused, not one new segment per message
        reply = await job.ask("echo0", Blob(tensor=tensor, echo=True))
        assert torch.equal(reply.tensor, tensor)
        del reply
        gc.collect()
        with trio.fail_after(5):  # our views are gone, so the echo gets its segment back
            while (await job.ask("echo0", StatusQuery())).counters.get("segments_lent", 0):
                await trio.sleep(0.01)


async def test_a_peer_dying_with_messages_queued_for_it_fails_only_those_sends(tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0", settings={"inbox_capacity": 4})
        await job.tell("echo0", Nap(seconds=30))
        outcome = []

        async def flood() -> None:
            try:
                for seq in range(100_000):
                    await job.tell("echo0", Note(seq=seq, body=b"f" * 4000))
            except PeerGone as err:
                outcome.append(err)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await trio.sleep(1.0)  # the flood is now stuck behind the napping actor
            os.kill(info.pid, signal.SIGKILL)
            await job.wait_event("died", "echo0", timeout=5)
        assert len(outcome) == 1 and "echo0" in str(outcome[0])
        await job.spawn(ECHO, "echo1")  # the driver is unharmed
        assert await job.ask("echo1", Ping(payload=b"ok")) == Pong(payload=b"ok")


DRIVER_SCRIPT = """
import sys, trio
from vime import Cluster
from vime.scenarios.selfcheck import ECHO

async def main():
    async with Cluster.open(sys.argv[1]) as job:
        info = await job.spawn(ECHO, "echo0")
        print("echo pid", info.pid, flush=True)
        await trio.sleep(60)

trio.run(main)
"""


async def test_spawned_actors_exit_when_their_driver_is_killed(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        echo_pid = int((await trio.to_thread.run_sync(driver.stdout.readline)).removeprefix("echo pid "))
        driver.kill()
        driver.wait()
        with trio.fail_after(25):  # about 1.5 s when the machine is idle; CI once took over 8
            while os.path.exists(f"/proc/{echo_pid}") and "zombie" not in _proc_state(echo_pid):
                await trio.sleep(0.1)
    finally:
        driver.kill()
    assert "the driver that started this actor is gone" in (tmp_path / "logs" / "echo0.log").read_text()


PARENT_SCRIPT = """
import os, subprocess, sys, time
actor = subprocess.Popen([sys.executable, "-m", "vime.actor", "vime.scenarios.selfcheck:Echo", "--name", "echo0",
                          "--join", sys.argv[1], "--listen", sys.argv[2], "--exit-with-parent", str(os.getpid())],
                         stderr=open(sys.argv[3], "w"))
print(actor.pid, flush=True)
time.sleep(float(sys.argv[4]))
"""


@pytest.mark.parametrize("lives_s", [0.0, 3.0])
async def test_an_actor_whose_driver_dies_before_it_is_registered_exits_at_once(tmp_path, lives_s):
    """The driver never answers Register (nothing listens there) and dies before the actor has
    started (0 s) or while it waits for the answer (3 s): either way the actor must not sit out the
    30 s registration timeout."""
    log = tmp_path / "echo0.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, f"ipc://{tmp_path}/nobody",
                               f"ipc://{tmp_path}/echo0", str(log), str(lives_s)], stdout=subprocess.PIPE, text=True)
    actor_pid = int(await trio.to_thread.run_sync(parent.stdout.readline))
    await trio.to_thread.run_sync(parent.wait)
    with trio.fail_after(25):  # below the 30 s timeout; covers starting Python and torch (5-15 s on a loaded CI)
        while os.path.exists(f"/proc/{actor_pid}") and "zombie" not in _proc_state(actor_pid):
            await trio.sleep(0.1)
    assert "the driver that started this actor is gone" in log.read_text()


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(line for line in status if line.startswith("State:")).lower()
    except (OSError, StopIteration):
        return "zombie"


async def test_a_busy_conversation_does_not_starve_heartbeats(tmp_path):
    """Polling hands frames straight to the waiting task; timers must still run."""
    async with open_job(tmp_path, "tcp", dead_after_s=2.5) as job:  # heartbeats every 1 s; a GC pause is not starving
        process = _join(job.address, "--token", job.token, "--name", "busy0")
        try:
            await _wait_joined(job, process, "busy0", timeout=90)  # a loaded 2-core machine starts Python slowly
            deadline = time.monotonic() + 6.0
            while time.monotonic() < deadline:
                await job.ask("busy0", Ping(payload=b"p"))
            assert "busy0" in job.actors, "a busy joined actor was declared dead: its heartbeats starved"
        finally:
            process.kill()
            process.wait()
