"""Where a run's start-up goes: from the command to its first step, phase by phase.

The driver times its own phases (the command until ``train()`` is called: imports, flags, a scenario's set-up;
the checks before any actor starts; opening the job; waiting for nodes; each actor's spawn until it registers).
Each actor times what it does after registering where the work happens (:func:`timed` into
``Actor.startup``: the trainer's engine build and checkpoint read, a rollout worker's wait for its GPU turn and
its engine build) and reports it in its Status (``Status.startup``), which the driver asks for once the first
step's row comes. The breakdown is printed then and written to summary.json (``startup``).

The phases overlap (rollout engines build while the trainer builds its own, and the trainer's first step waits
for them), so their sum is given beside the wall time to the first step: a sum far above it means the start-up
overlaps well, one near it that the phases ran one after another. Durations only: an actor on another host
reports seconds of its own clock, never a time of day that clock skew would shift.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import psutil
import trio

from vime.messages.runtime import StatusQuery
from vime.runtime import PeerGone, RemoteError

# the driver's own phases, in the order they happen, and what each holds (for the console)
DRIVER_PHASES = {"command_s": "imports, flags, set-up", "preflight_s": "checks, run folder",
                 "cluster_open_s": "the driver's sockets", "wait_for_nodes_s": "node agents to join"}
REPORT_TIMEOUT_S = 5.0  # an actor still starting (an engine not built by the first step) is left out after this


@contextlib.contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    """Add the seconds the block takes to ``into[key]``, if it ends without an error (a phase that failed
    has no duration to report: the run fails with it)."""
    began = time.monotonic()
    yield
    into[key] = into.get(key, 0.0) + time.monotonic() - began


def command_started() -> float:
    """Wall time this process started: a run's start-up counts from the command, imports included."""
    return psutil.Process().create_time()


class StartupClock:
    """The driver's side of the breakdown. Made as ``train()`` begins, which ends the first phase
    (``command_s``, from ``launched_at``, the wall time of the command's start; None: from now, for a run
    started from a program that was already running, such as a test); :meth:`lap` ends each next phase of the
    driver's own, :func:`timed` times the others into :attr:`phases` (a number) or :attr:`spawns` (per actor)."""

    def __init__(self, launched_at: float | None = None) -> None:
        now = time.monotonic()
        self.origin = now if launched_at is None else now - max(0.0, time.time() - launched_at)
        self.phases: dict[str, float] = {"command_s": now - self.origin}
        self.spawns: dict[str, float] = {}  # actor -> seconds from its spawn until it registered
        self.breakdown: dict[str, Any] | None = None  # once the first step came
        self._lap = now

    def lap(self, phase: str) -> None:
        """End ``phase``, which began where the previous lap ended."""
        now = time.monotonic()
        self.phases[phase] = now - self._lap
        self._lap = now

    async def first_step(self, job: Any, row: dict[str, Any]) -> dict[str, Any]:
        """The breakdown once the first step's ``row`` has come (kept in :attr:`breakdown`): the driver's
        phases, every phase the actors it spawned report (``{phase: {actor: seconds}}``, their spawns as
        ``spawn_s``), the step's own time as its row says (``step_time_s``: waiting for its batch, training,
        publishing), their sum (``phases_sum_s``) and the wall time from the command to the row
        (``first_step_s``)."""
        first_step_s = time.monotonic() - self.origin
        per_actor: dict[str, dict[str, float]] = {"spawn_s": dict(self.spawns)}
        reports = await _reports(job, list(self.spawns))
        for name in self.spawns:  # in the order they were spawned
            for phase, seconds in reports.get(name, {}).items():
                per_actor.setdefault(phase, {})[name] = seconds
        phases = {**self.phases, **per_actor, "step_time_s": float(row.get("step_time_s") or 0.0)}
        total = sum(sum(value.values()) if isinstance(value, dict) else value for value in phases.values())
        self.breakdown = {**phases, "phases_sum_s": total, "first_step_s": first_step_s}
        return self.breakdown


async def _reports(job: Any, names: list[str]) -> dict[str, dict[str, float]]:
    """What each of ``names`` reports of its start-up, asked all at once; one that does not answer within
    ``REPORT_TIMEOUT_S`` (still building its engine) or is gone is left out."""
    reports: dict[str, dict[str, float]] = {}

    async def ask(name: str) -> None:
        with contextlib.suppress(TimeoutError, PeerGone, RemoteError, LookupError):
            reports[name] = (await job.ask(name, StatusQuery(), timeout=REPORT_TIMEOUT_S)).startup

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(ask, name)
    return reports


def describe(breakdown: dict[str, Any]) -> str:
    """The breakdown for the console: a head line with the wall time to the first step and the phases' sum,
    then one line per phase, an actor's phases as ``name seconds`` pairs."""
    wall, total = breakdown["first_step_s"], breakdown["phases_sum_s"]
    side = (f"{total - wall:.1f} s ran side by side" if total >= wall
            else f"{wall - total:.1f} s in no phase")
    lines = [f"start-up: first step {wall:.1f} s after the command; phases sum to {total:.1f} s ({side})"]
    for phase, value in breakdown.items():
        if phase in ("first_step_s", "phases_sum_s"):
            continue
        label = phase.removesuffix("_s").replace("_", " ")
        if isinstance(value, dict):
            shown = "  ".join(f"{name} {seconds:.2f}" for name, seconds in value.items())
        else:
            shown = f"{value:.2f}" + (f"  ({DRIVER_PHASES[phase]})" if phase in DRIVER_PHASES else "")
        lines.append(f"  {label:<18} {shown}")
    return "\n".join(lines)
