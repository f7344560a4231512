"""How an actor takes frames in: decode and log them (refused ones too), check the job's token, and route each
message to a pending ask, to the runtime's own bookkeeping or to the handler queue; what is bad on the way in
(garbage, a wrong token, a kind nobody handles) is counted, logged and answered here, as the failure semantics at
the top of :mod:`vime.runtime` say. :class:`Inbound` is the receiving half of :class:`vime.runtime.Actor`: the
state it reads and writes is the actor's (counters, the directory, the pending asks, the queue)."""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from typing import Any, Callable

import trio

from vime.messages.model_files import ModelFileChunk
from vime.messages.runtime import ErrorReply, SegmentsFree
from vime.transports.codec import BadMessage, Envelope, FrameError, decode_frame
from vime.transports.shm import map_segment

# Kinds whose frames are left out of message logs (``--record``): a model file's chunks would put the whole model,
# 16 MiB a frame, in the driver's log and the joined worker's. The reads that ask for them are logged.
UNRECORDED_KINDS: frozenset[type] = frozenset({ModelFileChunk})


class Inbound:
    """Frames in: :meth:`_receive_loop` reads the socket, :meth:`_accept_frame` decodes and logs a frame, and
    :meth:`_route` hands each message on. Mixed into :class:`vime.runtime.Actor`, never used alone."""

    async def _receive_loop(self) -> None:
        assert self._inbox is not None
        for frames in itertools.count(1):
            buffer = await self._inbox.receive()
            self._accept_frame(buffer, time.time())
            if frames % 8 == 0:  # receive() does not yield while frames keep coming; handlers must run
                await trio.lowlevel.cancel_shielded_checkpoint()
            while len(self._queue) >= self.settings.inbox_capacity and not self._pending:
                await self._queue_space.park()

    def _accept_frame(self, buffer: Any, arrived: float, shm: Callable[[str, int], Any] | None = None) -> None:
        """Decode, log and route one frame; never raises for bad input.

        ``shm`` stands in for shared memory (replay serves segments from the
        log); live segments are mapped and given back to their sender once
        the last tensor viewing them is gone.
        """
        mapped: list[tuple[str, Any]] = []

        def resolve_shm(name: str, nbytes: int) -> Any:
            segment = (shm or map_segment)(name, nbytes)
            mapped.append((name, segment))
            return segment

        self.counters["frames_in"] += 1
        try:
            frame = decode_frame(buffer, max_message_bytes=self.settings.max_message_bytes, resolve_shm=resolve_shm,
                                 token=self.settings.token)
        except FrameError as err:
            self.errors["malformed"] += 1
            self.log.warning("dropped unreadable frame", error=str(err), size=len(buffer))
            return
        if mapped or self._log_writer is not None:
            sender = next((m.sender for m in frame.messages if m.sender), None)  # one sender per frame
            if shm is None:
                for name, segment in mapped:
                    weakref.finalize(segment, self._segment_released, sender, name)
            if self._log_writer is not None and not any(
                    isinstance(m, Envelope) and type(m.payload) in UNRECORDED_KINDS for m in frame.messages):
                attachments = {name: memoryview(segment)[:len(segment)] for name, segment in mapped}
                self._log_writer.write("in", sender or frame.reply_address, buffer, attachments, wall_time=arrived)
                attachments.clear()
            mapped.clear()
        if self.settings.token is not None and frame.token != self.settings.token:
            self._refuse_frame(frame, arrived)
            return
        for item in frame.messages:
            if isinstance(item, BadMessage):
                self._reject(item, frame.reply_address)
            else:
                if item.sender not in self.directory:
                    self._learned[item.sender] = frame.reply_address
                self._route(item, arrived)

    def _refuse_frame(self, frame: Any, arrived: float) -> None:
        """Refuse a frame whose token is wrong -- except a refusal of our own ask.

        The peer that refuses us cannot sign its answer with a token we hold;
        letting "unauthorized" answers to our pending asks through is what
        lets a joiner with a wrong token say why it was turned away.
        """
        refusals = [m for m in frame.messages if isinstance(m, Envelope) and isinstance(m.payload, ErrorReply)
                    and m.payload.reason == "unauthorized" and m.reply_to in self._pending]
        for refusal in refusals:
            self._route(refusal, arrived)
        if len(refusals) == len(frame.messages):
            return
        self.errors["unauthorized"] += len(frame.messages) - len(refusals)
        senders = sorted({m.sender or "?" for m in frame.messages})
        self.log.warning("refused messages with a wrong or missing token", senders=senders,
                         reply_address=frame.reply_address)
        for item in frame.messages:
            if item.wants_reply and item.sender:  # answered at its address, which we do not learn
                error = ErrorReply(reason="unauthorized", kind=item.kind,
                                   error="wrong or missing join token; pass --token with the job's token")
                self._nursery.start_soon(self._reply_error, item.sender, item.id, error, frame.reply_address)

    def _reject(self, bad: BadMessage, reply_address: str) -> None:
        self.errors[bad.reason] += 1
        self.log.warning("rejected message", reason=bad.reason, error=bad.error, kind=bad.kind, sender=bad.sender)
        if bad.wants_reply and bad.sender and bad.id is not None:
            error = ErrorReply(reason=bad.reason, error=bad.error, kind=bad.kind)
            self._nursery.start_soon(self._reply_error, bad.sender, bad.id, error, reply_address)

    def _segment_released(self, owner: str | None, name: str) -> None:
        """Finalizer of a received segment's mapping: may run in any thread, at any time."""
        if owner is None or self._trio_token is None:
            return
        self._released.append((owner, name))
        with contextlib.suppress(trio.RunFinishedError):
            self._trio_token.run_sync_soon(self._release_ready.unpark_all)

    async def _release_loop(self) -> None:
        while True:
            await self._release_ready.park()
            await self._give_segments_back()

    def _route(self, envelope: Envelope, arrived: float) -> None:
        self.counters["received"] += 1
        if type(envelope.payload) is SegmentsFree:  # runtime bookkeeping: never waits behind a handler
            self._segments.give_back(envelope.payload.names)
            return
        if envelope.reply_to is not None:
            pending = self._pending.get(envelope.reply_to)
            if pending is not None and envelope.sender == pending.peer:
                pending.finish(reply=envelope)
            else:
                self.counters["late_replies"] += 1
            return
        if self.on_arrival(envelope):
            return
        if envelope.kind not in self._handlers:
            self._reject(BadMessage("unhandled", f"{self.role} has no handler for {envelope.kind}",
                                    envelope.kind, envelope.sender, envelope.id, envelope.wants_reply), "")
            return
        self._queue.append((envelope, arrived))
        self._queue_ready.unpark()
