"""The asynchronous pipeline under failure: killed and leaving workers, a killed trainer
and a resume, a worker joining over tcp -- with exact accounting of every prompt group."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from vime import checkpoint
from vime.cluster import Cluster
from vime.messages.runtime import StatusQuery
from vime.metrics import MetricsFollower, StepRows
from vime.pipeline import RunFailed, train
from vime.scenarios import arithmetic


def config_for(run_dir: Path, **overrides):
    return arithmetic.prepare(run_dir, arithmetic.defaults().replace(**overrides))


async def stop_while_busy(job: Cluster, worker: str, timeout: float = 30.0) -> int:
    """Freeze ``worker`` (SIGSTOP) at a moment the router has groups out with it, and return
    how many: a fault then hits a worker that certainly holds work, however fast it generates."""
    with trio.fail_after(timeout):
        while True:
            counters = (await job.ask("router", StatusQuery(), timeout=10)).counters
            if counters.get(f"assigned:{worker}", 0) > 0:
                job.kill(worker, signal.SIGSTOP)
                await trio.sleep(0.5)  # what it sent before it stopped reaches the router (slow on a loaded CI)
                held = (await job.ask("router", StatusQuery(), timeout=10)).counters.get(f"assigned:{worker}", 0)
                if held:
                    return held
                job.kill(worker, signal.SIGCONT)
            await trio.sleep(0.002)


async def hold_run_until_serving(job: Cluster, worker: str, event: str) -> None:
    """Freeze the buffer (no new work, so no more steps) until ``worker`` has had ``event`` at the driver
    and has said WorkerReady to the router: fast machines would otherwise finish the run first."""
    job.kill("buffer", signal.SIGSTOP)
    try:
        await job.wait_event(event, worker, timeout=90)
        with trio.fail_after(90):
            while f"assigned:{worker}" not in (await job.ask("router", StatusQuery())).counters:
                await trio.sleep(0.05)
    finally:
        job.kill("buffer", signal.SIGCONT)


def assert_every_group_trained_once(summary: dict, rows: list[dict], steps: int, batch: int) -> None:
    groups = summary["groups"]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert [row["weight_version"] for row in rows] == list(range(1, steps + 1))
    assert groups["trained"] == steps * batch == sum(len(row["group_ids"]) for row in rows)
    assert groups["lost"] == 0 and groups["trained_twice"] == 0
    assert groups["issued"] == sum(groups[k] for k in ("trained", "in_flight_at_end", "ready_at_end",
                                                        "dropped_stale", "dropped_filtered"))


# auto: nng on CPU; broadcast: a gloo group each, formed again on every restart (slow tier: the broadcast path
# itself runs by default in test_pipeline.py)
@pytest.mark.parametrize("weight_sync", ["auto", pytest.param("broadcast", marks=pytest.mark.slow)])
async def test_killed_twice_and_leaving_workers_lose_and_repeat_nothing(tmp_path, weight_sync):
    run_dir = tmp_path / "run"
    steps, batch = 24, 16  # the faults come at steps 2, 5 and 7: a fast run must not end before the third
    config = config_for(run_dir, steps=steps, rollout_workers=3, rollout_batch_size=batch, rollout_capacity=4,
                        max_staleness=1, max_new_tokens=12, off_policy_correction="tis", weight_sync=weight_sync)
    done: list[str] = []
    held: list[int] = []

    async def faults(job: Cluster, row: dict) -> None:
        if row["step"] == 2:
            held.append(await stop_while_busy(job, "rollout-0"))
            job.kill("rollout-0")
            await hold_run_until_serving(job, "rollout-0", "restarted")  # so the new process can be killed again
            done.append("killed at 2")
        if row["step"] == 5:  # the restarted process
            held.append(await stop_while_busy(job, "rollout-0"))
            job.kill("rollout-0")
            done.append("killed at 5")
        if row["step"] == 7:
            held.append(await stop_while_busy(job, "rollout-2"))
            job.kill("rollout-2", signal.SIGTERM)
            job.kill("rollout-2", signal.SIGCONT)
            await job.wait_event("died", "rollout-2", timeout=30)
            done.append("left")

    summary = await train(config, run_dir, on_step=faults, timeout_s=300)
    rows = MetricsFollower(run_dir).new_rows()
    assert done == ["killed at 2", "killed at 5", "left"]
    assert_every_group_trained_once(summary, rows, steps, batch)
    assert summary["groups"]["reissued"] >= held[0] + held[1] >= 2  # the killed worker's groups went elsewhere
    assert all(row["staleness_max"] <= 1 for row in rows)
    router_log = (run_dir / "logs" / "router.log").read_text()
    # "left" is the router re-issuing what it had out with rollout-2 on its WorkerLeaving. The worker's own
    # list may be empty: groups the router sent just before the SIGSTOP can still sit unread in its socket.
    assert '"why": "gone"' in router_log and '"why": "left"' in router_log
    starts = (run_dir / "logs" / "rollout-2.log").read_text().count('"event": "joined"')
    assert starts == 1  # SIGTERM is a leave: the worker was not started again
    paths = (run_dir / "logs" / "trainer.log").read_text().count(f'"path": "{config.job.weight_sync}"')
    if weight_sync == "broadcast":  # three workers, rollout-0 again, and perhaps again before the end
        assert paths in (4, 5)


@pytest.mark.parametrize("victim", ["trainer", pytest.param("buffer", marks=pytest.mark.slow)])  # CI time
async def test_a_killed_trainer_or_buffer_resumes_from_the_checkpoint_with_nothing_lost_or_repeated(tmp_path, victim):
    run_dir = tmp_path / "run"
    steps, batch = 12, 16
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in arithmetic.prompts()[:8]))
    config = config_for(run_dir, steps=steps, rollout_workers=2, rollout_batch_size=batch, rollout_capacity=4,
                        max_staleness=2, save_every=3, eval_data=str(held_out), eval_every=2)

    async def kill(job: Cluster, row: dict) -> None:
        if row["step"] == 5:
            job.kill(victim)

    died = rf"actor {victim} died .*checkpoint of step \d+ with --resume {run_dir}"
    with pytest.raises(RunFailed, match=died) as failed:
        await train(config, run_dir, on_step=kill, timeout_s=240)
    saved = checkpoint.latest(run_dir)
    assert saved is not None and f"checkpoint of step {checkpoint.step_of(saved)} " in str(failed.value)
    resumed_at = checkpoint.step_of(saved)
    assert 3 <= resumed_at < steps
    before = {row["step"]: row for row in MetricsFollower(run_dir).new_rows()}
    summary = await train(config, run_dir, resume=True, timeout_s=240)
    rows = MetricsFollower(run_dir).new_rows()
    assert_every_group_trained_once(summary, rows, steps, batch)
    assert [rows[s]["group_ids"] for s in range(resumed_at)] == [before[s + 1]["group_ids"] for s in range(resumed_at)]
    assert summary["groups"]["resumed_in_flight"] + summary["groups"]["ready_at_end"] > 0
    assert "resumed" in (run_dir / "logs" / "trainer.log").read_text()
    assert "resumed" in (run_dir / "logs" / "buffer.log").read_text()
    # every scheduled version scored once: those after the checkpoint again, none twice, none missing
    evals = [json.loads(line)["weight_version"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert sorted(evals) == [0, 2, 4, 6, 8, 10, 12]
    assert [row.get("eval/weight_version") for row in rows] == [None, 2, None, 4, None, 6, None, 8, None, 10, None, 12]


async def test_a_checkpoint_is_published_only_once_its_steps_row_is_in_metrics_jsonl(tmp_path):
    """A resumed run keeps the rows up to its checkpoint's step and trains from the next, so a checkpoint
    published before its step's row loses that row for good if the trainer stops in between. The soak met it:
    the trainer, told to stop as the router died, wrote checkpoint 18 and never row 18; the resumed driver then
    waited forever for 36 rows. Here a thread reads metrics.jsonl the moment each checkpoint is named latest
    (with evaluation on, a row waits for its version's score, the widest gap there was)."""
    run_dir = tmp_path / "run"
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in arithmetic.prompts()[:8]))
    config = config_for(run_dir, steps=9, rollout_workers=2, rollout_batch_size=16, rollout_capacity=4,
                        max_staleness=2, save_every=2, eval_data=str(held_out), eval_every=2)
    rows_at: dict[int, list[int]] = {}
    stop = threading.Event()

    def watch() -> None:
        pointer = checkpoint.folder(run_dir) / "latest"
        while not stop.is_set():
            with contextlib.suppress(OSError):
                step = checkpoint.step_of(Path(pointer.read_text().strip()))
                if step not in rows_at:
                    whole = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
                    rows_at[step] = [json.loads(line)["step"] for line in whole]
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        await train(config, run_dir, timeout_s=240)
    finally:
        stop.set()
        watcher.join()
    assert sorted(rows_at) == [2, 4, 6, 8]
    assert all(rows_at[step][-1] >= step for step in rows_at), rows_at
    said = [json.loads(line) for line in (run_dir / "logs" / "trainer.log").read_text().splitlines()
            if '"checkpoint written"' in line]
    assert [(entry["step"], entry["rows_written"]) for entry in said] == [(2, 2), (4, 4), (6, 6), (8, 8)]


