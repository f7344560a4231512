"""The soak, CI-sized (issue 32, item 4): the command-line scenario with one kill -9 of each actor kind,
continued as a user would (the restart of a worker, the printed --resume), then audited to the group. The
audit is also shown to catch what it exists for: a lost row, counters that do not add up, a cursor that
skipped (the run checked against another seed's data order)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import pytest

from vime.devtools.soak import KINDS, Plan, SoakFailed, audit, listed_actors, run_processes, soak
from vime.pipeline import last_error

FLAGS = ["--steps", "36", "--save-every", "3", "--max-staleness", "2", "--rollout-workers", "3",
         "--rollout-batch-size", "16", "--seed", "5"]


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    """A run killed once each way (about 2.5 minutes on 2 cores)."""
    out = tmp_path_factory.mktemp("soak")
    order = ("rollout", "trainer", "driver", "router", "reward", "buffer")
    return out, soak(out, FLAGS, Plan(every=3, order=order), stall_s=180)


@pytest.mark.slow
def test_a_run_killed_each_way_is_continued_and_loses_nothing(soaked):
    out, result = soaked
    kills = result["kills"]
    assert sorted(kill["kind"] for kill in kills) == sorted(KINDS)
    recovered = [kill["recovered_by"] == ("restart" if kill["kind"] == "rollout" else "--resume") for kill in kills]
    assert all(recovered), kills
    assert result["findings"] == []
    groups = result["groups"]
    assert groups["lost"] == 0 and groups["trained_twice"] == 0
    assert result["steps"] == 36 and result["trained_ids"] == 36 * 16
    assert result["groups_seen_by_router"] == groups["issued"]
    # each kill but the worker's ended a launch; the last launch finished
    ending = [kill for kill in kills if kill["kind"] != "rollout"]
    assert [launch["exit"] for launch in result["launches"]] == [
        -9 if kill["kind"] == "driver" else 1 for kill in ending] + [0]
    for index, kill in enumerate(ending):
        if kill["kind"] != "driver":  # it names its own death, not the last words of the actor's earlier life
            said = (out / f"launch-{index}.log").read_text()
            assert f"run failed: actor {kill['name']} died (killed by SIGKILL); see" in said


@pytest.mark.slow
def test_the_audit_finds_a_lost_row_counters_that_do_not_add_up_and_a_skipping_cursor(soaked, tmp_path):
    out, _ = soaked
    run = tmp_path / "run"
    shutil.copytree(out / "run", run, ignore=shutil.ignore_patterns("checkpoints", "model*"))
    shutil.copytree(out / "run" / "model", run / "model")
    assert audit(run)["findings"] == []

    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:10] + lines[11:]))
    assert any("steps 1-10, 12-36" in finding for finding in audit(run)["findings"])
    metrics.write_text("".join(lines))

    summary = json.loads((run / "summary.json").read_text())
    summary["groups"]["trained"] -= 1
    (run / "summary.json").write_text(json.dumps(summary))
    assert any("do not add up" in finding for finding in audit(run)["findings"])
    summary["groups"]["trained"] += 1
    (run / "summary.json").write_text(json.dumps(summary))

    config = json.loads((run / "config.json").read_text())
    config["job"]["seed"] += 1
    (run / "config.json").write_text(json.dumps(config))
    assert any("another prompt than the data order's" in finding for finding in audit(run)["findings"])


def test_an_actor_s_last_error_is_from_its_own_life_not_an_earlier_one(tmp_path):
    log = tmp_path / "router.log"
    earlier = {"event": "the driver that started this actor is gone", "level": "error",
               "timestamp": "2026-12-03T18:00:00.000000Z"}
    now = {"event": "stepping", "level": "info", "timestamp": "2026-12-03T18:05:00.000000Z"}
    log.write_text(json.dumps(earlier) + "\n" + json.dumps(now) + "\n")
    assert last_error(log) == "the driver that started this actor is gone"
    assert last_error(log, since=1796321000.0) is None  # 18:03:20 UTC that day: after the earlier life


def test_an_actor_s_own_exit_message_is_its_last_error(tmp_path):
    """An actor ending itself with exit 2 prints why as a plain line (a TLS run's buffer died so in CI, and the
    console said only "exited with code 2; see buffer.log")."""
    log = tmp_path / "buffer.log"
    info = {"event": "serving", "level": "info", "timestamp": "2026-12-03T18:05:00.000000Z"}
    log.write_text(json.dumps(info) + "\nvime.actor: the driver at tcp://h:1 did not answer\n\n")
    assert last_error(log, since=1796321000.0) == "the driver at tcp://h:1 did not answer"


def test_a_stalled_run_is_reported_with_its_live_actors_and_the_commands_stacks(tmp_path):
    """A hang in CI leaves only the test's output: the stall names the live actors and ends with every thread's
    stack of the command (SIGUSR1 to faulthandler), and the run is killed, nothing of it left behind."""
    stop = threading.Event()

    def freeze_the_trainer() -> None:  # no step can come: the run hangs at step 0
        while not stop.wait(0.2):
            trainer = [row for row in listed_actors(tmp_path / "run") if row["role"] == "trainer"]
            if trainer:
                os.kill(trainer[0]["pid"], signal.SIGSTOP)
                return

    freezer = threading.Thread(target=freeze_the_trainer, daemon=True)
    freezer.start()
    try:
        with pytest.raises(SoakFailed) as stalled:
            soak(tmp_path, FLAGS, Plan(every=3, order=("reward",)), stall_s=15, say=lambda line: None)
    finally:
        stop.set()
        freezer.join()
    said = str(stalled.value)
    assert "no new step for 15 s after step 0; actors alive: router, reward" in said  # spawned first
    assert "Thread 0x" in said and 'File "' in said  # faulthandler's dump of the command's threads
    assert run_processes(tmp_path / "run") == []
    assert json.loads((tmp_path / "soak.json").read_text()) == {"kills": [], "launches": []}
