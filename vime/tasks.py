"""How an actor's handlers and the loops it starts (``Actor.start_soon``) wait on each other.

Handlers run one at a time, so their state needs no locks; a loop started beside them (a training loop,
a generation loop) runs between their awaits. These are the primitives the two use to hand work over and
wait for state to change, re-exported by :mod:`vime.runtime`:

* :class:`Changed`: wait until a condition on the actor's state holds; whoever changes it notifies.
* :class:`Wakeup`: wake a loop that idles; a wake-up given while it runs is not lost.
* :class:`BetweenSteps`: calls a handler needs run by a loop between two of its steps (a rollout worker's
  engine is used by its generation loop only), the handler waiting for each call's outcome.

A lock is for what none of these says: two tasks that each change the same state across an await. The
trainer's weights lock is the one case: a publication (the training loop) and a worker brought in (a task per
joining worker) both send weights, and neither may see the other's half-sent version.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import trio


class Changed:
    """State that tasks wait on: the task that changes it calls :meth:`notify`, and every waiter re-checks."""

    def __init__(self) -> None:
        self._waiting = trio.lowlevel.ParkingLot()

    def notify(self) -> None:
        """Wake every task waiting now; one that starts waiting after this waits for the next notify."""
        self._waiting.unpark_all()

    async def wait(self) -> None:
        """Block until the next :meth:`notify` (cancellable)."""
        await self._waiting.park()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds, checking it now and after every notify."""
        while not condition():
            await self._waiting.park()


class Wakeup:
    """A loop's doorbell: :meth:`set` wakes the loop's :meth:`wait`, or makes its next one return at once."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        """Block until set (at once if set since the last wait), and clear it."""
        await self._event.wait()
        self._event = trio.Event()


class _Call:
    def __init__(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = trio.Event()
        self.error: Exception | None = None


class BetweenSteps:
    """Calls that handlers have a loop run between two of its steps, in the order asked, each in a worker
    thread. ``wake`` wakes the loop when a call is queued."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self._calls: collections.deque[_Call] = collections.deque()

    async def call(self, fn: Callable[..., None], *args: Any) -> None:
        """Have the loop run ``fn(*args)``; returns (or raises what it raised) once it has run. Cancelled
        meanwhile, the call still runs; its outcome is dropped."""
        call = _Call(fn, args)
        self._calls.append(call)
        self.wake()
        await call.done.wait()
        if call.error is not None:
            raise call.error

    async def run(self, after: Callable[[], None] = lambda: None) -> None:
        """The loop's side: run every queued call (those queued meanwhile too), ``after()`` each."""
        while self._calls:
            call = self._calls.popleft()
            try:
                await trio.to_thread.run_sync(call.fn, *call.args)
            except Exception as err:  # the handler that asked for the call raises it
                call.error = err
            call.done.set()
            after()