async def test_a_stopping_trainer_writes_no_row_and_so_no_checkpoint_after_its_rows_close(tmp_path):
    """The driver stops the trainer as soon as a vital actor dies; its rows close while a step may still be
    under way. No row is written after that, and the wait a checkpoint makes for its row never ends (the stop
    cancels it): a closed file is neither written to nor synced from another task."""
    rows = StepRows(tmp_path, eval_versions=[], written=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rows.write_loop)
        await rows.add({"step": 1, "weight_version": 1})
        with trio.fail_after(10):
            await rows.until_written(1)
        rows.close()
        await rows.add({"step": 2, "weight_version": 2})
        with trio.move_on_after(0.5) as waiting:
            await rows.until_written(2)
        assert waiting.cancelled_caught
        nursery.cancel_scope.cancel()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_crash_while_saving_leaves_the_previous_checkpoint_usable(tmp_path):
    checkpoint.save(tmp_path, 3, lambda folder: (folder / "state").write_text("three"))

    def crash(folder: Path) -> None:
        (folder / "state").write_text("half of six")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 6, crash)
    latest = checkpoint.latest(tmp_path)
    assert latest is not None and checkpoint.step_of(latest) == 3 and (latest / "state").read_text() == "three"
    for step in (6, 9, 12):
        checkpoint.save(tmp_path, step, lambda folder, s=step: (folder / "state").write_text(str(s)))
    kept = sorted(p.name for p in checkpoint.folder(tmp_path).glob("step_*"))
    assert kept == ["step_00000009", "step_00000012"] and checkpoint.step_of(checkpoint.latest(tmp_path)) == 12


