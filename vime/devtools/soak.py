"""Soak: a long run of the command-line scenario under kill -9s, continued as a user would, then audited.

A kill that a run survives is not proof that nothing was lost: a group can vanish between the buffer and
the router, be trained twice after a resume, or a resumed data cursor can skip prompts, and the run still
ends with a fine reward. So :func:`soak` kills, and :func:`audit` then checks the run to the group:

* every group the buffer issued is trained, dropped (stale, filtered), or still in flight or ready at the end
  (summary.json's counters add up: ``lost`` 0), and none went into two batches (``trained_twice`` 0, the
  trainer's own record of each batch's groups);
* every step from 1 to the last has exactly one row in metrics.jsonl;
* the data cursor neither skips nor repeats: the router's message log (``--record router``) holds every group
  it was sent, in every life of the run, and group ``g`` is always the ``g``-th prompt of the buffer's seeded
  order -- a re-issue or a resumed group comes again under its own id with its own prompt, nothing else;
* nothing is left behind: no process of the run and no shared-memory segment once it ended.

The killing follows the way a user would meet it: the scenario is started with ``python -m vime.scenario``;
a killed rollout worker is restarted by the driver (the soak sees the new process start, then join the run, while
it goes on with its plan: a worker's start can take longer than many steps of a small run); any other actor's death
ends the command with a message naming ``--resume RUN_DIR``, which the soak runs; a killed driver says
nothing, and the soak resumes the run folder as its owner would, once the orphaned actors have gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from vime import checkpoint
from vime.config import RunConfig
from vime.data import PromptSource, load_rows, prompt_messages
from vime.messages.pipeline import GenerateGroup
from vime.metrics import ranges
from vime.transports.codec import Envelope, decode_frame
from vime.transports.msglog import scan

KINDS = ("router", "reward", "trainer", "buffer", "rollout", "driver")
_RESUME = re.compile(r"--resume (\S+)")


class SoakFailed(RuntimeError):
    """The run could not be carried to its end: it hung, failed without a kill, or gave no way to resume."""


@dataclasses.dataclass
class Kill:
    """One kill -9: when (the run's last step then), whom, and what brought the run back."""

    step: int
    kind: str
    name: str
    pid: int
    at_s: float  # seconds into the soak
    recovered_by: str = ""  # "restart" (a rollout worker), "--resume" (any other)
    recovery_s: float | None = None  # from the kill to the new process (a restart) or to the resumed run's first step
    # a restart: from the kill to its joining the run (None: the launch ended first, or it never joined)
    rejoined_s: float | None = None


@dataclasses.dataclass
class Plan:
    """When to kill and whom: every ``every`` steps on average (uniform in [every/2, 3*every/2]); the kinds
    drawn at random from ``kinds``, or taken in the order of ``order`` (then no more kills after it)."""

    every: int
    kinds: tuple[str, ...] = KINDS
    order: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if unknown := sorted((set(self.kinds) | set(self.order)) - set(KINDS)):
            raise ValueError(f"no actor kind {', '.join(unknown)}; kinds are {', '.join(KINDS)}")
        self._random = random.Random(self.seed)
        self._done = 0
        self.next_step = self._gap()

    def _gap(self) -> int:
        return self._random.randint(max(1, self.every // 2), max(1, self.every * 3 // 2))

    def due(self, step: int) -> str | None:
        """The kind to kill now that the run has reached ``step``, or None."""
        if step < self.next_step or (self.order and self._done >= len(self.order)):
            return None
        kind = self.order[self._done] if self.order else self._random.choice(self.kinds)
        self._done += 1
        self.next_step = step + self._gap()
        return kind

    def again(self, kind: str, step: int) -> None:
        """``kind``, due at ``step``, had no live actor to kill (a resumed launch not started yet, its
        actors.json still the killed launch's): in order, it is due again at once rather than dropped."""
        if self.order:
            self._done -= 1
            self.next_step = step


def soak(out: Path, flags: list[str], plan: Plan, *, scenario: str = "arithmetic", stall_s: float = 300.0,
         say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``python -m vime.scenario SCENARIO --out OUT/run FLAGS --record router`` to its end, killing as ``plan``
    says and resuming as the scenario says to; returns the kills, the launches and :func:`audit`'s findings.
    ``FLAGS`` must include ``--save-every`` (a run without checkpoints cannot be resumed). Raises SoakFailed
    when the run hangs (no new step for ``stall_s``), dies with no kill to explain it, or says no way on."""
    run_dir = out / "run"
    env = dict(os.environ, VIME_SHM_DIR=str(out / "shm"), PYTHONUNBUFFERED="1")
    (out / "shm").mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "vime.scenario", scenario, "--out", str(run_dir), *flags, "--record", "router"]
    kills: list[Kill] = []
    launches: list[dict[str, Any]] = []
    started = time.monotonic()
    ended_by: Kill | None = None
    while True:
        log = out / f"launch-{len(launches)}.log"
        saved = checkpoint.latest(run_dir) if launches else None
        launch = {"command": command[1:], "resumed_from": checkpoint.step_of(saved) if saved else 0}
        began = time.monotonic()
        with open(log, "wb") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            watch = _Watch(process, log, run_dir, plan, stall_s, started, say, recovering=ended_by,
                           resumed_from=launch["resumed_from"])
            try:
                ended_by = watch.run()
            except BaseException:  # Ctrl-C, a hang: the run is in its own session and would outlive the soak
                _write_progress(out, kills + watch.kills, launches)
                _kill_tree(process, run_dir)
                raise
        kills += watch.kills
        text = log.read_text(errors="replace")
        launches.append({**launch, "exit": process.returncode, "seconds": round(time.monotonic() - began, 1)})
        _write_progress(out, kills, launches)
        if process.returncode == 0:
            break
        if ended_by is None:
            raise SoakFailed(f"the run ended with exit {process.returncode} and no kill explains it; "
                             f"{log} ends with:\n{_tail(text)}")
        left = _wait_gone(run_dir, 60.0)
        if left:
            raise SoakFailed(f"after the {ended_by.kind} was killed, {len(left)} process(es) of the run stayed "
                             f"(pids {left}); {log}")
        command = _resume_command(scenario, ended_by, text, run_dir, log)
        say(f"resuming after the {ended_by.kind} was killed at step {ended_by.step}")
    return {"kills": [dataclasses.asdict(kill) for kill in kills], "launches": launches,
            "seconds": round(time.monotonic() - started, 1), **audit(run_dir, shm=out / "shm")}


class _Watch:
    """One launch, watched until it exits: its steps, the planned kills, the restarts of killed workers."""

    def __init__(self, process: subprocess.Popen, log: Path, run_dir: Path, plan: Plan, stall_s: float,
                 started: float, say: Callable[[str], None], recovering: Kill | None, resumed_from: int) -> None:
        self.process, self.log, self.run_dir, self.plan, self.stall_s = process, log, run_dir, plan, stall_s
        self.started, self.say, self.recovering, self.resumed_from = started, say, recovering, resumed_from
        self.kills: list[Kill] = []
        self.restarting: list[Kill] = []  # workers killed in this launch, not yet seen back in the run

    def run(self) -> Kill | None:
        """Watch until the launch exits; the kill that ended it (a vital actor's or the driver's), if one did."""
        last_step = _last_step(self.run_dir)
        earlier_file = _identity(self.run_dir / "metrics.jsonl")
        progress_at = time.monotonic()
        ending: Kill | None = None
        while self.process.poll() is None:
            step = _last_step(self.run_dir)
            if step != last_step:
                last_step, progress_at = step, time.monotonic()
            if self.recovering is not None and self._trained_again(step, earlier_file):
                self.recovering.recovered_by = "--resume"
                self.recovering.recovery_s = round(self._now() - self.recovering.at_s, 1)
                self.recovering = None
            self._follow_restarts()
            if time.monotonic() - progress_at > self.stall_s:
                raise SoakFailed(f"no new step for {self.stall_s:.0f} s after step {last_step}; "
                                 f"{self._stalled_with()}; see {self.run_dir}/logs/")
            if ending is None and self._may_kill() and (kind := self.plan.due(step)):
                kill = self._kill(kind, step)
                if kill is None:
                    self.plan.again(kind, step)
                elif kind != "rollout":
                    ending = kill  # the launch ends: no more kills until the run is resumed
            time.sleep(0.2)
        return ending

    def _may_kill(self) -> bool:
        """A kill needs a checkpoint to resume from, and waits until this launch has recovered from the kill that
        ended the one before (trained a step past its checkpoint): killed sooner, that recovery goes unseen. A
        killed driver's orphaned trainer can checkpoint at the very step a kill is due next."""
        return self.recovering is None and checkpoint.latest(self.run_dir) is not None

    def _now(self) -> float:
        return time.monotonic() - self.started

    def _trained_again(self, step: int, earlier_file: tuple[int, int] | None) -> bool:
        """Whether ``step`` is a row this launch trained: past the checkpoint it resumed from, in the metrics.jsonl
        its driver rewrote (cut back to that checkpoint) at start. Not the last step before the launch: after a
        killed driver, its orphaned trainer may write rows past the checkpoint before it notices, and the resumed
        launch cuts them and trains those steps again (a kill due meanwhile would otherwise end the launch with
        its recovery unseen)."""
        return step > self.resumed_from and _identity(self.run_dir / "metrics.jsonl") not in (None, earlier_file)

    def _stalled_with(self) -> str:
        """Which of the run's actors were alive when it stalled, and what the command last said, ending with the
        stack of each of its threads (SIGUSR1: faulthandler; the actors' go to their logs): the run folder of a
        CI test is gone by the time anyone reads its log."""
        alive = [row for row in listed_actors(self.run_dir) if _alive(row["pid"])]
        for pid in [self.process.pid, *(row["pid"] for row in alive)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        deadline, said = time.monotonic() + 5.0, ""
        while time.monotonic() < deadline:  # until the dump has begun and the log has stopped growing
            time.sleep(0.5)
            before, said = said, self.log.read_text(errors="replace")
            if "Thread 0x" in said and said == before:
                break
        said = _tail(said, 60)
        return f"actors alive: {', '.join(row['name'] for row in alive) or 'none'}; {self.log} ends with:\n{said}\n"

    def _kill(self, kind: str, step: int) -> Kill | None:
        """kill -9 one actor of ``kind`` (a rollout worker chosen at random), or the driver; a killed worker is
        followed until it is back (``_follow_restarts``)."""
        if kind == "driver":
            name, pid = "driver", self.process.pid
        else:
            killed = {kill.pid for kill in self.restarting}  # a zombie until the driver reaps it: not again
            alive = [row for row in listed_actors(self.run_dir)
                     if row["role"] == kind and _alive(row["pid"]) and row["pid"] not in killed]
            if not alive:
                return None  # not started yet: due again (Plan.again)
            chosen = random.Random(step).choice(alive)
            name, pid = chosen["name"], chosen["pid"]
        os.kill(pid, signal.SIGKILL)
        kill = Kill(step, kind, name, pid, at_s=round(self._now(), 1))
        self.kills.append(kill)
        self.say(f"step {step}: kill -9 {name} (pid {pid})")
        if kind == "rollout":
            self.restarting.append(kill)
        return kill

    def _follow_restarts(self) -> None:
        """Note each killed worker the driver has started again (a new child of the driver's under its name: not a
        fork of the killed worker outliving it) and, later, has joined the run (listed in actors.json under its new
        pid). Not awaited: under load a worker's start spans tens of steps of a small run, which the plan's later
        kills need."""
        for kill in list(self.restarting):
            if not kill.recovered_by and [pid for pid in run_processes(self.run_dir, kill.name)
                                          if pid != kill.pid and _parent(pid) == self.process.pid]:
                kill.recovered_by, kill.recovery_s = "restart", round(self._now() - kill.at_s, 1)
            if kill.recovered_by and any(row["name"] == kill.name and row["pid"] != kill.pid and _alive(row["pid"])
                                         for row in listed_actors(self.run_dir)):
                kill.rejoined_s = round(self._now() - kill.at_s, 1)
                self.restarting.remove(kill)
            elif not kill.recovered_by and self._now() - kill.at_s > self.stall_s:
                raise SoakFailed(f"{kill.name} was not restarted within {self.stall_s:.0f} s of its kill; "
                                 f"see {self.run_dir}/logs/")


def _write_progress(out: Path, kills: list[Kill], launches: list[dict[str, Any]]) -> None:
    """OUT/soak.json: the kills and launches so far, so that a soak that fails leaves what it did behind
    (the test's temporary folder is all a CI log points at)."""
    record = {"kills": [dataclasses.asdict(kill) for kill in kills], "launches": launches}
    (out / "soak.json").write_text(json.dumps(record, indent=1))


def _resume_command(scenario: str, killed: Kill, text: str, run_dir: Path, log: Path) -> list[str]:
    """What the scenario said to run next. A killed driver says nothing; its owner resumes the run folder."""
    if killed.kind != "driver":
        said = _RESUME.findall(text)
        if not said or Path(said[-1]) != run_dir:
            raise SoakFailed(f"the run ended after the {killed.kind} was killed without naming --resume {run_dir}; "
                             f"{log} ends with:\n{_tail(text)}")
    return [sys.executable, "-m", "vime.scenario", scenario, "--resume", str(run_dir), "--record", "router"]


def _kill_tree(process: subprocess.Popen, run_dir: Path) -> None:
    """kill -9 the command and every process of its run, again for one that appears meanwhile (a restart under
    way), until none is left (10 s at most)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10.0
    while (left := run_processes(run_dir)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _wait_gone(run_dir: Path, limit_s: float) -> list[int]:
    """Wait for the actors of a launch that ended to exit (an orphan exits once it sees its driver gone);
    the pids still there after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while (left := run_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def run_processes(run_dir: Path, name: str | None = None) -> list[int]:
    """Processes started for this run (each actor's command line names the run folder); only the actor ``name``'s
    when given."""
    marker = f"--run-dir\0{run_dir}\0".encode()
    named = f"--name\0{name}\0".encode() if name else b""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                if marker in cmdline and named in cmdline:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _parent(pid: int) -> int | None:
    """The parent of process ``pid``; None once it has gone."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def listed_actors(run_dir: Path) -> list[dict[str, Any]]:
    """The actors RUN_DIR/actors.json lists now (name, role, pid, ...); none while it is not written."""
    try:
        return json.loads((run_dir / "actors.json").read_text())["actors"]
    except (OSError, ValueError, KeyError):
        return []  # not written yet, or being replaced


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError):
        return 0  # absent, or a line being written


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file ``path`` is (device, inode): the driver replaces metrics.jsonl as it starts; None if absent."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def audit(run_dir: Path, shm: Path | None = None) -> dict[str, Any]:
    """Check a finished run to the group (the module's list); ``findings`` lists what does not hold."""
    config = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    groups, findings = summary["groups"], []
    steps = [row["step"] for row in rows]
    if steps != list(range(1, config.job.steps + 1)):
        findings.append(f"metrics.jsonl has steps {ranges(steps)}, not 1..{config.job.steps} once each")
    accounted = sum(groups[key] for key in ("trained", "dropped_stale", "dropped_filtered", "in_flight_at_end",
                                            "ready_at_end"))
    if groups["issued"] != accounted or groups["lost"] or groups["trained_twice"]:
        findings.append(f"groups do not add up: {groups}")
    trained = [group for row in rows for group in row.get("group_ids", ())]
    if len(trained) != config.job.steps * config.data.rollout_batch_size:
        findings.append(f"{len(trained)} groups in the batches of {config.job.steps} steps of "
                        f"{config.data.rollout_batch_size}")
    issued = _issued_prompts(run_dir / "messages" / "router.vlog")
    findings += _cursor_findings(config, issued, groups["issued"])
    left = run_processes(run_dir)
    if left:
        findings.append(f"processes of the run still alive at the end: {left}")
    segments = sorted(path.name for path in shm.iterdir()) if shm is not None and shm.is_dir() else []
    if segments:
        findings.append(f"shared-memory segments left behind: {segments[:5]}{' ...' if len(segments) > 5 else ''}")
    return {"groups": groups, "steps": len(rows), "trained_ids": len(set(trained)),
            "groups_seen_by_router": len(issued), "findings": findings,
            "reward_final20": sum(row["raw_reward"] for row in rows[-20:]) / max(1, len(rows[-20:]))}


def _issued_prompts(log: Path) -> dict[int, list[tuple[str, Any]]]:
    """Every GenerateGroup the router received, in every life of the run: group id -> (label, messages) each
    time it came."""
    found: dict[int, list[tuple[str, Any]]] = {}
    for record in scan(log).records:
        if record.direction != "in":
            continue
        frame = decode_frame(bytearray(record.frame), max_message_bytes=1 << 62, resolve_shm=record.resolve_shm)
        for message in frame.messages:
            if isinstance(message, Envelope) and isinstance(message.payload, GenerateGroup):
                group = message.payload
                found.setdefault(group.group_id, []).append((group.label, group.messages))
    return found


def _cursor_findings(config: RunConfig, issued: dict[int, list[tuple[str, Any]]], count: int) -> list[str]:
    """Group ``g`` must be the ``g``-th prompt of the buffer's seeded order, every time it came, and the ids
    the router saw must be exactly those the buffer counts as issued (no eval, injection or hook in a soak)."""
    data = config.data
    findings = []
    if sorted(issued) != list(range(count)):
        findings.append(f"the router saw groups {ranges(sorted(issued))}; the buffer issued 0..{count - 1}")
    source = PromptSource(load_rows(data.data, data.custom_data_source, input_key=data.input_key,
                                    label_key=data.label_key), seed=config.job.seed, epochs=data.epochs)
    wrong = []
    for group_id in range(max(issued, default=-1) + 1):
        row = source.next()
        expected = None if row is None else (str(row["label"]), prompt_messages(
            row["prompt"], template=data.prompt_template, chat=data.chat_template))
        if any(came != expected for came in issued.get(group_id, ())):
            wrong.append(group_id)
    if wrong:
        findings.append(f"{len(wrong)} group(s) came with another prompt than the data order's: {wrong[:10]}")
    return findings
