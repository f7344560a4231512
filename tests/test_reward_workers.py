"""Every reward call runs under a hard time limit (vime.reward_workers): a function stuck where no signal reaches
it (a C loop) or an async one that never answers scores 0, is counted, and the next call is served."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import trio

from vime.reward_workers import RewardWorkers

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def plugins_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


async def _scored(workers: RewardWorkers, responses: list[str], label: str = "4") -> list:
    workers.start()
    try:
        return [await workers.score(response, label, {"data_source": "test"}) for response in responses]
    finally:
        workers.close()


@pytest.mark.parametrize("function", ["hangs_on_hang", "waits_on_hang"])
async def test_a_call_past_the_limit_scores_zero_and_the_next_is_served(function):
    """Mutation: without the kill-and-replace (waiting on the stuck process) the second call never ends."""
    workers = RewardWorkers("exact", f"reward_plugins:{function}", workers=1, limit_s=1.0)
    with trio.fail_after(60):
        workers.start()
        try:
            await workers.score("4", "4", {})  # the process is up: time the calls alone
            started = time.monotonic()
            stuck = await workers.score("hang", "4", {})
            took = time.monotonic() - started
            after = [await workers.score(answer, "4", {}) for answer in ("4", "5")]
        finally:
            workers.close()
    assert (stuck.reward, stuck.timed_out) == (0.0, True) and 1.0 <= took < 10.0
    assert [(s.reward, s.timed_out) for s in after] == [(1.0, False), (0.0, False)]
    assert workers.timeouts == 1


async def test_calls_run_concurrently_in_the_workers():
    """Three workers, two stuck calls beside a good one: the good one is not held up behind them."""
    workers = RewardWorkers("exact", "reward_plugins:hangs_on_hang", workers=3, limit_s=5.0)
    results = {}
    with trio.fail_after(60):
        workers.start()
        try:
            async with trio.open_nursery() as nursery:  # all three up: time the calls alone
                for _ in range(3):
                    nursery.start_soon(workers.score, "4", "4", {})

            async def one(key: str, response: str) -> None:
                results[key] = (await workers.score(response, "4", {}), time.monotonic())

            started = time.monotonic()
            async with trio.open_nursery() as nursery:
                for key, response in (("a", "hang"), ("b", "hang"), ("c", "4")):
                    nursery.start_soon(one, key, response)
        finally:
            workers.close()
    assert results["c"][0].reward == 1.0 and results["c"][1] - started < 3.0  # not held behind the 5 s limit
    assert [results[k][0].timed_out for k in "ab"] == [True, True] and workers.timeouts == 2


async def test_what_the_function_prints_does_not_garble_its_answers():
    assert [s.reward for s in await _scored(RewardWorkers("exact", "reward_plugins:prints_and_scores", 1, 10.0),
                                            ["x", "y"])] == [0.5, 0.5]


async def test_built_in_rewards_score_in_the_workers():
    got = await _scored(RewardWorkers("math", "", 2, 30.0), ["The answer is \\boxed{\\frac{1}{2}}", "0.3"], "0.5")
    assert [s.reward for s in got] == [1.0, 0.0]


@pytest.mark.parametrize("function, said", [("says_yes", "must return a finite float"),
                                            ("no_metadata", "unexpected keyword argument")])
async def test_a_broken_function_stops_the_run_with_its_error(function, said):
    """A bug is not an answer to score 0: the error reaches the actor, which stops the run with it."""
    workers = RewardWorkers("exact", f"reward_plugins:{function}", 1, 10.0)
    with pytest.raises(RuntimeError, match=said):
        await _scored(workers, ["4"])
    assert workers.timeouts == 0


def test_bad_settings_and_unknown_functions_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="--reward-workers must be >= 1"):
        RewardWorkers("exact", "", 0, 1.0)
    with pytest.raises(ValueError, match="--reward-timeout > 0"):
        RewardWorkers("exact", "", 1, 0.0)
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        RewardWorkers("exact", "no_such_module:fn", 1, 1.0)


def test_a_worker_stuck_in_a_call_dies_with_its_actor(tmp_path):
    """The reward actor killed with kill -9 while a worker spins in C: the worker must not outlive it (it never
    reads its closed stdin). Mutation: without PR_SET_PDEATHSIG the worker is still there."""
    script = tmp_path / "actor.py"
    script.write_text(textwrap.dedent(f"""
        import sys, trio
        sys.path.insert(0, {str(TESTS)!r})
        from vime.reward_workers import RewardWorkers

        async def main():
            workers = RewardWorkers("exact", "reward_plugins:hangs_on_hang", 1, 600.0)
            workers.start()
            await workers.score("4", "4", {{}})
            print(workers.idle[0].process.pid, flush=True)
            await workers.score("hang", "4", {{}})

        trio.run(main)
    """))
    actor = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(actor.stdout.readline())
        time.sleep(0.5)  # the worker is in its call
        os.kill(actor.pid, signal.SIGKILL)
        actor.wait(10)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), f"reward worker {worker} outlived its actor"
    finally:
        actor.kill()
        if worker is not None and _alive(worker):  # the failure above: leave no process spinning
            os.kill(worker, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped by init."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def test_a_worker_that_died_idle_is_replaced_and_one_that_dies_in_a_call_scores_zero():
    """An idle worker killed (out of memory, say) must not stop the run: the call goes to its replacement.
    One killed during a call is cut off like a hang: 0, counted."""
    workers = RewardWorkers("exact", "reward_plugins:hangs_on_hang", workers=1, limit_s=30.0)
    with trio.fail_after(60):
        workers.start()
        try:
            await workers.score("4", "4", {})
            workers.idle[0].process.kill()
            workers.idle[0].process.wait()
            assert (await workers.score("4", "4", {})).reward == 1.0
            victim = workers.idle[0].process

            async def kill_soon() -> None:
                await trio.sleep(0.5)
                victim.kill()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_soon)
                cut = await workers.score("hang", "4", {})
            assert (cut.reward, cut.timed_out) == (0.0, True) and workers.timeouts == 1
            assert (await workers.score("4", "4", {})).reward == 1.0
        finally:
            workers.close()


async def test_closing_kills_busy_workers_and_ends_their_calls():
    """The actor stopping mid-group: close() kills every process, busy ones too, and the waiting call ends
    with WorkersClosed (which the actor logs, rather than reporting a broken reward function)."""
    from vime.reward_workers import WorkersClosed

    workers = RewardWorkers("exact", "reward_plugins:hangs_on_hang", workers=1, limit_s=60.0)
    with trio.fail_after(30):
        workers.start()
        await workers.score("4", "4", {})
        busy = workers.idle[0].process
        with pytest.raises(BaseExceptionGroup) as ended:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(workers.score, "hang", "4", {})
                await trio.sleep(0.5)
                workers.close()
                await workers.score("4", "4", {})
    closed, other = ended.value.split(WorkersClosed)
    assert other is None and len(closed.exceptions) == 2  # the busy call and the one after close
    assert busy.poll() is not None and not workers.running


async def test_metadata_a_worker_cannot_take_is_named():
    workers = RewardWorkers("exact", "", workers=1, limit_s=10.0)
    with pytest.raises(TypeError, match="keep its metadata to plain values"):
        await workers.score("4", "4", {"x": object()})


async def test_what_a_timed_out_reward_started_is_killed_with_it(tmp_path):
    """A reward that starts a process and hangs: at the limit its whole process group goes, the child too."""
    pid_file = tmp_path / "child.pid"
    workers = RewardWorkers("exact", "reward_plugins:starts_a_sleeper", workers=1, limit_s=2.0)
    with trio.fail_after(60):
        workers.start()
        try:
            assert (await workers.score("x", "4", {"pid_file": str(pid_file)})).timed_out
        finally:
            workers.close()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not _alive(child), "the reward's own child outlived the timed-out call"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


async def test_the_reward_actor_scores_later_groups_while_a_slow_one_waits_and_sends_them_in_order():
    """Two workers, a group with a 3 s answer first, then six of 0.5 s: they are scored on the other worker
    meanwhile and all are sent by about 3 s, in the order they came. Mutation: scored one group at a time (the
    handler awaiting its own group), the six wait behind the slow one, and it takes 6 s."""
    from vime.actors.reward import Reward
    from vime.config import RunConfig
    from vime.messages.pipeline import RolloutGroup, Sample
    from vime.runtime import ActorSettings
    from vime.transports.codec import Envelope

    config = RunConfig().replace(custom_reward="reward_plugins:slow_on_slow", reward_workers=2,
                                 reward_timeout=30.0).to_dict()
    actor = Reward(ActorSettings(name="reward", listen="ipc:///nonexistent"), config)
    sent: list[tuple[int, float]] = []
    actor._send_hook = lambda envelope: sent.append((envelope.payload.group_id, time.monotonic()))

    def group(group_id: int, response: str) -> RolloutGroup:
        sample = Sample(group_id=group_id, index=0, prompt_ids=[1], response_ids=[2], logprobs=[0.0], versions=[0],
                        finish_reason="stop", label="1", metadata={}, response_text=response)
        return RolloutGroup(group_id=group_id, samples=[sample], worker="rollout-0", generate_s=0.0,
                            finished_at=0.0)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            actor._nursery = nursery
            await actor.on_start()
            async with trio.open_nursery() as warm:  # both processes up: time the scoring alone
                for _ in range(2):
                    warm.start_soon(actor.workers.score, "x", "1", {})
            started = time.monotonic()
            for group_id, response in enumerate(["slow"] + ["fast"] * 6):
                payload = group(group_id, response)
                envelope = Envelope("RolloutGroup", "rollout-0", "reward", group_id, None, 0.0, None, False, payload)
                await actor._on_group(payload, envelope)
            while len(sent) < 7:
                await trio.sleep(0.05)
            await actor.on_stop()
            nursery.cancel_scope.cancel()
    assert [group_id for group_id, _ in sent] == list(range(7))
    assert sent[-1][1] - started < 4.8