@pytest.mark.slow  # CI time; tests/test_runtime.py covers joining with and without the token at actor level
async def test_a_worker_joins_over_tcp_with_the_token_and_is_refused_without(tmp_path):
    run_dir = tmp_path / "run"
    config = config_for(run_dir, steps=40, rollout_workers=1, rollout_batch_size=8, rollout_capacity=4,
                        max_staleness=1, max_new_tokens=8)
    seen: dict[str, object] = {}

    async def join(job: Cluster, row: dict) -> None:
        if row["step"] != 3:
            return
        command = [sys.executable, "-m", "vime.actor", "rollout", "--join", job.address, "--run-dir", str(run_dir)]
        log = open(run_dir / "logs" / "rollout-joined.log", "wb")
        seen["process"] = await trio.lowlevel.open_process([*command, "--name", "rollout-joined", "--token", job.token],
                                                           stdout=log, stderr=log, env=_env())
        refused = await trio.run_process([*command, "--name", "intruder", "--token", "wrong"], capture_stdout=True,
                                         capture_stderr=True, check=False, env=_env())
        seen["refused"] = (refused.returncode, refused.stderr.decode())
        await hold_run_until_serving(job, "rollout-joined", "joined")
        with trio.fail_after(60):
            while not (await job.ask("router", StatusQuery())).counters.get("dispatched_to:rollout-joined"):
                await trio.sleep(0.05)
        seen["joined_at_step"] = row["step"]

    try:
        summary = await train(config, run_dir, transport="tcp", on_step=join, timeout_s=400)
    finally:
        if "process" in seen and seen["process"].returncode is None:
            with trio.move_on_after(30):  # the job's end shuts the joined worker down too
                await seen["process"].wait()
            seen["process"].kill()
    code, said = seen["refused"]
    assert code == 2 and "join refused" in said and "token" in said, said
    assert seen["joined_at_step"] == 3
    assert (run_dir / "join").stat().st_mode & 0o077 == 0  # the token is for the run's owner only
    assert seen["process"].returncode == 0  # it left when the job ended
    joined = [line for line in (run_dir / "logs" / "rollout-joined.log").read_text().splitlines() if '"joined"' in line]
    assert joined and '"weight_version": 0' not in joined[0]  # it had the current weights before serving
    rows = MetricsFollower(run_dir).new_rows()
    assert_every_group_trained_once(summary, rows, 40, 8)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ, PYTHONUNBUFFERED="1")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by whoever adopted it does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
