"""AsyncioBridge: results, errors, cancellation both ways and streaming between trio and an asyncio loop."""

import asyncio
import contextlib
import threading
import traceback
from typing import Awaitable, Callable

import pytest
import trio

from vime.asyncio_bridge import AsyncioBridge, BridgeCancelled


@pytest.fixture(params=[True, False], ids=["uvloop", "asyncio"])
def bridge(request):
    with AsyncioBridge(use_uvloop=request.param) as bridge:
        yield bridge


async def wait_for(flag: threading.Event) -> None:
    """Block trio until a flag set on the loop thread is up; capped so a bug fails instead of hanging."""
    assert await trio.to_thread.run_sync(flag.wait, 1.0)


async def cancelled_once_started(started: threading.Event, work: Callable[[], Awaitable[object]]) -> trio.CancelScope:
    """Run ``work`` from trio and cancel it as soon as it has started on the loop thread: a fixed delay could
    fire before the loop thread gets to it on a loaded machine, and then there is nothing to cancel."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def cancel() -> None:
                await wait_for(started)
                scope.cancel()

            nursery.start_soon(cancel)
            await work()
    return scope


async def sleep_forever_on_loop(started: threading.Event) -> None:
    started.set()
    await asyncio.sleep(10)


async def test_run_returns_result_from_loop_thread(bridge):
    async def add(a, *, b):
        await asyncio.sleep(0)
        return a + b, threading.current_thread().name

    assert await bridge.run(add, 1, b=2) == (3, "asyncio-bridge")


async def test_run_reraises_original_exception_with_its_traceback(bridge):
    async def fail_on_loop():
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing") as info:
        await bridge.run(fail_on_loop)
    assert "fail_on_loop" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]


async def test_run_reports_bad_arguments_as_the_call_error(bridge):
    async def takes_nothing():
        pass

    with pytest.raises(TypeError):
        await bridge.run(takes_nothing, 1)


async def test_trio_cancel_cancels_asyncio_task_and_waits_for_its_cleanup(bridge):
    started, saw_cancel, cleaned_up = threading.Event(), threading.Event(), threading.Event()

    async def work():
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            saw_cancel.set()
            raise
        finally:
            await asyncio.sleep(0.05)  # cleanup that takes time: the bridge must wait for it
            cleaned_up.set()

    scope = await cancelled_once_started(started, lambda: bridge.run(work))
    assert scope.cancelled_caught
    assert saw_cancel.is_set() and cleaned_up.is_set()


async def test_trio_cancel_gives_up_after_cancel_grace():
    with AsyncioBridge(cancel_grace=0.05) as bridge:
        started = threading.Event()

        async def ignores_first_cancel():
            started.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)
            await asyncio.sleep(10)

        with trio.fail_after(2):  # not the 10 s the task would keep it
            scope = await cancelled_once_started(started, lambda: bridge.run(ignores_first_cancel))
        assert scope.cancelled_caught


async def test_asyncio_side_cancel_raises_bridge_cancelled(bridge):
    started = threading.Event()
    tasks = []

    async def work():
        tasks.append(asyncio.current_task())
        await sleep_forever_on_loop(started)

    async def cancel_work():
        tasks[0].cancel()

    async def cancel_once_started():
        await wait_for(started)
        await bridge.run(cancel_work)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_once_started)
        with pytest.raises(BridgeCancelled, match="work was cancelled on the asyncio side"):
            await bridge.run(work)


async def test_close_with_pending_work_raises_bridge_cancelled():
    bridge = AsyncioBridge()
    bridge.start()
    started = threading.Event()

    async def close_once_started():
        await wait_for(started)
        bridge.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_once_started)
        with pytest.raises(BridgeCancelled, match="sleep_forever_on_loop was cancelled"):
            await bridge.run(sleep_forever_on_loop, started)


async def test_close_gives_up_on_work_that_will_not_stop():
    bridge = AsyncioBridge()
    bridge.start()
    started, release = threading.Event(), threading.Event()

    async def blocks_loop_thread():
        started.set()
        release.wait(1.0)  # blocking call: the loop cannot even deliver the cancellation

    async def close_once_started():
        await wait_for(started)
        bridge.close(timeout=0.02)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_once_started)
        with pytest.raises(BridgeCancelled, match=r"close\(\) gave up on .*blocks_loop_thread"):
            await bridge.run(blocks_loop_thread)
    release.set()


async def test_close_cancels_background_tasks_on_the_loop(bridge):
    cancelled = threading.Event()

    async def background():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def spawn():
        asyncio.get_running_loop().create_task(background())
        await asyncio.sleep(0)

    await bridge.run(spawn)
    bridge.close()
    assert cancelled.is_set()


async def test_hundred_concurrent_runs_complete(bridge):
    async def echo_later(value):
        await asyncio.sleep(0.01)
        return value

    results = {}

    async def run_one(value):
        results[value] = await bridge.run(echo_later, value)

    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            for value in range(100):
                nursery.start_soon(run_one, value)
    assert results == {value: value for value in range(100)}


async def test_run_before_start_or_after_close_says_how_to_start():
    bridge = AsyncioBridge()

    async def noop():
        pass

    with pytest.raises(RuntimeError, match=r"call bridge.start\(\)"):
        await bridge.run(noop)
    with bridge:
        await bridge.run(noop)
    with pytest.raises(RuntimeError, match="closed.*with AsyncioBridge"):
        await bridge.run(noop)
    with pytest.raises(RuntimeError, match="not started"):
        async for _ in AsyncioBridge().stream(count_to, 1):
            pass


def test_start_twice_raises():
    with AsyncioBridge() as bridge:
        with pytest.raises(RuntimeError, match=r"start\(\) on a running bridge"):
            bridge.start()
    with pytest.raises(RuntimeError, match="closed"):
        bridge.start()


def test_loop_is_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")
    with AsyncioBridge() as bridge:
        assert isinstance(bridge.loop, uvloop.Loop)
    with AsyncioBridge(use_uvloop=False) as bridge:
        assert not isinstance(bridge.loop, uvloop.Loop)


async def count_to(limit, produced=None):
    for value in range(limit):
        if produced is not None:
            produced.append(value)
        await asyncio.sleep(0)
        yield value


async def test_stream_yields_items_in_order(bridge):
    assert [item async for item in bridge.stream(count_to, 5)] == [0, 1, 2, 3, 4]


async def test_stream_slow_consumer_holds_the_generator(bridge):
    produced = []
    async for item in bridge.stream(count_to, 5, produced):
        await trio.sleep(0.01)
        assert len(produced) == item + 1  # nothing produced ahead of what trio has taken


async def test_stream_reraises_generator_exception(bridge):
    async def fail_after_one():
        yield 1
        raise ValueError("bad output")

    items = []
    with pytest.raises(ValueError, match="bad output"):
        async for item in bridge.stream(fail_after_one):
            items.append(item)
    assert items == [1]


def generator_with_cleanup(closed: threading.Event, saw_cancel: threading.Event, started: threading.Event):
    """An async generator function that flags its second step, any cancellation and its slow cleanup."""

    async def generate():
        try:
            yield "first"
            started.set()
            await asyncio.sleep(10)
            yield "never"
        except asyncio.CancelledError:
            saw_cancel.set()
            raise
        finally:
            assert threading.current_thread().name == "asyncio-bridge"
            await asyncio.sleep(0.01)
            closed.set()

    return generate


async def test_stream_break_closes_generator_on_loop(bridge):
    closed = threading.Event()
    generate = generator_with_cleanup(closed, threading.Event(), threading.Event())
    async with contextlib.aclosing(bridge.stream(generate)) as items:
        async for item in items:
            assert item == "first"
            break
    assert closed.is_set()


async def test_stream_break_without_aclosing_closes_generator_when_collected(bridge):
    closed = threading.Event()
    with pytest.warns(ResourceWarning, match="aclosing"):  # trio's nudge towards the test above
        async for _ in bridge.stream(generator_with_cleanup(closed, threading.Event(), threading.Event())):
            break
    await wait_for(closed)  # trio's async-generator finalizer closes it in a system task


async def test_stream_trio_cancel_cancels_and_closes_generator(bridge):
    closed, saw_cancel, started = threading.Event(), threading.Event(), threading.Event()
    async def drain() -> None:
        async for _ in bridge.stream(generator_with_cleanup(closed, saw_cancel, started)):
            pass

    scope = await cancelled_once_started(started, drain)
    assert scope.cancelled_caught
    assert saw_cancel.is_set() and closed.is_set()


async def test_stream_asyncio_side_cancel_raises_bridge_cancelled(bridge):
    async def generator_cancelled_by_asyncio():
        yield 1
        raise asyncio.CancelledError  # what an engine does when it aborts the request

    with pytest.raises(BridgeCancelled, match="generator_cancelled_by_asyncio"):
        async for _ in bridge.stream(generator_cancelled_by_asyncio):
            pass
