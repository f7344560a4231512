"""Await asyncio code (vLLM's async engine) from trio actors.

`AsyncioBridge` runs one asyncio event loop (uvloop when importable) on a daemon
thread; trio code awaits coroutines on it with `run` and iterates async generators
on it with `stream`. Results, exceptions and cancellation cross in both directions,
and trio is woken by the task's done-callback, never by polling.

    with AsyncioBridge() as bridge:
        async with contextlib.aclosing(bridge.stream(engine.generate, prompt)) as outputs:
            async for output in outputs:
                ...

Left out on purpose: calling trio from asyncio code (nothing in vime needs it),
running blocking functions (use `trio.to_thread`), and more than one loop per bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import outcome
import trio

P = ParamSpec("P")
T = TypeVar("T")

_EXHAUSTED = object()  # what the loop hands back when a streamed generator ends


class BridgeCancelled(Exception):
    """Work a trio task was waiting on was cancelled on the asyncio side.

    Raised in place of `asyncio.CancelledError`, which trio code must never see:
    it is neither trio's `Cancelled` nor an error the caller can act on.
    """


class _Call:
    """One coroutine handed from a trio task to the loop; finished exactly once."""

    def __init__(self, make_coro: Callable[[], Awaitable[Any]], name: str) -> None:
        self.make_coro = make_coro
        self.name = name
        self.token = trio.lowlevel.current_trio_token()
        self.done = trio.Event()  # set on the caller's trio thread only
        self.task: asyncio.Task[Any] | None = None  # touched on the loop thread only
        self.result: outcome.Outcome[Any] | None = None


class AsyncioBridge:
    """An asyncio event loop on a daemon thread that trio tasks can await into.

    Every `run`, and every step of a `stream`, is one asyncio task on the loop;
    the trio caller blocks, cancellably, until it is done. Any number of trio
    tasks, in one or more trio runs, may share a bridge.

    Cancellation passes both ways:

    * trio -> asyncio: when the waiting trio task is cancelled, its asyncio task is
      cancelled and the bridge waits, shielded, up to `cancel_grace` seconds for it
      to finish before trio's `Cancelled` propagates, so no work goes on behind
      the caller's back. A task that ignores cancellation longer is left to `close()`.
    * asyncio -> trio: a task cancelled on the loop (`task.cancel()` from other
      asyncio code, or `close()`) raises `BridgeCancelled` in its trio caller.
    """

    def __init__(self, *, use_uvloop: bool = True, cancel_grace: float = 5.0) -> None:
        self._use_uvloop = use_uvloop
        self._cancel_grace = cancel_grace
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pending: set[_Call] = set()
        self._lock = threading.Lock()  # orders submissions against close(), from any thread

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The bridged loop, for asyncio code that must schedule on it directly."""
        if self._loop is None:
            raise RuntimeError("AsyncioBridge has no loop before start(); use `with AsyncioBridge() as bridge:`")
        return self._loop

    def start(self) -> None:
        """Start the loop thread. Returns at once: work submitted early waits in the loop's queue."""
        with self._lock:
            if self._loop is not None or self._closed:
                state = "closed" if self._closed else "running"
                raise RuntimeError(f"AsyncioBridge.start() on a {state} bridge; a bridge starts once, make a new one")
            self._loop = _new_event_loop(self._use_uvloop)
            self._thread = threading.Thread(target=_run_forever, args=(self._loop,), name="asyncio-bridge")
            self._thread.daemon = True  # a loop left running must not keep the process alive
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every task on the loop, close its async generators, stop it and join its thread.

        Blocks the calling thread up to `timeout` for the tasks, then up to `timeout`
        for the thread. Every trio caller still waiting gets `BridgeCancelled`, also
        when its task ignored cancellation past the deadline. Later calls do nothing.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncioBridge.close() on the loop thread would wait for itself; call it from trio")
        with self._lock:
            was_running, self._closed = self._running, True
        if not was_running:
            return
        drained = asyncio.run_coroutine_threadsafe(_cancel_everything(), self.loop)
        with contextlib.suppress(TimeoutError):  # a task ignored cancellation: stop the loop regardless
            drained.result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        with self._lock:
            stranded = list(self._pending)
        for call in stranded:
            self._finish(call, outcome.Error(BridgeCancelled(f"AsyncioBridge.close() gave up on {call.name}")))

    def __enter__(self) -> AsyncioBridge:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def run(self, coro_fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `coro_fn(*args, **kwargs)` as a task on the loop and return its result.

        Its exception is re-raised here as the same object, asyncio frames kept in
        the traceback. RuntimeError if the bridge is not started or already closed.
        """
        return await self._await_on_loop(functools.partial(coro_fn, *args, **kwargs), _name(coro_fn))

    async def stream(
        self, agen_fn: Callable[P, AsyncIterator[T]], *args: P.args, **kwargs: P.kwargs
    ) -> AsyncIterator[T]:
        """Iterate `agen_fn(*args, **kwargs)`, an async generator that runs on the loop.

        Items are pulled one `__anext__` at a time: the generator stays suspended at
        its `yield` until trio asks for the next item, so a slow consumer holds it
        still and at most one item is in hand-off. Leaving the iteration early
        (`break`, error, cancellation) closes the generator on the loop, waiting up to
        `cancel_grace`. After `break` that happens only when this iterator is closed:
        wrap it in `contextlib.aclosing`, or it waits for garbage collection.
        """
        with self._lock:
            self._require_running()
        name = _name(agen_fn)
        agen = agen_fn(*args, **kwargs)  # runs none of its code: the first step happens on the loop
        next_item = functools.partial(_anext_or_exhausted, agen)
        try:
            while (item := await self._await_on_loop(next_item, name)) is not _EXHAUSTED:
                yield item
        finally:
            # Once close() has begun, it cancels and shuts down the loop's generators itself.
            with trio.move_on_after(self._cancel_grace, shield=True), contextlib.suppress(BridgeCancelled):
                if self._running:
                    await self._await_on_loop(agen.aclose, name)

    @property
    def _running(self) -> bool:
        return self._loop is not None and not self._closed

    def _require_running(self) -> None:
        if self._closed:
            raise RuntimeError("AsyncioBridge is closed; open a new one with `with AsyncioBridge() as bridge:`")
        if self._loop is None:
            raise RuntimeError(
                "AsyncioBridge is not started; call bridge.start() first or use `with AsyncioBridge() as bridge:`"
            )

    async def _await_on_loop(self, make_coro: Callable[[], Awaitable[T]], name: str) -> T:
        """Hand one call to the loop and wait for it; if this trio task is cancelled, cancel the call."""
        call = _Call(make_coro, name)
        with self._lock:
            self._require_running()
            self._pending.add(call)
            self.loop.call_soon_threadsafe(self._start_task, call)
        try:
            await call.done.wait()
        finally:
            if call.result is None:  # still running, so this trio task was cancelled
                await self._cancel_and_wait(call)
        return call.result.unwrap()

    async def _cancel_and_wait(self, call: _Call) -> None:
        """Cancel the call's task on the loop, then wait (shielded, up to cancel_grace) for it to end."""
        with self._lock:
            if self._running:  # otherwise close() is cancelling it already
                # Queued behind this call's `_start_task`, so the task exists when this runs.
                self.loop.call_soon_threadsafe(lambda: call.task.cancel())
        with trio.move_on_after(self._cancel_grace, shield=True):
            await call.done.wait()

    def _start_task(self, call: _Call) -> None:
        """On the loop thread: run the call as a task that reports back when done."""
        call.task = self.loop.create_task(_await_call(call.make_coro))
        call.task.add_done_callback(lambda task: self._finish(call, _outcome_of(task, call.name)))

    def _finish(self, call: _Call, result: outcome.Outcome[Any]) -> None:
        """From any thread: record the call's result and wake its trio task. The first result wins."""
        with self._lock:
            if call not in self._pending:
                return
            self._pending.remove(call)
            call.result = result
        with contextlib.suppress(trio.RunFinishedError):  # the caller's trio run has ended: nobody to wake
            call.token.run_sync_soon(call.done.set)


def _new_event_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        with contextlib.suppress(ImportError):  # uvloop is only a speed-up; asyncio behaves the same
            import uvloop

            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _await_call(make_coro: Callable[[], Awaitable[T]]) -> T:
    """Call on the loop, so that an error in the call itself (bad arguments) becomes the task's exception."""
    return await make_coro()


async def _anext_or_exhausted(agen: AsyncIterator[T]) -> T | object:
    """One generator step. Ends in a sentinel: StopAsyncIteration re-raised in `stream` becomes RuntimeError."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _EXHAUSTED


async def _cancel_everything() -> None:
    """On the loop: cancel every other task, wait for them, then close suspended async generators."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others)
    await asyncio.get_running_loop().shutdown_asyncgens()


def _outcome_of(task: asyncio.Task[Any], name: str) -> outcome.Outcome[Any]:
    """On the loop thread: the task's result, with asyncio's cancellation turned into BridgeCancelled."""
    if task.cancelled():
        message = f"{name} was cancelled on the asyncio side (task.cancel() or close())"
        return outcome.Error(BridgeCancelled(message))
    error = task.exception()
    return outcome.Error(error) if error is not None else outcome.Value(task.result())


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))
