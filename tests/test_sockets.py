"""nng inbox/outbox in one process: zero-copy lifetime, batching, ordering, addresses."""

from __future__ import annotations

import contextlib
import gc
from typing import AsyncIterator

import torch
import trio
import trio.testing

from vime.scenarios.selfcheck import Blob, Note
from vime.transports.codec import Envelope, decode_frame, encode
from vime.transports.sockets import Inbox, Outbox


def envelope(payload, msg_id: int = 1) -> Envelope:
    return Envelope(type(payload).__name__, "a", "b", msg_id, None, 0.0, None, False, payload)


@contextlib.asynccontextmanager
async def linked(tmp_path, *, pump: bool = True) -> AsyncIterator[tuple[Inbox, Outbox, trio.Nursery]]:
    """An inbox and an outbox dialled to it; the pump runs unless the test starts it."""
    inbox = Inbox(f"ipc://{tmp_path}/in")
    outbox = Outbox(inbox.address, "ipc://unused", None)
    try:
        async with trio.open_nursery() as nursery:
            if pump:
                nursery.start_soon(outbox.pump)
            yield inbox, outbox, nursery
            nursery.cancel_scope.cancel()
    finally:
        outbox.close()
        inbox.close()


async def received_seqs(inbox: Inbox, count: int) -> tuple[list[int], int]:
    """Note numbers in arrival order, and how many frames carried them."""
    seqs, frames = [], 0
    while len(seqs) < count:
        frame = decode_frame(await inbox.receive(), max_message_bytes=1 << 30)
        frames += 1
        seqs += [m.payload.seq for m in frame.messages]
    return seqs, frames


async def test_received_tensor_outlives_every_other_reference_to_its_frame(tmp_path):
    async with linked(tmp_path) as (inbox, outbox, _):
        expected = torch.arange(1 << 16, dtype=torch.float32)
        await outbox.put(encode(envelope(Blob(tensor=expected))))
        buffer = await inbox.receive()
        (message,) = decode_frame(buffer, max_message_bytes=1 << 30).messages
        tensor = message.payload.tensor
        del buffer, message
        gc.collect()
        torch.zeros(1 << 20)  # churn the allocator: a freed frame would now hold garbage
        assert torch.equal(tensor, expected)


async def test_a_burst_of_tells_is_shipped_in_few_frames(tmp_path):
    async with linked(tmp_path, pump=False) as (inbox, outbox, nursery):
        for seq in range(500):
            outbox.put_nowait(encode(envelope(Note(seq=seq, body=b"x" * 50), seq)))
        nursery.start_soon(outbox.pump)
        seqs, frames = await received_seqs(inbox, 500)
        assert seqs == list(range(500))
        assert frames <= 5


async def test_direct_sends_never_overtake_queued_messages(tmp_path):
    async with linked(tmp_path) as (inbox, outbox, _):
        await trio.testing.wait_all_tasks_blocked()  # the pump waits for work
        outbox.put_nowait(encode(envelope(Note(seq=0, body=b""))))  # handed straight to the pump
        assert not outbox.send_now(encode(envelope(Note(seq=1, body=b""))))
        outbox.put_nowait(encode(envelope(Note(seq=1, body=b""))))
        assert (await received_seqs(inbox, 2))[0] == [0, 1]
        assert outbox.send_now(encode(envelope(Note(seq=2, body=b""))))  # idle again: the fast path is open


def test_tcp_port_zero_is_replaced_by_the_bound_port():
    inbox = Inbox("tcp://127.0.0.1:0")
    host, port = inbox.address.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    again = Outbox(inbox.address, "x", None)  # dialable: the pipe comes up
    for _ in range(200):
        if again.connected:
            break
        trio.run(trio.sleep, 0.01)
    assert again.connected
    again.close()
    inbox.close()
