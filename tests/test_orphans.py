"""No orphans, no leaks: whatever way a job ends, no vime process stays and nothing stays in the shared-memory
folder (segments, the driver's ipc sockets).

Each test gives its processes a mark of their own in their environment (``marked_processes``) and a
shared-memory folder of their own (``VIME_SHM_DIR``), so other users' runs on the same machine are never
looked at, nor touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import trio
from test_async import _alive

from conftest import SESSION_MARK, marked_processes, open_job
from vime.runtime import Actor
from vime.scenarios import arithmetic
from vime.scenarios.selfcheck import ECHO, Blob
from vime.transports.shm import SegmentPool, map_segment, remove_left_by, sweep_stale

TESTS = Path(__file__).parent
GONE_WITHIN_S = 45.0  # a loaded 2-core machine; about 3 s when idle


@pytest.fixture
def shm_dir(monkeypatch):
    """A shared-memory folder of this test's own, for it and every process it starts."""
    folder = Path(tempfile.mkdtemp(prefix="vime-tests-", dir=os.environ.get("VIME_SHM_DIR")))
    monkeypatch.setenv("VIME_SHM_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_the_startup_sweep_removes_only_what_dead_processes_of_this_user_left(shm_dir):
    dead = _dead_pid()
    (shm_dir / f"vime-{dead}-0a1b2c3d-0").write_bytes(b"x" * 4096)
    (shm_dir / f"vime-{dead}-ipc-k2j3h4").mkdir()
    (shm_dir / f"vime-{dead}-ipc-k2j3h4" / "driver").touch()
    live = shm_dir / f"vime-{os.getpid()}-0a1b2c3d-0"
    live.touch()
    other_users = shm_dir / f"vime-{_dead_pid()}-99999999-0"
    other_users.touch()
    os.chown(other_users, 65534, 65534)
    unrelated = shm_dir / "torch_1234_5678"
    unrelated.touch()
    removed = sweep_stale()
    assert sorted(removed) == sorted([f"vime-{dead}-0a1b2c3d-0", f"vime-{dead}-ipc-k2j3h4"])
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([live.name, other_users.name, unrelated.name])


async def test_a_driver_sweeps_what_a_killed_run_left_as_it_starts(shm_dir, tmp_path):
    """A run killed with kill -9 left its segments; the next driver to start frees them."""
    left = shm_dir / f"vime-{_dead_pid()}-0a1b2c3d-0"
    left.write_bytes(b"x" * 4096)
    async with open_job(tmp_path):
        assert not left.exists()


async def test_the_driver_removes_the_segments_of_an_actor_killed_with_kill_9(shm_dir, tmp_path):
    async with open_job(tmp_path) as job:
        info = await job.spawn(ECHO, "echo0")
        tensor = torch.randn(1 << 20)  # 4 MiB: sent through shared memory both ways
        reply = await job.ask("echo0", Blob(tensor=tensor, echo=True))
        assert torch.equal(reply.tensor, tensor)
        assert list(shm_dir.glob(f"vime-{info.pid}-*")), "the echo lent no segment: nothing to test"
        os.kill(info.pid, signal.SIGKILL)
        await job.wait_event("died", "echo0")
        assert not list(shm_dir.glob(f"vime-{info.pid}-*"))
        assert torch.equal(reply.tensor, tensor)  # what we had received stays readable


def test_removing_a_dead_process_segments_keeps_the_receivers_mappings(shm_dir):
    pool = SegmentPool()
    data = memoryview(bytearray(b"abc" * 1000))
    name = pool.lend(data, "receiver")
    mapping = map_segment(name, len(data))
    remove_left_by(os.getpid())
    assert not (shm_dir / name).exists() and bytes(mapping[:3]) == b"abc"
    pool.close()


class Blocker(Actor):
    """Blocks its event loop for good once registered, as a long computation would: only the watchdog thread
    can end it. It says so first (RUN_DIR/blocked): a driver killed before the loop blocks is seen by the loop's
    own watch, which stops the actor gracefully, and the watchdog never acts (a CI run met it)."""

    role = "blocker"

    async def on_start(self) -> None:
        (Path(self.settings.run_dir) / "blocked").touch()
        time.sleep(3600)


DRIVER_SCRIPT = """
import pathlib, sys, trio
from vime import Cluster

async def main():
    async with Cluster.open(sys.argv[1]) as job:
        info = await job.spawn("test_orphans:Blocker", "blocker", timeout=120)
        while not (pathlib.Path(sys.argv[1]) / "blocked").exists():  # its loop is blocked from now on
            await trio.sleep(0.05)
        print(info.pid, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_an_actor_whose_loop_is_blocked_still_exits_when_its_driver_is_killed(shm_dir, tmp_path):
    """The graceful stop cannot run (the loop never yields), so the watchdog thread must end the process.
    Mutation: without the watchdog the blocker lives on (an hour)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        blocker = int(await trio.to_thread.run_sync(driver.stdout.readline))
    finally:
        driver.kill()
        driver.wait()
    await _wait_gone(lambda: [blocker] if _alive(blocker) else [], "the blocked actor outlived its driver")
    assert "did not stop within" in (tmp_path / "logs" / "blocker.log").read_text()
    assert not list(shm_dir.iterdir())  # the driver's ipc sockets went with the last actor


ENDINGS = ["normal end", "Ctrl-C", "SIGTERM", "kill -9", "kill -9 of the trainer"]


@pytest.mark.slow
@pytest.mark.parametrize("ending", ENDINGS)
def test_a_cli_run_leaves_no_process_and_no_shared_memory(shm_dir, tmp_path, ending):
    """``python -m vime.scenario`` ended each way, with the run at work (weights went through shared memory):
    afterwards no process of the run is left and the shared-memory folder is empty. A trainer killed with
    kill -9 ends the run (the driver stops the rest); its segments must go with it."""
    mark = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    model = tmp_path / "model"
    arithmetic.build_model(model, seed=0, hidden_size=512)  # weights of 1 MiB: they travel by shared memory
    steps = 2 if ending == "normal end" else 1000
    driver = subprocess.Popen(
        [sys.executable, "-m", "vime.scenario", "arithmetic", "--out", str(run_dir), "--steps", str(steps),
         "--rollout-batch-size", "16", "--model-path", str(model)],
        env=dict(os.environ, **{SESSION_MARK: mark}, PYTHONUNBUFFERED="1"), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if ending == "normal end":
            assert driver.wait(timeout=300) == 0, driver.stderr.read()[-3000:]
        else:
            _wait_for_a_step(driver, run_dir)
            assert list(shm_dir.glob(f"vime-{_trainer_pid(run_dir)}-*")), "the trainer lent no segment: nothing to test"
            _end(driver, ending, run_dir)
            driver.wait(timeout=120)
        left = _wait_gone_sync(lambda: marked_processes(mark))
        assert not left, f"left running after {ending}: {left}"
        assert not list(shm_dir.iterdir()), f"left in the shared-memory folder after {ending}"
    finally:
        for pid, _ in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()


def _wait_for_a_step(driver: subprocess.Popen, run_dir: Path) -> None:
    """Until metrics.jsonl holds a row: every actor is up and weights have travelled."""
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert driver.poll() is None, f"the run ended early: {driver.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no step within 300 s"
        time.sleep(0.2)


def _end(driver: subprocess.Popen, ending: str, run_dir: Path) -> None:
    if ending == "Ctrl-C":  # the terminal sends SIGINT to the whole foreground process group
        os.killpg(driver.pid, signal.SIGINT)
    elif ending == "kill -9 of the trainer":
        os.kill(_trainer_pid(run_dir), signal.SIGKILL)
    else:
        driver.send_signal(signal.SIGTERM if ending == "SIGTERM" else signal.SIGKILL)


def _trainer_pid(run_dir: Path) -> int:
    actors = json.loads((run_dir / "actors.json").read_text())["actors"]
    return next(actor["pid"] for actor in actors if actor["name"] == "trainer")


def _wait_gone_sync(left: Callable[[], list[Any]]) -> list[Any]:
    """What ``left()`` still returns after up to GONE_WITHIN_S (empty: all gone)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while (found := left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


async def _wait_gone(left: Callable[[], list[Any]], message: str) -> None:
    found = await trio.to_thread.run_sync(_wait_gone_sync, left)
    assert not found, f"{message}: {found}"


def test_the_leak_check_leaves_out_compile_workers_serving_this_process_only():
    """torch.compile's worker pool (GPU tests compile the log-probs) watches the process named by its --parent
    flag and ends with it: the end-of-session check must not call it a leak, which made a passing GPU run
    exit 1. A worker serving another process is still one."""
    mark = uuid.uuid4().hex
    environment = {**os.environ, SESSION_MARK: mark}
    worker = "torch/_inductor/compile_worker/__main__.py"
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", worker, f"--parent={os.getpid()}"],
                            env=environment)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", worker, f"--parent={ours.pid}"],
                             env=environment)
    try:
        deadline = time.monotonic() + 10
        while not all(_started(process, worker) for process in (ours, other)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid, _ in marked_processes(mark)] == [other.pid]
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()



def _started(process: subprocess.Popen, argument: str) -> bool:
    """Whether ``process`` runs its own command yet (its command line holds ``argument``), not its parent's fork."""
    try:
        return argument in Path(f"/proc/{process.pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
